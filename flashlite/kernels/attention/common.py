"""Pieces of the attention forward loop, shared by its loop variants: load a tile, score it,
fold it into the statistics, accumulate ``p·v``. The statistics are :mod:`flashlite.stats`'s, the
mask is :mod:`flashlite.masks`'s, the cast :mod:`flashlite.kernels.common`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.common import cast, tanh
from flashlite.masking.masks import visible
from flashlite.stats import LOG2E, fixed_update, online_update, online_update_lazy


@triton.jit
def load_tile(
    src,
    b,
    h,
    row0,
    n_rows,
    stride_row,
    stride_d,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DESC: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """A ``[rows, BLOCK_D]`` tile of head (b, h) starting at row ``row0``; zeros past the ends.

    ``src`` is a 4-D ``(B, H, N, D)`` tensor descriptor (TMA; it pads out-of-bounds rows and
    columns itself) or a pointer already offset to head (b, h).
    """
    # (one return at the end: the compiler builds both arms of a constexpr `if` otherwise)
    if USE_DESC:
        tile = src.load([b, h, row0, 0]).reshape(offs_r.shape[0], BLOCK_D)
    else:
        rows = row0 + offs_r
        ptrs = src + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :] * stride_d
        if HEAD_DIM == BLOCK_D and not CHECK_ROWS:
            tile = tl.load(ptrs)
        else:
            mask = offs_d[None, :] < HEAD_DIM
            if CHECK_ROWS:
                mask = mask & (rows[:, None] < n_rows)
            tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def head_ptr(X, b, h, stride_b, stride_h):
    """Pointer to head ``(b, h)`` of a ``(B, H, N, D)`` tensor (64-bit offsets: big tensors)."""
    return X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def seq_ptr(X, b, h, row0, stride_b, stride_h, stride_row, VARLEN: tl.constexpr):
    """Pointer to head ``h`` of sequence ``b``: :func:`head_ptr` of a ``(B, H, N, D)`` tensor,
    or with ``VARLEN`` head ``h`` of a packed ``(1, H, total, D)`` tensor at the sequence's
    first row ``row0``."""
    if VARLEN:
        ptr = X + h.to(tl.int64) * stride_h + row0.to(tl.int64) * stride_row
    else:
        ptr = head_ptr(X, b, h, stride_b, stride_h)
    return ptr


@triton.jit
def store_tile(dst, tile, rows, n_rows, stride_row, stride_d, offs_d, HEAD_DIM: tl.constexpr):
    """Store a ``[rows, BLOCK_D]`` tile at the head pointer ``dst``, rows below ``n_rows`` and
    columns below ``HEAD_DIM`` only."""
    ptrs = dst + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :] * stride_d
    tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def scale_q(q, qk_scale, PRESCALE_Q: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Q as the score product takes it, and the exponent scale that goes with those scores.

    With ``PRESCALE_Q``, ``sm_scale·log2(e)`` is folded into Q once per block: the scores arrive
    in exp2's units and the softmax's exponent is one subtraction per score instead of a
    subtract and a multiply, at the cost of one rounding of Q·scale to the input dtype. The
    backward recomputes the scores through the same function, so they match the saved LSE.
    """
    if PRESCALE_Q:
        qs = cast(q.to(tl.float32) * qk_scale, q.dtype, ROUND_BF16)
        exp_scale: tl.constexpr = 1.0
    else:
        qs = q
        exp_scale = qk_scale
    return qs, exp_scale


@triton.jit
def soft_cap(x, cap, FAST: tl.constexpr):
    """Gemma 2's soft cap ``cap·tanh(x/cap)`` of a score tile, and ``tanh(x/cap)`` for the
    backward's derivative ``1 − tanh²``. ``cap`` is in the scores' own units: the host passes
    ``softcap / scale`` for raw ``q·kᵀ`` and ``softcap·log2 e`` for prescaled ones. ``FAST``:
    :func:`tanh`'s hardware approximation (16-bit inputs)."""
    t = tanh(x * (1.0 / cap), FAST)
    return cap * t, t


@triton.jit
def cap_units(softcap, exp_scale, SOFTCAP: tl.constexpr):
    """The soft cap in the scores' units for :func:`soft_cap` (``softcap`` is in natural units,
    the scores are ``q·k`` times ``scale·log2 e / exp_scale``); 0.0 without a cap."""
    cap = 0.0
    if SOFTCAP:
        cap = softcap * LOG2E / exp_scale
    return cap


