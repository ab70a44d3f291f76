"""The tile steps of the attention backward (:mod:`flashlite.kernels.attention.bwd`): one query
block folded into a key block's dK and dV, keys-major (:func:`dkdv_step`), and one key tile
folded into a query block's dQ (:func:`dq_step`), with the ``dS`` they share (:func:`_dscores`)."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import load_tile, soft_cap
from flashlite.kernels.common import cast
from flashlite.masking.masks import visible, visible_t
from flashlite.stats import probs_from_lse, probs_from_lse_t


@triton.jit
def _dscores(
    p,
    dp,
    delta,
    dcap,
    SOFTCAP: tl.constexpr,
    DT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """``dS = P ∘ (dP − delta)`` (``delta`` broadcast to the tile by the caller), times the soft
    cap's derivative ``dcap`` with ``SOFTCAP``, rounded to the inputs' dtype ``DT`` for the
    tensor cores; also ``P`` so rounded. Back in fp32 for the interpreter's dots, after that
    rounding."""
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * dcap
    ds = cast(ds, DT, ROUND_BF16)
    pc = cast(p, DT, ROUND_BF16)
    if DOT_FP32:
        ds, pc = ds.to(tl.float32), pc.to(tl.float32)
    return pc, ds


@triton.jit
def dkdv_step(
    dk,
    dv,
    k,
    v,
    qs_src,
    g_src,
    b,
    h,
    LSE,
    DELTA,
    stats,
    start_m,
    offs_r,
    offs_n,
    offs_d,
    seq_q,
    seq_k,
    left,
    right,
    cap,
    stride_qm,
    stride_qd,
    stride_gm,
    stride_gd,
    exp_scale,
    DT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Fold the query block at ``start_m`` into one key block's dK and dV, keys-major."""
    qs = load_tile(
        qs_src,
        b,
        h,
        start_m,
        seq_q,
        stride_qm,
        stride_qd,
        offs_r,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        CHECK_ROWS,
    )
    do = load_tile(
        g_src,
        b,
        h,
        start_m,
        seq_q,
        stride_gm,
        stride_gd,
        offs_r,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        CHECK_ROWS,
    )
    rows = start_m + offs_r
    if CHECK_ROWS:  # rows past Nq: LSE −inf gives P = 0, so they add nothing
        lse = tl.load(LSE + stats + rows, mask=rows < seq_q, other=float("-inf"))
        delta = tl.load(DELTA + stats + rows, mask=rows < seq_q, other=0.0)
    else:
        lse = tl.load(LSE + stats + rows)
        delta = tl.load(DELTA + stats + rows)
    if DOT_FP32:
        qs, do = qs.to(tl.float32), do.to(tl.float32)
    st = tl.dot(k, tl.trans(qs), input_precision=DOT_PRECISION)
    if SOFTCAP:
        st, tt = soft_cap(st, cap, k.dtype != tl.float32)
    pt = probs_from_lse_t(st, lse, exp_scale)
    if MASKED:
        pt = tl.where(
            visible_t(offs_n, rows, seq_q, seq_k, left, right, IS_CAUSAL, WINDOW), pt, 0.0
        )
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dcap = 1.0
    if SOFTCAP:  # through the cap: d(cap·tanh(x/cap))/dx = 1 − tanh²
        dcap = 1.0 - tt * tt
    pc, dst = _dscores(pt, dpt, delta[None, :], dcap, SOFTCAP, DT, DOT_FP32, ROUND_BF16)
    dv = tl.dot(pc, do, dv, input_precision=DOT_PRECISION)
    dk = tl.dot(dst, qs, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def dq_step(
    dq,
    qs,
    do,
    lse,
    delta,
    k_src,
    v_src,
    b,
    h_kv,
    start_n,
    rows,
    offs_c,
    offs_d,
    seq_q,
    seq_k,
    left,
    right,
    cap,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    exp_scale,
    DT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Fold the key tile at ``start_n`` into one query block's dQ; ``MASKED`` tiles check the
    keys' bounds, the causal diagonal or the window."""
    k = load_tile(
        k_src,
        b,
        h_kv,
        start_n,
        seq_k,
        stride_kn,
        stride_kd,
        offs_c,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        MASKED,
    )
    v = load_tile(
        v_src,
        b,
        h_kv,
        start_n,
        seq_k,
        stride_vn,
        stride_vd,
        offs_c,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        MASKED,
    )
    if DOT_FP32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    sc = tl.dot(qs, tl.trans(k), input_precision=DOT_PRECISION)
    dcap = 1.0
    if SOFTCAP:
        sc, t = soft_cap(sc, cap, k.dtype != tl.float32)
        dcap = 1.0 - t * t
    p = probs_from_lse(sc, lse, exp_scale)
    if MASKED:
        p = tl.where(
            visible(rows, start_n + offs_c, seq_q, seq_k, left, right, IS_CAUSAL, WINDOW), p, 0.0
        )
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    _pc, ds = _dscores(p, dp, delta[:, None], dcap, SOFTCAP, DT, DOT_FP32, ROUND_BF16)
    return tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
