"""Attention with your own mask and score functions over block tables (FlexAttention's model).

The loops are the dense kernels' (:mod:`.fwd`, :mod:`.bwd`): the same (m, s) pair from
:mod:`flashlite.stats`, the same tile helpers from :mod:`.common`. What changes is *which* tiles
a program visits and what happens to a tile's scores:

- a program reads its row of the block tables (:mod:`flashlite.block_mask`) and visits the
  **full** tiles listed there, then the **partial** ones; empty tiles are never named, so their
  K and V are never loaded;
- scores are ``q·kᵀ·scale`` in natural units (what a score function expects), then
  ``score_mod`` (every visited tile), then ``mask_mod`` (partial tiles only; full tiles skip it
  and need no bounds check: the classifier never calls a tile crossing ``Nk`` full).

A table block of ``TBM × TBN`` may be walked in smaller kernel tiles (``BLOCK_M`` divides
``TBM``, ``BLOCK_N`` divides ``TBN``): a program of ``BLOCK_M`` rows reads table row
``start_m // TBM`` and steps each listed block in ``TBN / BLOCK_N`` tiles.

The backward (FlashAttention-2, as :mod:`.bwd`): ``delta`` from the dense preprocess kernel,
``_flex_bwd_dkdv_kernel`` per key block walking the ``q_*`` tables over its GQA group's heads,
and ``_flex_bwd_dq_kernel`` per query block walking the ``kv_*`` tables. A score function's
derivative multiplies ``dS``: with ``x = scale·q·k`` and ``y = score_mod(x)`` the softmax's
``dL/dy = P ∘ (dP − delta)``, so ``dL/dx = dL/dy · score_mod'(x)``.

``VARLEN`` (packed sequences, :func:`flashlite.attention_varlen`): "batch" b of the grid, the
tables and the mods is sequence b of the offsets, as in the dense varlen kernels
(:func:`~flashlite.kernels.attention.common.sequence`): pointers at its first rows, its lengths
for every bound. The tables are the longest sequence's, so the loops skip listed tiles past a
shorter one, and full tiles check the keys' bounds (``BOUNDED``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import load_tile, seq_ptr, sequence, store_tile
from flashlite.kernels.attention.flex_bwd_parts import dkdv_step as _dkdv_step
from flashlite.kernels.attention.flex_bwd_parts import dq_step as _dq_step
from flashlite.kernels.attention.flex_parts import fold_tile as _fold_tile
from flashlite.kernels.attention.flex_parts import listed as _listed
from flashlite.kernels.attention.flex_parts import lse_row as _lse_row
from flashlite.kernels.attention.flex_parts import table_row as _table_row
from flashlite.kernels.common import cast
from flashlite.stats import LOG2E, finalize_lse

#: Arguments that change with the sequence length (the lengths, the tables' strides, a mod's
#: numbers such as a document-id row stride) are not specialised on (multiple of 16 or not,
#: equal to 1 or not): a loop over lengths compiles no new variants.
_MOD_ARGS = ("MB0", "MB1", "MB2", "MB3", "SB0", "SB1", "SB2", "SB3")
_BY_QUERY_BLOCK = (
    "seq_q",
    "seq_k",
    "stride_tb",
    "stride_th",
    "stride_tm",
    "stride_ib",
    "stride_ih",
    "stride_im",
    *_MOD_ARGS,
)
_BY_KEY_BLOCK = (
    "seq_q",
    "seq_k",
    "stride_tb",
    "stride_th",
    "stride_tn",
    "stride_ib",
    "stride_ih",
    "stride_in",
    *_MOD_ARGS,
)


@triton.jit(do_not_specialize=_BY_QUERY_BLOCK)
def _flex_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_tb, stride_th, stride_tm, stride_ib, stride_ih,
    stride_im,
    n_heads, group, seq_q, seq_k, sm_scale, CU_Q, CU_K,
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
    MASK_MOD: tl.constexpr, N_MASK_BUF: tl.constexpr, SCORE_MOD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr, HAS_SCORE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TBM: tl.constexpr, TBN: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    VARLEN: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``. Writes O ``(B, Hq, Nq, D)`` and the natural-log LSE
    ``(B·Hq, Nq)`` (−inf, with output 0, for a row that sees no key). The tables are
    ``(B, Hq, nQ[, nK])`` views (stride 0 where the mask ignores batch or head).

    ``VARLEN``: Q, K, V, O are packed ``(1, H, total, D)`` and "batch" ``b`` of the grid, the
    tables and the mods is sequence ``b``: rows ``[CU_Q[b], CU_Q[b + 1])`` of Q (``CU_K`` of K
    and V), positions counted from its start; the grid and the tables cover the longest
    sequence, and every tile is bounds-checked against this one's lengths."""
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    q_mem = seq_q  # rows of Q, O and the LSE in memory per head
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, CU_Q, CU_Q, CU_K, False, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if VARLEN and start_m >= seq_q:  # the grid covers the longest sequence
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_src = seq_ptr(Q, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN)
    k_src = seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN)
    v_src = seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN)
    q = load_tile(q_src, b, h, start_m, seq_q, stride_qm, stride_qd, tl.arange(0, BLOCK_M),
                  offs_d, HEAD_DIM, BLOCK_D, False, True)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    # rows past seq_q (a ragged last block) are computed and dropped: the mods see them clamped
    q_idx = tl.minimum(offs_m, seq_q - 1)[:, None]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V  # (V's and O's)
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)

    t_strides = (stride_tb, stride_th, stride_tm, stride_ib, stride_ih, stride_im)
    trow, irow = _table_row(b, h, start_m // TBM, t_strides)
    # the steps' grouped arguments (what each holds: flex_parts._scored_tile)
    kv = (k_src, v_src, (stride_kn, stride_kd), (stride_vn, stride_vd), seq_k)
    bufs = (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3)
    # full tiles first (no mask), then partial ones (mask); the same code with MASKED set
    for part in tl.static_range(2):
        n_blocks, idx_row = _listed(FULL_NUM, FULL_IDX, KV_NUM, KV_IDX, trow, irow, part)
        for i in range(0, n_blocks):
            block_n = tl.load(idx_row + i) * TBN
            for sub in tl.static_range(TBN // BLOCK_N):
                start_n = block_n + sub * BLOCK_N
                # varlen's tables list the longest sequence's tiles (a constant `if` without)
                if (start_n < seq_k) | (not VARLEN):
                    m, s, acc = _fold_tile(m, s, acc, q, q_idx, (b, h, h_kv), kv, start_n,
                                           (offs_n, offs_d), sm_scale, bufs, MASK_MOD, N_MASK_BUF,
                                           SCORE_MOD, N_SCORE_BUF, HAS_SCORE, part == 1, VARLEN,
                                           HEAD_DIM, BLOCK_D, DOT_FP32, DOT_PRECISION,
                                           ROUND_BF16, HDV, BDV)  # fmt: skip
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)
    lse = finalize_lse(m, s, LOG2E)
    tl.store(LSE + _lse_row(pid_bh, h, q0, q_mem, VARLEN) + offs_m, lse, mask=offs_m < seq_q)
    o = cast(acc * inv_s[:, None], O.dtype.element_ty, ROUND_BF16)
    store_tile(seq_ptr(O, b, h, q0, stride_ob, stride_oh, stride_om, VARLEN), o, offs_m, seq_q,
               stride_om, stride_od, tl.arange(0, BDV), HDV)  # fmt: skip


@triton.jit(do_not_specialize=_BY_KEY_BLOCK)
def _flex_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_tb, stride_th, stride_tn, stride_ib, stride_ih,
    stride_in,
    n_heads_kv, group, seq_q, seq_k, sm_scale, CU_Q, CU_K,
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
    MASK_MOD: tl.constexpr, N_MASK_BUF: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, N_SCORE_BUF: tl.constexpr, HAS_SCORE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TBM: tl.constexpr, TBN: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    VARLEN: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nk, BLOCK_N), B·Hkv)``: dK and dV of ``BLOCK_N`` keys of one K/V head, summed
    over its group's query heads and the query blocks the ``q_*`` tables list for them, in
    registers (no atomics). Keys-major: ``Sᵀ = K·Qᵀ``. ``VARLEN`` as the forward's. (Keys
    past the sequence need no bounds on full tiles: their rows of dK and dV are not stored.)"""
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads_kv
    h_kv = pid_bh % n_heads_kv
    q_mem = seq_q
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, CU_Q, CU_Q, CU_K, False, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if VARLEN and start_n >= seq_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, BLOCK_N)
    k = load_tile(seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN), b, h_kv,
                  start_n, seq_k, stride_kn, stride_kd, keys, offs_d, HEAD_DIM, BLOCK_D, False,
                  True)  # fmt: skip
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V  # (V's and dV's)
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    v = load_tile(seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN), b, h_kv,
                  start_n, seq_k, stride_vn, stride_vd, keys, tl.arange(0, BDV), HDV, BDV, False,
                  True)  # fmt: skip
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kv_idx = tl.minimum(offs_n, seq_k - 1)[:, None]
    in_range = (offs_n < seq_k)[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BDV], tl.float32)
    t_strides = (stride_tb, stride_th, stride_tn, stride_ib, stride_ih, stride_in)
    # the step's grouped arguments (what each holds: flex_bwd_parts.dkdv_step)
    q_strides, g_strides = (stride_qm, stride_qd), (stride_gm, stride_gd)
    bufs = (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3)
    for g in range(0, group):
        h = h_kv * group + g
        q_src = seq_ptr(Q, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN)
        g_src = seq_ptr(DO, b, h, q0, stride_gb, stride_gh, stride_gm, VARLEN)
        bh_rows = _lse_row(b * n_heads_kv * group + h, h, q0, q_mem, VARLEN)
        trow, irow = _table_row(b, h, start_n // TBN, t_strides)
        for part in tl.static_range(2):
            n_blocks, idx_row = _listed(FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, trow, irow, part)
            for i in range(0, n_blocks):
                block_m = tl.load(idx_row + i) * TBM
                for sub in tl.static_range(TBM // BLOCK_M):
                    start_m = block_m + sub * BLOCK_M
                    if (start_m < seq_q) | (not VARLEN):  # (as the forward's)
                        dk, dv = _dkdv_step(dk, dv, k, v, (q_src, g_src, q_strides, g_strides),
                                            (LSE, DELTA, bh_rows), b, h, start_m, (offs_r, offs_d),
                                            kv_idx, in_range, seq_q, sm_scale, bufs, MASK_MOD,
                                            N_MASK_BUF, SCORE_MOD, SCORE_GRAD, N_SCORE_BUF,
                                            HAS_SCORE, part == 1, HEAD_DIM, BLOCK_D, DOT_FP32,
                                            DOT_PRECISION, ROUND_BF16, HDV, BDV)  # fmt: skip
    dk = cast(dk * sm_scale, DK.dtype.element_ty, ROUND_BF16)
    store_tile(seq_ptr(DK, b, h_kv, k0, stride_dkb, stride_dkh, stride_dkn, VARLEN), dk, offs_n,
               seq_k, stride_dkn, stride_dkd, offs_d, HEAD_DIM)  # fmt: skip
    dv = cast(dv, DV.dtype.element_ty, ROUND_BF16)
    store_tile(seq_ptr(DV, b, h_kv, k0, stride_dvb, stride_dvh, stride_dvn, VARLEN), dv, offs_n,
               seq_k, stride_dvn, stride_dvd, tl.arange(0, BDV), HDV)  # fmt: skip


@triton.jit(do_not_specialize=_BY_QUERY_BLOCK)
def _flex_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_tb, stride_th, stride_tm, stride_ib, stride_ih,
    stride_im,
    n_heads, group, seq_q, seq_k, sm_scale, CU_Q, CU_K,
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
    MASK_MOD: tl.constexpr, N_MASK_BUF: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_GRAD: tl.constexpr, N_SCORE_BUF: tl.constexpr, HAS_SCORE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TBM: tl.constexpr, TBN: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    VARLEN: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: dQ of ``BLOCK_M`` rows, over the key tiles the
    forward visited (the ``kv_*`` tables), recomputing P from the saved LSE. ``VARLEN`` as the
    forward's."""
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group
    q_mem = seq_q
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, CU_Q, CU_Q, CU_K, False, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if VARLEN and start_m >= seq_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_src = seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN)
    v_src = seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN)
    own = tl.arange(0, BLOCK_M)
    q = load_tile(seq_ptr(Q, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN), b, h, start_m,
                  seq_q, stride_qm, stride_qd, own, offs_d, HEAD_DIM, BLOCK_D, False,
                  True)  # fmt: skip
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V  # (V's and dO's)
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    do = load_tile(seq_ptr(DO, b, h, q0, stride_gb, stride_gh, stride_gm, VARLEN), b, h, start_m,
                   seq_q, stride_gm, stride_gd, own, tl.arange(0, BDV), HDV, BDV, False,
                   True)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    rows_ok = offs_m < seq_q
    row0 = _lse_row(pid_bh, h, q0, q_mem, VARLEN)
    lse = tl.load(LSE + row0 + offs_m, mask=rows_ok, other=float("inf"))
    delta = tl.load(DELTA + row0 + offs_m, mask=rows_ok, other=0.0)
    q_idx = tl.minimum(offs_m, seq_q - 1)[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t_strides = (stride_tb, stride_th, stride_tm, stride_ib, stride_ih, stride_im)
    trow, irow = _table_row(b, h, start_m // TBM, t_strides)
    # the step's grouped arguments (what each holds: flex_parts._scored_tile)
    kv = (k_src, v_src, (stride_kn, stride_kd), (stride_vn, stride_vd), seq_k)
    bufs = (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3)
    for part in tl.static_range(2):
        n_blocks, idx_row = _listed(FULL_NUM, FULL_IDX, KV_NUM, KV_IDX, trow, irow, part)
        for i in range(0, n_blocks):
            block_n = tl.load(idx_row + i) * TBN
            for sub in tl.static_range(TBN // BLOCK_N):
                start_n = block_n + sub * BLOCK_N
                if (start_n < seq_k) | (not VARLEN):  # (as the forward's)
                    dq = _dq_step(dq, q, do, lse, delta, q_idx, (b, h, h_kv), kv, start_n,
                                  (offs_n, offs_d), sm_scale, bufs, MASK_MOD, N_MASK_BUF,
                                  SCORE_MOD, SCORE_GRAD, N_SCORE_BUF, HAS_SCORE, part == 1,
                                  VARLEN, HEAD_DIM, BLOCK_D, DOT_FP32, DOT_PRECISION,
                                  ROUND_BF16, HDV, BDV)  # fmt: skip
    dq = cast(dq * sm_scale, DQ.dtype.element_ty, ROUND_BF16)
    store_tile(seq_ptr(DQ, b, h, q0, stride_dqb, stride_dqh, stride_dqm, VARLEN), dq, offs_m,
               seq_q, stride_dqm, stride_dqd, offs_d, HEAD_DIM)  # fmt: skip