@triton.jit
def sequence(
    b, seq_q, seq_k, SEQLENS_K, CU_Q, CU_K, HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr
):
    """Batch (or packed sequence) b's ``(q0, seq_q, k0, seq_k)``: the first query and key row of
    its sequence in memory and its lengths. ``VARLEN``: rows ``[CU_Q[b], CU_Q[b + 1])`` of the
    packed queries (``CU_K`` for the keys), the offsets clamped to the packed lengths ``seq_q``
    and ``seq_k`` (unvalidated offsets give wrong rows, never reads outside the tensors);
    ``HAS_SEQLENS``: only ``SEQLENS_K[b]`` of its keys exist (clamped to ``[0, seq_k]``).
    Otherwise row 0 and the lengths passed in."""
    q0 = 0
    k0 = 0
    if VARLEN:
        q0 = tl.minimum(tl.maximum(tl.load(CU_Q + b), 0), seq_q)
        seq_q = tl.minimum(tl.maximum(tl.load(CU_Q + b + 1), q0), seq_q) - q0
        k0 = tl.minimum(tl.maximum(tl.load(CU_K + b), 0), seq_k)
        seq_k = tl.minimum(tl.maximum(tl.load(CU_K + b + 1), k0), seq_k) - k0
    if HAS_SEQLENS:
        seq_k = tl.minimum(tl.maximum(tl.load(SEQLENS_K + b), 0), seq_k)
    return q0, seq_q, k0, seq_k


@triton.jit
def scores(
    q,
    k_src,
    b,
    h_kv,
    start_n,
    k_row,
    offs_m,
    offs_n,
    offs_d,
    seq_q,
    seq_k,
    left,
    right,
    cap,
    stride_kn,
    stride_kd,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """fp32 scores ``q·kᵀ`` of the key tile at ``start_n``, soft-capped with ``SOFTCAP``; on
    ``MASKED`` tiles the keys a row does not see (:func:`flashlite.masks.visible`) get −inf.
    ``k_row``: the sequence's first row in ``k_src`` (0 but for varlen descriptors)."""
    k = load_tile(
        k_src,
        b,
        h_kv,
        k_row + start_n,
        k_row + seq_k,
        stride_kn,
        stride_kd,
        offs_n,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        MASKED,
    )
    return score_tile(
        q,
        k,
        start_n,
        offs_m,
        offs_n,
        seq_q,
        seq_k,
        left,
        right,
        cap,
        MASKED,
        IS_CAUSAL,
        WINDOW,
        SOFTCAP,
        DOT_FP32,
        DOT_PRECISION,
    )


@triton.jit
def score_tile(
    q,
    k,
    start_n,
    rows,
    offs_n,
    seq_q,
    seq_k,
    left,
    right,
    cap,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`scores` of a loaded key tile ``k`` (in the inputs' dtype), for rows at query
    positions ``rows`` (the decode kernel's packed rows share positions)."""
    fast_tanh: tl.constexpr = k.dtype != tl.float32
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        qk, _t = soft_cap(qk, cap, fast_tanh)
    if MASKED:
        seen = visible(rows, start_n + offs_n, seq_q, seq_k, left, right, IS_CAUSAL, WINDOW)
        qk = tl.where(seen, qk, float("-inf"))
    return qk


@triton.jit
def update(
    m,
    s,
    qk,
    exp_scale,
    LAZY_RESCALE: tl.constexpr,
    FIXED_REF: tl.constexpr = False,
    P_DTYPE: tl.constexpr = tl.float32,
):
    """Fold a score tile into ``(m, s)``: ``(m, s, alpha, p, moved)``; the accumulator needs
    ``acc·alpha`` only where ``moved`` (always, unless the reference moves lazily or is fixed).
    ``FIXED_REF``: ``m`` is a fixed reference that bounds every score from above (a soft cap),
    so there is no row maximum to take and nothing to rescale; ``p`` comes back rounded to
    ``P_DTYPE``, the inputs' dtype that :func:`accumulate` multiplies it in."""
    if FIXED_REF:
        s, p = fixed_update(m, s, qk, exp_scale, P_DTYPE)
        alpha = s  # unused: nothing moved
        moved = False
    elif LAZY_RESCALE:  # the reference moves only when a row's maximum grows by a factor > 2^8
        m, s, alpha, p, moved = online_update_lazy(m, s, qk, exp_scale, 8.0)
    else:
        m, s, alpha, p = online_update(m, s, qk, exp_scale)
        moved = True
    return m, s, alpha, p, moved


@triton.jit
def accumulate(
    acc,
    alpha,
    moved,
    p,
    v_src,
    b,
    h_kv,
    start_n,
    k_row,
    seq_k,
    stride_vn,
    stride_vd,
    offs_n,
    offs_d,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """``acc·alpha + p·v`` for the value tile at ``start_n`` (the multiply only where
    :func:`update` says the reference ``moved``). ``k_row`` as in :func:`scores`; with
    ``VARLEN`` descriptors a masked tile's rows past the sequence (the next sequence's values)
    are zeroed, so that ``p = 0`` there cancels them even where they are not finite."""
    if moved:
        acc = acc * alpha[:, None]
    v = load_tile(
        v_src,
        b,
        h_kv,
        k_row + start_n,
        k_row + seq_k,
        stride_vn,
        stride_vd,
        offs_n,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        MASKED,
    )
    if VARLEN and USE_DESC and MASKED:
        v = tl.where((start_n + offs_n)[:, None] < seq_k, v, 0.0)
    p = cast(p, v.dtype, ROUND_BF16)  # tensor-core operands in the input precision
    if DOT_FP32:  # the interpreter: bf16 values (p keeps its bf16 rounding), fp32 dot
        p, v = p.to(tl.float32), v.to(tl.float32)
    return tl.dot(p, v, acc, input_precision=DOT_PRECISION)
