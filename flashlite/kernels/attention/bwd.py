"""Tiled attention backward (FlashAttention-2): gradients from the saved O and LSE only.

With ``S = scale·QKᵀ``, ``P = softmax(S)`` (recomputed tile by tile from the saved LSE with
:func:`flashlite.stats.probs_from_lse`), ``O = PV`` and an upstream ``dO`` (and ``dlse`` when the
LSE is an output too)::

    dV = Pᵀ dO                      dP = dO Vᵀ
    dS = P ∘ (dP − delta)           delta_i = Σ_d dO_id O_id − dlse_i
    dQ = scale · dS K               dK = scale · dSᵀ Q

(``delta_i = Σ_j P_ij dP_ij`` because ``O = PV``; an LSE gradient adds ``dlse_i·P_ij`` to
``dS_ij``, which is the same as subtracting it from delta.) Three kernels:

1. ``_attention_bwd_preprocess_kernel``: delta per query row, ``(B, Hq, Nq)`` fp32; for 16-bit
   inputs also ``Qs``, Q times ``scale·log2 e`` rounded to the input dtype, exactly the operand
   the forward's scores came from (``PRESCALE_Q``), written into the dQ output's memory: the
   scores are recomputed bit for bit with no extra buffer, and the loops below feed Qs to the
   tensor cores straight from memory (scaling Q in a loop would stage every tile in registers).
2. ``_attention_bwd_dkdv_kernel``: one program per block of ``BLOCK_N`` keys of one K/V head; it
   loops over the query heads of its GQA group and over the query blocks that see its keys
   (:func:`flashlite.masks.query_range`), accumulating dK and dV in registers. GQA's sum over a
   group happens in the loop: no repeated K/V, no atomics. It works keys-major, ``Sᵀ = K·Qsᵀ``:
   ``Pᵀ`` and ``dSᵀ`` come out of the tensor cores in the layout that ``dV += Pᵀ·dO`` and
   ``dK += dSᵀ·Qs`` take as their register operand, so no tile is transposed on chip. dK is
   summed against Qs and divided by ``log2 e`` at the end (``Qs = Q·scale·log2 e``), which adds
   one bf16/fp16 rounding of Q to dK's error, the size of the rounding of dS it already has.
3. ``_attention_bwd_dq_kernel``: one program per query block, looping over the key tiles the
   forward visited (:func:`flashlite.masks.key_range`); it reads its Qs block from the dQ buffer
   and then overwrites that block with dQ. A separate kernel recomputes P once more instead of
   adding dQ with atomics from the dK/dV kernel: the result is deterministic, and dQ needs no
   fp32 ``(B, Hq, Nq, D)`` accumulator.

Both loops split like the forward's: blocks where every (query, key) pair is visible run without
mask arithmetic or bounds checks; only the diagonal and the ragged last block pay for them. fp32
inputs keep Q as it is (the forward did not prescale them) and ``scale·log2 e`` in the exponent.
Loads go through pointers, or (``BwdConfig.use_desc``) the loops' tiles through TMA
descriptors. Sliding windows (``WINDOW``) change only the ranges the masks helpers return and
the masked tiles' test; a soft cap (``SOFTCAP``) recomputes the capped scores and multiplies
``dS`` by the cap's derivative ``1 − tanh²`` (docs/how-it-works/attention.md §5a).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.bwd_parts import dkdv_head as _dkdv_head
from flashlite.kernels.attention.bwd_parts import dq_step as _dq_step
from flashlite.kernels.attention.bwd_parts import load_pair as _load_pair
from flashlite.kernels.attention.common import (
    cap_units,
    head_ptr,
    load_tile,
    scale_q,
    seq_ptr,
    sequence,
    store_tile,
)
from flashlite.kernels.common import cast
from flashlite.masking.masks import key_range, query_range
from flashlite.stats import LOG2E


@triton.jit
def _attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, Q, QS, ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_sb, stride_sh, stride_sm, stride_sd,
    n_heads, seq_q, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr, PRESCALE_Q: tl.constexpr, ROUND_BF16: tl.constexpr,
    ZERO_ACC: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None,
    BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: ``delta = rowsum(dO ∘ O) − dlse``, fp32 (O and dO
    ``HEAD_DIM_V`` wide where V's head dim is not Q's); with
    ``PRESCALE_Q`` also ``Qs`` (see the module's docstring) into ``QS``; with ``ZERO_ACC``
    zeros into ``ACC``, the fused Hopper backward's dense fp32 ``(B, Hq, Nq, HEAD_DIM)`` dQ
    accumulator (its atomics add into it: zeroed here, not by a launch of its own)."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    start_m = tl.program_id(0) * BLOCK_M
    offs_r, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    o_src = head_ptr(O, b, h, stride_ob, stride_oh)
    g_src = head_ptr(DO, b, h, stride_gb, stride_gh)
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    offs_dv = tl.arange(0, BDV)
    o = load_tile(o_src, b, h, start_m, seq_q, stride_om, stride_od, offs_r, offs_dv, HDV, BDV,
                  False, True).to(tl.float32)  # fmt: skip
    do = load_tile(g_src, b, h, start_m, seq_q, stride_gm, stride_gd, offs_r, offs_dv, HDV, BDV,
                   False, True).to(tl.float32)  # fmt: skip
    delta = tl.sum(o * do, 1)
    rows = start_m + offs_r
    at = pid_bh.to(tl.int64) * seq_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + at, mask=rows < seq_q, other=0.0)
    tl.store(DELTA + at, delta, mask=rows < seq_q)
    if ZERO_ACC:
        keep = (rows < seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
        acc_at = ACC + at[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(acc_at, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=keep)
    if PRESCALE_Q:
        q_src = head_ptr(Q, b, h, stride_qb, stride_qh)
        q = load_tile(q_src, b, h, start_m, seq_q, stride_qm, stride_qd, offs_r, offs_d,
                      HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
        qs, _ = scale_q(q, sm_scale * LOG2E, True, ROUND_BF16)  # as the forward rounded it
        store_tile(head_ptr(QS, b, h, stride_sb, stride_sh), qs, rows, seq_q, stride_sm,
                   stride_sd, offs_d, HEAD_DIM)  # fmt: skip


@triton.jit
def _query_head(
    QS,
    DO,
    q_strides,
    g_strides,
    b,
    h,
    q0,
    q_mem,
    n_heads,
    USE_DESC: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Query head ``h`` as :func:`~.bwd_parts.dkdv_step` takes it: ``(b, h, qs_src, g_src,
    first)``, its Qs and dO sources (the descriptors themselves with ``USE_DESC``) and its first
    row in the LSE and delta (``q_mem`` rows per head)."""
    if USE_DESC:
        qs_src, g_src = QS, DO
    else:
        stride_qb, stride_qh, stride_qm, _ = q_strides
        stride_gb, stride_gh, stride_gm, _ = g_strides
        qs_src = seq_ptr(QS, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN)
        g_src = seq_ptr(DO, b, h, q0, stride_gb, stride_gh, stride_gm, VARLEN)
    if VARLEN:
        first = h.to(tl.int64) * q_mem + q0
    else:
        first = (b * n_heads + h).to(tl.int64) * q_mem
    return b, h, qs_src, g_src, first


