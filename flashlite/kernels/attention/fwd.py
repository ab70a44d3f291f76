"""Tiled attention forward (FlashAttention-2 loop order) on the shared (m, s) statistics.

One program owns ``BLOCK_M`` query rows of one (batch, head). It loads its Q block once, then
walks the key/value tiles of ``BLOCK_N`` keys, folding each tile of scores into the running pair
with :func:`flashlite.stats.online_update` — the very helper the row softmax uses — and rescaling
its fp32 output accumulator by the factor the update returns. The ``Nq × Nk`` score matrix never
leaves the chip. HBM traffic per program: its Q block once, one K and one V tile per visited key
tile, its O block and LSE once.

Causal attention is bottom-right aligned (query i sees key j iff ``j <= i + Nk − Nq``). The key
range (:func:`flashlite.masks.key_range`) splits in two loops: tiles every row of the block sees
completely (no mask arithmetic) and the diagonal/boundary tiles (masked); tiles above the
diagonal are never visited.

Two loop variants, chosen per :class:`~flashlite.kernels.configs.Config`, give the same result:
lazy rescaling (the accumulator is rescaled only on tiles that move a row's reference maximum)
and the overlapped loop of :func:`~flashlite.kernels.attention.fwd_parts.attend_overlapped`
(each tile's ``p·v`` runs on the tensor cores while the next tile's softmax is computed).

Loads go through 4-D ``(B, H, N, D)`` tensor descriptors built on the host (TMA on Hopper;
out-of-bounds rows and columns padded with zeros) when the strides are 16-byte aligned, else
through plain masked pointer loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import load_tile, scale_q, seq_ptr, sequence, store_tile
from flashlite.kernels.attention.fwd_parts import Loops, Stats, Tiles, attend_rows
from flashlite.kernels.common import cast
from flashlite.stats import LOG2E, finalize_lse


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _sources(
    Q,
    K,
    V,
    b,
    h,
    h_kv,
    q0,
    k0,
    q_strides,
    k_strides,
    v_strides,
    USE_DESC: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The Q, K and V tiles of the program's sequence and heads, each as ``(source, batch, head,
    first row, row stride, column stride)`` for :func:`load_tile`: the descriptors themselves
    (varlen: of the packed ``(1, H, total, D)`` tensors, rows from ``q0`` and ``k0``), or
    pointers to the sequence's head."""
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    b_ld = b  # the batch index and first rows of the loads
    q_row = 0
    k_row = 0
    if USE_DESC:
        q_src, k_src, v_src = Q, K, V
        if VARLEN:  # descriptors of the packed (1, H, total, D) tensors: rows from q0 and k0
            b_ld = 0
            q_row = q0
            k_row = k0
    else:
        q_src = seq_ptr(Q, b, h, q0, stride_qb, stride_qh, stride_qm, VARLEN)
        k_src = seq_ptr(K, b, h_kv, k0, stride_kb, stride_kh, stride_kn, VARLEN)
        v_src = seq_ptr(V, b, h_kv, k0, stride_vb, stride_vh, stride_vn, VARLEN)
    q_tiles = (q_src, b_ld, h, q_row, stride_qm, stride_qd)
    k_tiles = (k_src, b_ld, h_kv, k_row, stride_kn, stride_kd)
    v_tiles = (v_src, b_ld, h_kv, k_row, stride_vn, stride_vd)
    return q_tiles, k_tiles, v_tiles


