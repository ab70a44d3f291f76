"""The tile steps of the flex backward (:mod:`flashlite.kernels.attention.flex`): one query
block folded into a key block's dK and dV, keys-major (:func:`dkdv_step`), and one key tile
folded into a query block's dQ (:func:`dq_step`), through the mask and score functions and the
score function's derivative."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.flex_parts import load_rows as _load_rows
from flashlite.kernels.attention.flex_parts import mod_scores as _mod_scores
from flashlite.kernels.attention.flex_parts import score_grad as _score_grad
from flashlite.kernels.attention.flex_parts import scored_tile as _scored_tile
from flashlite.kernels.common import cast
from flashlite.stats import LOG2E, probs_from_lse, probs_from_lse_t


@triton.jit
def dkdv_step(
    dk,
    dv,
    k,
    v,
    qg,
    stats,
    b,
    h,
    start_m,
    offs,
    kv_idx,
    in_range,
    seq_q,
    sm_scale,
    bufs,
    MASK_MOD: tl.constexpr,
    N_MASK_BUF: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Add the query rows ``[start_m, start_m + BLOCK_M)`` of head ``h`` into ``(dk, dv)``,
    keys-major: ``Pᵀ`` from the saved LSE, ``dV += Pᵀ·dO``, ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``
    (times the score function's derivative), ``dK += dSᵀ·Q``. ``qg = (q_src, g_src,
    q_strides, g_strides)``: Q's and dO's head pointers and ``(row, column)`` strides;
    ``stats = (LSE, DELTA, bh_rows)``: the head's rows of the LSE and delta start at
    ``bh_rows``; ``offs = (offs_r, offs_d)``; ``bufs`` as the forward's."""
    q_src, g_src, q_strides, g_strides = qg
    LSE, DELTA, bh_rows = stats
    offs_r, _offs_d = offs
    rows = start_m + offs_r
    q = _load_rows(q_src, b, h, start_m, seq_q, q_strides, offs, HEAD_DIM, BLOCK_D, True)
    offs_v = (offs_r, tl.arange(0, BLOCK_DV))  # (dO is V's width)
    do = _load_rows(g_src, b, h, start_m, seq_q, g_strides, offs_v, HEAD_DIM_V, BLOCK_DV, True)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # rows past seq_q: LSE +inf makes their probabilities 0
    lse = tl.load(LSE + bh_rows + rows, mask=rows < seq_q, other=float("inf"))
    delta = tl.load(DELTA + bh_rows + rows, mask=rows < seq_q, other=0.0)
    xt = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * sm_scale
    q_idx = tl.minimum(rows, seq_q - 1)[None, :]
    yt = _mod_scores(
        xt,
        b,
        h,
        q_idx,
        kv_idx,
        in_range,
        bufs,
        MASK_MOD,
        N_MASK_BUF,
        SCORE_MOD,
        N_SCORE_BUF,
        HAS_SCORE,
        MASKED,
    )
    pt = probs_from_lse_t(yt, lse, LOG2E)
    dv = tl.dot(cast(pt, do.dtype, ROUND_BF16), do, dv, input_precision=DOT_PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dst = pt * (dpt - delta[None, :])
    dst = _score_grad(dst, xt, b, h, q_idx, kv_idx, bufs, SCORE_GRAD, N_SCORE_BUF, HAS_SCORE)
    dk = tl.dot(cast(dst, q.dtype, ROUND_BF16), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def dq_step(
    dq,
    q,
    do,
    lse,
    delta,
    q_idx,
    heads,
    kv,
    start_n,
    offs,
    sm_scale,
    bufs,
    MASK_MOD: tl.constexpr,
    N_MASK_BUF: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    MASKED: tl.constexpr,
    BOUNDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Add the key tile at ``start_n`` into ``dq``: P from the saved LSE, ``dS = P ∘ (dP −
    delta)`` (times the score function's derivative), ``dQ += dS·K``. The tuples as the
    forward's (:func:`flashlite.kernels.attention.flex_parts.fold_tile`)."""
    k, x, y, kv_idx = _scored_tile(
        q,
        q_idx,
        heads,
        kv,
        start_n,
        offs,
        sm_scale,
        bufs,
        MASK_MOD,
        N_MASK_BUF,
        SCORE_MOD,
        N_SCORE_BUF,
        HAS_SCORE,
        MASKED,
        BOUNDED,
        HEAD_DIM,
        BLOCK_D,
        DOT_FP32,
        DOT_PRECISION,
    )
    b, h, h_kv = heads
    _k_src, v_src, _k_strides, v_strides, seq_k = kv
    offs_v = (offs[0], tl.arange(0, BLOCK_DV))  # (V's own width)
    v = _load_rows(
        v_src, b, h_kv, start_n, seq_k, v_strides, offs_v, HEAD_DIM_V, BLOCK_DV, MASKED | BOUNDED
    )
    if DOT_FP32:
        v = v.to(tl.float32)
    p = probs_from_lse(y, lse, LOG2E)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    ds = _score_grad(ds, x, b, h, q_idx, kv_idx, bufs, SCORE_GRAD, N_SCORE_BUF, HAS_SCORE)
    return tl.dot(cast(ds, k.dtype, ROUND_BF16), k, dq, input_precision=DOT_PRECISION)