@triton.jit
def _query_blocks(
    start_n,
    limits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """The query blocks that see the key block at ``start_n``, as
    :func:`~.bwd_parts.dkdv_head` loops over them: ``(lo, full_lo, full_hi, n_diag, n_masked)``.
    Blocks from ``full_lo`` to ``full_hi`` see every pair and run unchecked; ``n_masked`` others
    are masked: ``n_diag`` from ``lo`` (the diagonal or the window's near edge), then from
    ``full_hi`` the window's far edge or the ragged last block
    (:func:`flashlite.masks.query_range`)."""
    seq_q, seq_k, left, right = limits
    lo, full_lo, full_hi, hi = query_range(
        start_n, seq_q, seq_k, left, right, BLOCK_M, BLOCK_N, IS_CAUSAL, WINDOW
    )
    n_diag = tl.cdiv(full_lo - lo, BLOCK_M)
    n_masked = n_diag + tl.cdiv(hi - full_hi, BLOCK_M)
    return lo, full_lo, full_hi, n_diag, n_masked


@triton.jit
def _attention_bwd_dkdv_kernel(
    QS, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, kv_heads, group, seq_q, seq_k, sm_scale, win_left, win_right, softcap, SEQLENS_K,
    CU_Q, CU_K,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, USE_DESC: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr, PRESCALE_Q: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nk, BLOCK_N), B·Hkv)``: dK, dV of one key block, summed over the group.
    ``HEAD_DIM_V``, ``BLOCK_DV``: V's (and dO's, dV's) head dim where it is not Q's.
    ``QS`` is Qs (``PRESCALE_Q``) or Q; with ``USE_DESC``, ``QS`` and ``DO`` are 4-D tensor
    descriptors (TMA loads of the loop's tiles).

    Keys past Nk are loaded as zeros and never stored: each row of dK and dV depends only on its
    own key, so they need no mask. With ``HAS_SEQLENS`` the keys past this batch's length do not
    exist: their dK and dV rows are stored as zeros. ``VARLEN``: packed sequences, as in the
    forward.
    """
    pid_bh = tl.program_id(1)
    b, h_kv = pid_bh // kv_heads, pid_bh % kv_heads
    start_n = tl.program_id(0) * BLOCK_N
    n_keys = seq_k  # rows of dK and dV in memory
    q_mem = seq_q  # rows of the LSE and delta per head
    heads = group
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, SEQLENS_K, CU_Q, CU_K, HAS_SEQLENS, VARLEN)
    if VARLEN:
        n_keys = seq_k  # the next sequence's rows are not ours to write
        if start_n >= seq_k:
            return
    if HAS_SEQLENS:
        heads = tl.where(start_n < seq_k, group, 0)  # a block past the length: zeros only
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d, offs_r = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_M)
    dt = DK.dtype.element_ty  # tensor-core operands are rounded to the inputs' dtype
    k_src = seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN)
    v_src = seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN)
    kv_strides, at = (stride_kn, stride_kd, stride_vn, stride_vd), (b, h_kv, start_n, seq_k)
    offs_c = tl.arange(0, BLOCK_N)
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    k, v = _load_pair((k_src, v_src), kv_strides, at, offs_c, HEAD_DIM, BLOCK_D, HDV, BDV, False,
                      True)  # fmt: skip
    if DOT_FP32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk, dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BDV], tl.float32)
    # scores of Qs are in exp2's units already; dK summed against Qs carries a factor log2 e
    exp_scale = 1.0 if PRESCALE_Q else sm_scale * LOG2E
    dk_scale = 1.0 / LOG2E if PRESCALE_Q else sm_scale
    cap = cap_units(softcap, exp_scale, SOFTCAP)  # the cap in the scores' units
    offs, limits = (offs_r, offs_n, offs_d), (seq_q, seq_k, win_left, win_right)
    # the query blocks that see these keys: the unchecked ones and the masked ones (diagonal,
    # window edges, ragged end)
    blocks = _query_blocks(start_n, limits, BLOCK_M, BLOCK_N, IS_CAUSAL, WINDOW)
    q_strides = (stride_qb, stride_qh, stride_qm, stride_qd)
    g_strides = (stride_gb, stride_gh, stride_gm, stride_gd)
    for g in range(0, heads):
        head = _query_head(
            QS, DO, q_strides, g_strides, b, h_kv * group + g, q0, q_mem, n_heads, USE_DESC, VARLEN
        )
        dk, dv = _dkdv_head(dk, dv, (k, v), head, LSE, DELTA, blocks, offs, limits, q_strides,
                            g_strides, exp_scale, cap, dt, HEAD_DIM, BLOCK_D, HDV, BDV, BLOCK_M,
                            IS_CAUSAL, WINDOW, SOFTCAP, USE_DESC, DOT_FP32, DOT_PRECISION,
                            ROUND_BF16)  # fmt: skip
    if HAS_SEQLENS:  # keys that do not exist get zero gradients (the unmasked loop ran them)
        dk = tl.where(offs_n[:, None] < seq_k, dk, 0.0)
        dv = tl.where(offs_n[:, None] < seq_k, dv, 0.0)
    dk_dst = seq_ptr(DK, b, h_kv, k0, stride_dkb, stride_dkh, stride_dkn, VARLEN)
    dv_dst = seq_ptr(DV, b, h_kv, k0, stride_dvb, stride_dvh, stride_dvn, VARLEN)
    dk = cast(dk * dk_scale, DK.dtype.element_ty, ROUND_BF16)
    store_tile(dk_dst, dk, offs_n, n_keys, stride_dkn, stride_dkd, offs_d, HEAD_DIM)
    dv = cast(dv, DV.dtype.element_ty, ROUND_BF16)
    store_tile(dv_dst, dv, offs_n, n_keys, stride_dvn, stride_dvd, tl.arange(0, BDV), HDV)


@triton.jit
def _attention_bwd_dq_kernel(
    QS, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    n_heads, group, seq_q, seq_k, sm_scale, win_left, win_right, softcap, SEQLENS_K, CU_Q, CU_K,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr, PRESCALE_Q: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: dQ of one query block over the keys it sees. ``QS``
    is Qs (``PRESCALE_Q``; then it may be ``DQ`` itself: each program reads its block before it
    writes it) or Q; with ``USE_DESC``, ``K`` and ``V`` are 4-D tensor descriptors.
    ``HEAD_DIM_V``, ``BLOCK_DV``: V's and dO's head dim where it is not Q's."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    h_kv = h // group
    q_mem = seq_q
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, SEQLENS_K, CU_Q, CU_K, HAS_SEQLENS, VARLEN)
    pid_m = tl.program_id(0)
    if VARLEN and pid_m >= tl.cdiv(seq_q, BLOCK_M):
        return
    if IS_CAUSAL:  # the last query blocks see the most keys: start them first (as the forward)
        pid_m = tl.cdiv(seq_q, BLOCK_M) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    offs_r, offs_d, offs_c = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    rows = start_m + offs_r
    dt = DQ.dtype.element_ty
    qs_src = seq_ptr(QS, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN)
    g_src = seq_ptr(DO, b, h, q0, stride_gb, stride_gh, stride_gm, VARLEN)
    if USE_DESC:
        k_src, v_src = K, V
    else:
        k_src = seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN)
        v_src = seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN)
    q_strides, at = (stride_qm, stride_qd, stride_gm, stride_gd), (b, h, start_m, seq_q)
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    qs, do = _load_pair((qs_src, g_src), q_strides, at, offs_r, HEAD_DIM, BLOCK_D, HDV, BDV, False,
                        True)  # fmt: skip
    if VARLEN:
        stats = h.to(tl.int64) * q_mem + q0
    else:
        stats = pid_bh.to(tl.int64) * q_mem
    lse = tl.load(LSE + stats + rows, mask=rows < seq_q, other=float("-inf"))
    delta = tl.load(DELTA + stats + rows, mask=rows < seq_q, other=0.0)
    exp_scale = 1.0 if PRESCALE_Q else sm_scale * LOG2E
    if DOT_FP32:
        qs, do = qs.to(tl.float32), do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cap = cap_units(softcap, exp_scale, SOFTCAP)  # the cap in the scores' units
    # key tiles [full_lo, full_hi): seen by every row, no checks; [lo, full_lo) (a window's
    # left edge) and [full_hi, hi) (diagonal, window edge, ragged end): masked
    lo, full_lo, full_hi, hi = key_range(start_m, seq_q, seq_k, win_left, win_right, BLOCK_M,
                                         BLOCK_N, IS_CAUSAL, WINDOW)  # fmt: skip
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            dq = _dq_step(dq, qs, do, lse, delta, k_src, v_src, b, h_kv, start_n, rows, offs_c,
                          offs_d, seq_q, seq_k, win_left, win_right, cap, stride_kn, stride_kd,
                          stride_vn, stride_vd, exp_scale, dt, HEAD_DIM, BLOCK_D, HDV, BDV, True,
                          IS_CAUSAL, WINDOW, SOFTCAP, USE_DESC, DOT_FP32, DOT_PRECISION,
                          ROUND_BF16)  # fmt: skip
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(dq, qs, do, lse, delta, k_src, v_src, b, h_kv, start_n, rows, offs_c,
                      offs_d, seq_q, seq_k, win_left, win_right, cap, stride_kn, stride_kd,
                      stride_vn, stride_vd, exp_scale, dt, HEAD_DIM, BLOCK_D, HDV, BDV, False,
                      IS_CAUSAL, WINDOW, SOFTCAP, USE_DESC, DOT_FP32, DOT_PRECISION,
                      ROUND_BF16)  # fmt: skip
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _dq_step(dq, qs, do, lse, delta, k_src, v_src, b, h_kv, start_n, rows, offs_c,
                      offs_d, seq_q, seq_k, win_left, win_right, cap, stride_kn, stride_kd,
                      stride_vn, stride_vd, exp_scale, dt, HEAD_DIM, BLOCK_D, HDV, BDV, True,
                      IS_CAUSAL, WINDOW, SOFTCAP, USE_DESC, DOT_FP32, DOT_PRECISION,
                      ROUND_BF16)  # fmt: skip
    dq_dst = seq_ptr(DQ, b, h, q0, stride_dqb, stride_dqh, stride_dqm, VARLEN)
    store_tile(dq_dst,
               cast(dq * sm_scale, DQ.dtype.element_ty, ROUND_BF16), rows, seq_q, stride_dqm,
               stride_dqd, offs_d, HEAD_DIM)  # fmt: skip
