"""Tiled attention backward (FlashAttention-2): gradients from the saved O and LSE only.

With ``S = scale·QKᵀ``, ``P = softmax(S)`` (recomputed tile by tile from the saved LSE with
:func:`flashlite.stats.probs_from_lse`), ``O = PV`` and an upstream ``dO`` (and ``dlse`` when the
LSE is an output too)::

    dV = Pᵀ dO                      dP = dO Vᵀ
    dS = P ∘ (dP − delta)           delta_i = Σ_d dO_id O_id − dlse_i
    dQ = scale · dS K               dK = scale · dSᵀ Q

(``delta_i = Σ_j P_ij dP_ij`` because ``O = PV``; an LSE gradient adds ``dlse_i·P_ij`` to
``dS_ij``, which is the same as subtracting it from delta.) Three kernels:

1. ``_attention_bwd_preprocess_kernel``: delta per query row, ``(B, Hq, Nq)`` fp32.
2. ``_attention_bwd_dkdv_kernel``: one program per block of ``BLOCK_N`` keys of one K/V head; it
   loops over the query heads of its GQA group and over the query blocks that see its keys
   (:func:`flashlite.masks.query_start`), accumulating dK and dV in registers. GQA's sum over a
   group happens in the loop: no repeated K/V, no atomics.
3. ``_attention_bwd_dq_kernel``: one program per query block, looping over the key tiles the
   forward visited (:func:`flashlite.masks.key_range`). A separate kernel recomputes P once more
   instead of adding dQ with atomics from the dK/dV kernel: the result is deterministic, and dQ
   needs no fp32 ``(B, Hq, Nq, D)`` accumulator.

Scores are recomputed exactly as the forward computed them (Q·scale·log2 e rounded to the input
dtype when ``PRESCALE_Q``), so P matches the saved LSE. Loads go through masked pointers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import load_tile, scale_q
from flashlite.kernels.common import cast
from flashlite.masks import key_range, query_start, visible
from flashlite.stats import LOG2E, probs_from_lse


@triton.jit
def _attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    n_heads, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: ``delta = rowsum(dO ∘ O) − dlse``, fp32."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    start_m = tl.program_id(0) * BLOCK_M
    offs_r, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    o_src = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    g_src = DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    o = load_tile(o_src, b, h, start_m, seq_q, stride_om, stride_od, offs_r, offs_d, HEAD_DIM,
                  BLOCK_D, False, True).to(tl.float32)  # fmt: skip
    do = load_tile(g_src, b, h, start_m, seq_q, stride_gm, stride_gd, offs_r, offs_d, HEAD_DIM,
                   BLOCK_D, False, True).to(tl.float32)  # fmt: skip
    delta = tl.sum(o * do, 1)
    rows = start_m + offs_r
    at = pid_bh.to(tl.int64) * seq_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + at, mask=rows < seq_q, other=0.0)
    tl.store(DELTA + at, delta, mask=rows < seq_q)


@triton.jit
def _probs_and_dscores(qs, k, v, do, lse, delta, rows, cols, seq_q, seq_k, exp_scale,
                       DT: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile's P (from the LSE, masked) and ``dS = P ∘ (dO·Vᵀ −
    delta)`` rounded to the inputs' dtype ``DT`` for the tensor cores (back in fp32 for the
    interpreter's dots, after that rounding). Both backward kernels start here."""
    s = tl.dot(qs, tl.trans(k), input_precision=DOT_PRECISION)
    p = probs_from_lse(s, lse, exp_scale)
    p = tl.where(visible(rows, cols, seq_q, seq_k, IS_CAUSAL), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = cast(p * (dp - delta[:, None]), DT, ROUND_BF16)
    if DOT_FP32:
        ds = ds.to(tl.float32)
    return p, ds


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, kv_heads, group, seq_q, seq_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PRESCALE_Q: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nk, BLOCK_N), B·Hkv)``: dK, dV of one key block, summed over the group."""
    pid_bh = tl.program_id(1)
    b, h_kv = pid_bh // kv_heads, pid_bh % kv_heads
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d, offs_r = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_M)
    dt = Q.dtype.element_ty  # the inputs' dtype: tensor-core operands are rounded to it
    k_src = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_src = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    k = load_tile(k_src, b, h_kv, start_n, seq_k, stride_kn, stride_kd, tl.arange(0, BLOCK_N),
                  offs_d, HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
    v = load_tile(v_src, b, h_kv, start_n, seq_k, stride_vn, stride_vd, tl.arange(0, BLOCK_N),
                  offs_d, HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
    if DOT_FP32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = sm_scale * LOG2E
    lo = query_start(start_n, seq_q, seq_k, BLOCK_M, IS_CAUSAL)
    for g in range(0, group):
        h = h_kv * group + g
        q_src = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        g_src = DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
        stats = (b * n_heads + h).to(tl.int64) * seq_q
        for start_m in range(lo, seq_q, BLOCK_M):
            q = load_tile(q_src, b, h, start_m, seq_q, stride_qm, stride_qd, offs_r, offs_d,
                          HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
            do = load_tile(g_src, b, h, start_m, seq_q, stride_gm, stride_gd, offs_r, offs_d,
                           HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
            rows = start_m + offs_r
            lse = tl.load(LSE + stats + rows, mask=rows < seq_q, other=float("-inf"))
            delta = tl.load(DELTA + stats + rows, mask=rows < seq_q, other=0.0)
            qs, exp_scale = scale_q(q, qk_scale, PRESCALE_Q, ROUND_BF16)
            if DOT_FP32:
                qs, q, do = qs.to(tl.float32), q.to(tl.float32), do.to(tl.float32)
            p, ds = _probs_and_dscores(qs, k, v, do, lse, delta, rows, offs_n, seq_q, seq_k,
                                       exp_scale, dt, IS_CAUSAL, DOT_FP32, DOT_PRECISION,
                                       ROUND_BF16)  # fmt: skip
            pc = cast(p, dt, ROUND_BF16)  # tensor-core operands in the input precision
            if DOT_FP32:  # the interpreter: rounded to bf16 above, multiplied in fp32
                pc = pc.to(tl.float32)
            dv = tl.dot(tl.trans(pc), do, dv, input_precision=DOT_PRECISION)
            dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PRECISION)
    mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
    dk_base = DK + b.to(tl.int64) * stride_dkb + h_kv.to(tl.int64) * stride_dkh
    dv_base = DV + b.to(tl.int64) * stride_dvb + h_kv.to(tl.int64) * stride_dvh
    n64 = offs_n.to(tl.int64)[:, None]
    tl.store(dk_base + n64 * stride_dkn + offs_d[None, :] * stride_dkd,
             cast(dk * sm_scale, DK.dtype.element_ty, ROUND_BF16), mask=mask)  # fmt: skip
    tl.store(dv_base + n64 * stride_dvn + offs_d[None, :] * stride_dvd,
             cast(dv, DV.dtype.element_ty, ROUND_BF16), mask=mask)  # fmt: skip


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    n_heads, group, seq_q, seq_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PRESCALE_Q: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: dQ of one query block over the keys it sees."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    h_kv = h // group
    start_m = tl.program_id(0) * BLOCK_M
    offs_r, offs_d, offs_c = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    rows = start_m + offs_r
    q_src = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    g_src = DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    k_src = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_src = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    q = load_tile(q_src, b, h, start_m, seq_q, stride_qm, stride_qd, offs_r, offs_d, HEAD_DIM,
                  BLOCK_D, False, True)  # fmt: skip
    do = load_tile(g_src, b, h, start_m, seq_q, stride_gm, stride_gd, offs_r, offs_d, HEAD_DIM,
                   BLOCK_D, False, True)  # fmt: skip
    stats = pid_bh.to(tl.int64) * seq_q
    lse = tl.load(LSE + stats + rows, mask=rows < seq_q, other=float("-inf"))
    delta = tl.load(DELTA + stats + rows, mask=rows < seq_q, other=0.0)
    qs, exp_scale = scale_q(q, sm_scale * LOG2E, PRESCALE_Q, ROUND_BF16)
    if DOT_FP32:
        qs, do = qs.to(tl.float32), do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    _, hi = key_range(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        k = load_tile(k_src, b, h_kv, start_n, seq_k, stride_kn, stride_kd, offs_c, offs_d,
                      HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
        v = load_tile(v_src, b, h_kv, start_n, seq_k, stride_vn, stride_vd, offs_c, offs_d,
                      HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        _p, ds = _probs_and_dscores(qs, k, v, do, lse, delta, rows, start_n + offs_c, seq_q,
                                   seq_k, exp_scale, Q.dtype.element_ty, IS_CAUSAL, DOT_FP32,
                                   DOT_PRECISION, ROUND_BF16)  # fmt: skip
        dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
    dq_base = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    ptrs = dq_base + rows.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    mask = (rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, cast(dq * sm_scale, DQ.dtype.element_ty, ROUND_BF16), mask=mask)
