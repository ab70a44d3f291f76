"""The tile steps of the attention backward (:mod:`flashlite.kernels.attention.bwd`): one query
block folded into a key block's dK and dV, keys-major (:func:`dkdv_step`), and one key tile
folded into a query block's dQ (:func:`dq_step`), with the ``dS`` they share (:func:`_dscores`);
:func:`dkdv_head` runs the dK/dV step over the query blocks of one query head, :func:`load_pair`
loads the two tiles (Qs and dO, K and V) a step reads at the same rows."""

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
def load_pair(
    srcs,
    strides,
    at,
    offs_r,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_DESC: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Two :func:`load_tile` tiles at the same rows (Qs and dO, or K and V), first then second:
    ``srcs`` their sources, ``strides`` their (row, column) strides one pair after the other,
    ``at`` the ``(b, h, row0, n_rows)`` they share; the first ``HEAD_DIM`` wide (Q's and K's),
    the second ``HEAD_DIM_V`` (V's, O's and dO's)."""
    x_src, y_src = srcs
    x_m, x_d, y_m, y_d = strides
    b, h, row0, n_rows = at
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    x = load_tile(
        x_src, b, h, row0, n_rows, x_m, x_d, offs_r, offs_d, HEAD_DIM, BLOCK_D, USE_DESC, CHECK_ROWS
    )
    y = load_tile(
        y_src, b, h, row0, n_rows, y_m, y_d, offs_r, offs_dv, HEAD_DIM_V, BLOCK_DV, USE_DESC,
        CHECK_ROWS,
    )  # fmt: skip
    return x, y


@triton.jit
def dkdv_step(
    dk,
    dv,
    kv,
    head,
    LSE,
    DELTA,
    start_m,
    offs,
    limits,
    q_strides,
    g_strides,
    exp_scale,
    cap,
    DT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
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
    """Fold the query block at ``start_m`` of one query head into one key block's dK and dV,
    keys-major. ``kv``: the block's K and V tiles; ``head``: ``(b, h, qs_src, g_src, first)``,
    the head's Qs and dO sources and its first row in ``LSE`` and ``DELTA``; ``offs``:
    ``(offs_r, offs_n, offs_d)``; ``limits``: ``(seq_q, seq_k, left, right)``; ``q_strides``,
    ``g_strides``: Qs's and dO's ``(B, H, N, D)`` strides."""
    k, v = kv
    b, h, qs_src, g_src, stats = head
    offs_r, offs_n, _offs_d = offs
    seq_q, seq_k, left, right = limits
    _, _, stride_qm, stride_qd = q_strides
    _, _, stride_gm, stride_gd = g_strides
    srcs, strides = (qs_src, g_src), (stride_qm, stride_qd, stride_gm, stride_gd)
    at = (b, h, start_m, seq_q)
    qs, do = load_pair(
        srcs, strides, at, offs_r, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, USE_DESC, CHECK_ROWS
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
def _masked_start(i, n_diag, lo, full_hi, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr):
    """First query row of the ``i``-th masked block: ``n_diag`` blocks from ``lo``, then blocks
    from ``full_hi`` (a window's far edge can span several; otherwise there is at most the one
    ragged last block)."""
    if WINDOW:
        start_m = tl.where(i < n_diag, lo + i * BLOCK_M, full_hi + (i - n_diag) * BLOCK_M)
    else:
        start_m = tl.where(i < n_diag, lo + i * BLOCK_M, full_hi)
    return start_m


@triton.jit
def dkdv_head(
    dk,
    dv,
    kv,
    head,
    LSE,
    DELTA,
    blocks,
    offs,
    limits,
    q_strides,
    g_strides,
    exp_scale,
    cap,
    DT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_DESC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Fold every query block of one query head that sees the key block into its dK and dV
    (:func:`dkdv_step`): ``blocks`` is ``(lo, full_lo, full_hi, n_diag, n_masked)``, the masked
    blocks in one loop (it keeps the registers of one masked and one unmasked body live, not
    three), then the unmasked ones from ``full_lo`` to ``full_hi``."""
    lo, full_lo, full_hi, n_diag, n_masked = blocks
    for i in range(0, n_masked):
        start_m = _masked_start(i, n_diag, lo, full_hi, BLOCK_M, WINDOW)
        dk, dv = dkdv_step(dk, dv, kv, head, LSE, DELTA, start_m, offs, limits, q_strides,
                           g_strides, exp_scale, cap, DT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                           BLOCK_DV, IS_CAUSAL or WINDOW, IS_CAUSAL, WINDOW, SOFTCAP, True,
                           USE_DESC, DOT_FP32, DOT_PRECISION, ROUND_BF16)  # fmt: skip
    for start_m in range(full_lo, full_hi, BLOCK_M):
        dk, dv = dkdv_step(dk, dv, kv, head, LSE, DELTA, start_m, offs, limits, q_strides,
                           g_strides, exp_scale, cap, DT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                           BLOCK_DV, False, IS_CAUSAL, WINDOW, SOFTCAP, False, USE_DESC,
                           DOT_FP32, DOT_PRECISION, ROUND_BF16)  # fmt: skip
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
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
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
    kv_src, kv_strides = (k_src, v_src), (stride_kn, stride_kd, stride_vn, stride_vd)
    at = (b, h_kv, start_n, seq_k)
    k, v = load_pair(
        kv_src, kv_strides, at, offs_c, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, USE_DESC, MASKED
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