@triton.jit
def _load_q(
    q_tiles,
    start_m,
    seq_q,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DESC: tl.constexpr,
):
    """The ``[BLOCK_M, BLOCK_D]`` query block at row ``start_m`` (zeros past ``seq_q``)."""
    q_src, b, h, q_row, stride_qm, stride_qd = q_tiles
    return load_tile(
        q_src,
        b,
        h,
        q_row + start_m,
        q_row + seq_q,
        stride_qm,
        stride_qd,
        tl.arange(0, BLOCK_M),
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        USE_DESC,
        True,
    )


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, group, seq_q, seq_k, sm_scale, win_left, win_right, softcap,
    SEQLENS_K, CU_Q, CU_K, SINKS, Q_DESCALE, K_DESCALE, V_DESCALE, stride_sb, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, VARLEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    USE_DESC: tl.constexpr, PRESCALE_Q: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr, OVERLAP: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, ROUND_BF16: tl.constexpr, FIXED_REF: tl.constexpr = False,
    FP8: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = None, BLOCK_DV: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``. Writes O ``(B, Hq, Nq, D)`` and fp32 LSE ``(B·Hq, Nq)``.

    Q, K, V, O are 4-D tensor descriptors when ``USE_DESC``, else tensors read through strides.
    ``WINDOW``: sliding window ``[i + diag − win_left, i + diag + win_right]`` (see
    :mod:`flashlite.masks`); ``SOFTCAP``: scores capped at ``softcap`` (in natural units);
    ``HAS_SEQLENS``: batch b has only its first ``SEQLENS_K[b]`` keys (clamped to
    ``[0, seq_k]``), and causal and window align to that length. ``VARLEN``: Q, K, V, O are
    packed ``(1, H, total, D)`` views and sequence b is rows ``[CU_Q[b], CU_Q[b + 1])`` of Q
    (``CU_K`` of K and V); ``seq_q`` is then the packed length and the grid covers the longest
    sequence. Varlen descriptors (Q, K, V only; O is a tensor) read blocks that may cross into
    the next sequence: the masks and a zeroed value tail keep those rows out. ``HAS_SINKS``:
    head h's rows start from the state ``(m, s) = (SINKS[h], 1)`` (natural units) instead of
    the identity ``(−inf, 0)``: one more logit in every row's softmax, with no value.
    ``FP8``: e4m3 Q, K, V whose fp32 descale factors ``(B, Hkv)`` (strides ``stride_sb``,
    ``stride_sh``) multiply the scores (Q's and K's) and the output (V's); ``p`` is rounded to
    e4m3 for the ``p·v`` product, as FlashAttention-3 does, and O is 16-bit or fp32.
    ``HEAD_DIM_V``, ``BLOCK_DV``: V's and O's head dim and its tile (None: Q's), which may
    differ from Q's and K's (DeepSeek's 192/128).
    Few query rows against a long KV cache run :mod:`.decode`'s kernel instead.
    """
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group  # GQA/MQA: query heads of a group share one K/V head, no copies
    q_mem = seq_q  # rows of Q, O and the LSE in memory per head
    # this program's sequence: its first rows and its lengths (every range and mask follows them)
    q0, seq_q, k0, seq_k = sequence(b, seq_q, seq_k, SEQLENS_K, CU_Q, CU_K, HAS_SEQLENS, VARLEN)
    n_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m = tl.program_id(0)
    if VARLEN and pid_m >= n_m_blocks:  # the grid covers the longest sequence
        return
    if IS_CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = n_m_blocks - 1 - pid_m
    q_strides = (stride_qb, stride_qh, stride_qm, stride_qd)
    k_strides = (stride_kb, stride_kh, stride_kn, stride_kd)
    v_strides = (stride_vb, stride_vh, stride_vn, stride_vd)
    q_tiles, k_tiles, v_tiles = _sources(
        Q, K, V, b, h, h_kv, q0, k0, q_strides, k_strides, v_strides, USE_DESC, VARLEN
    )
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_q(q_tiles, start_m, seq_q, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)
    out_scale = 1.0
    if FP8:  # the scores carry Q's and K's factors (so do the soft cap, sinks and LSE), O V's
        d_at = b.to(tl.int64) * stride_sb + h_kv * stride_sh
        sm_scale = sm_scale * tl.load(Q_DESCALE + d_at) * tl.load(K_DESCALE + d_at)
        out_scale = tl.load(V_DESCALE + d_at)
    qk_scale = sm_scale * LOG2E
    q, exp_scale = scale_q(q, qk_scale, PRESCALE_Q, ROUND_BF16)
    pos = (offs_m, offs_n, offs_d, seq_q, seq_k, win_left, win_right)
    HDV: tl.constexpr = HEAD_DIM if HEAD_DIM_V is None else HEAD_DIM_V
    BDV: tl.constexpr = BLOCK_D if BLOCK_DV is None else BLOCK_DV
    acc, m, s = attend_rows(  # (constexpr bundles are built in the call: see fwd_parts)
        (q, k_tiles, v_tiles, pos),
        (start_m, exp_scale, softcap, SINKS, h),
        Loops(BLOCK_M, BLOCK_N, IS_CAUSAL, WINDOW, OVERLAP, WARP_SPECIALIZE),
        Tiles(HEAD_DIM, BLOCK_D, USE_DESC, DOT_FP32, DOT_PRECISION, ROUND_BF16, VARLEN, HDV, BDV),
        Stats(SOFTCAP, HAS_SINKS, LAZY_RESCALE, FIXED_REF),
    )
    # Rows that saw no key (causal with Nq > Nk) have s = 0: output 0 and LSE −inf, not NaN
    # (with a sink, s >= 1: output 0 and LSE = the sink).
    inv_s = tl.where(s > 0.0, out_scale / s, 0.0)
    lse = finalize_lse(m, s, exp_scale)
    if VARLEN:  # the packed (Hq, total) LSE
        tl.store(LSE + h.to(tl.int64) * q_mem + q0 + offs_m, lse, mask=offs_m < seq_q)
    else:
        tl.store(LSE + pid_bh.to(tl.int64) * q_mem + offs_m, lse, mask=offs_m < seq_q)
    if USE_DESC and not VARLEN:  # (varlen: a block's rows may cross into the next sequence)
        o = cast(acc * inv_s[:, None], O.dtype, ROUND_BF16)
        O.store([b, h, start_m, 0], o.reshape(1, 1, BLOCK_M, BDV))
    else:
        o = cast(acc * inv_s[:, None], O.dtype.element_ty, ROUND_BF16)
        o_dst = seq_ptr(O, b, h, q0, stride_ob, stride_oh, stride_om, VARLEN)
        store_tile(o_dst, o, offs_m, seq_q, stride_om, stride_od, tl.arange(0, BDV), HDV)
