"""The tile steps of the flex backward (:mod:`flashlite.kernels.attention.flex`): one query
block folded into a key block's dK and dV, keys-major (:func:`dkdv_step`), and one key tile
folded into a query block's dQ (:func:`dq_step`), through the mask and score functions and the
score function's derivative."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import load_tile
from flashlite.kernels.attention.flex_parts import mod_scores as _mod_scores
from flashlite.kernels.attention.flex_parts import scored_tile as _scored_tile
from flashlite.kernels.common import cast
from flashlite.masking.mods import apply_score
from flashlite.stats import LOG2E, probs_from_lse, probs_from_lse_t


@triton.jit
def dkdv_step(
    dk,
    dv,
    k,
    v,
    q_src,
    g_src,
    LSE,
    DELTA,
    bh_rows,
    b,
    h,
    start_m,
    offs_r,
    offs_d,
    kv_idx,
    in_range,
    seq_q,
    sm_scale,
    stride_qm,
    stride_qd,
    stride_gm,
    stride_gd,
    MB0,
    MB1,
    MB2,
    MB3,
    SB0,
    SB1,
    SB2,
    SB3,
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
):
    """Add the query rows ``[start_m, start_m + BLOCK_M)`` of head ``h`` into ``(dk, dv)``,
    keys-major: ``Pᵀ`` from the saved LSE, ``dV += Pᵀ·dO``, ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``
    (times the score function's derivative), ``dK += dSᵀ·Q``."""
    rows = start_m + offs_r
    q = load_tile(
        q_src,
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
        False,
        True,
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
        False,
        True,
    )
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
        MB0,
        MB1,
        MB2,
        MB3,
        SB0,
        SB1,
        SB2,
        SB3,
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
    if HAS_SCORE:
        dst = dst * apply_score(
            SCORE_GRAD, xt, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF
        )
    dk = tl.dot(cast(dst, q.dtype, ROUND_BF16), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def dq_step(
    dq,
    q,
    do,
    lse,
    delta,
    k_src,
    v_src,
    b,
    h,
    h_kv,
    start_n,
    q_idx,
    offs_n,
    offs_d,
    seq_k,
    sm_scale,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    MB0,
    MB1,
    MB2,
    MB3,
    SB0,
    SB1,
    SB2,
    SB3,
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
):
    """Add the key tile at ``start_n`` into ``dq``: P from the saved LSE, ``dS = P ∘ (dP −
    delta)`` (times the score function's derivative), ``dQ += dS·K``."""
    k, x, y, kv_idx = _scored_tile(
        q,
        k_src,
        b,
        h,
        h_kv,
        start_n,
        q_idx,
        offs_n,
        offs_d,
        seq_k,
        sm_scale,
        stride_kn,
        stride_kd,
        MB0,
        MB1,
        MB2,
        MB3,
        SB0,
        SB1,
        SB2,
        SB3,
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
    v = load_tile(
        v_src,
        b,
        h_kv,
        start_n,
        seq_k,
        stride_vn,
        stride_vd,
        offs_n,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        False,
        MASKED | BOUNDED,
    )
    if DOT_FP32:
        v = v.to(tl.float32)
    p = probs_from_lse(y, lse, LOG2E)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_SCORE:
        ds = ds * apply_score(SCORE_GRAD, x, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF)
    return tl.dot(cast(ds, k.dtype, ROUND_BF16), k, dq, input_precision=DOT_PRECISION)
