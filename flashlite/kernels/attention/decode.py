"""Decoding against a KV cache: GQA rows packed into one tile, keys split across programs
(flash-decoding), paged caches, and the exact merge of the partial results.

With a few query rows against a long KV cache, the forward kernel's grid (one program per
128-query block and query head) leaves most SMs idle and reads each K/V head once per query head
of its group. :func:`_attention_decode_kernel` fixes both:

* **GQA packing.** One program serves all ``G = Hq/Hkv`` query heads of a KV head: packed row
  ``r`` is query ``r // G`` of head ``h_kv·G + r % G``, so the ``Nq·G`` rows fill the tile's M
  dimension and each K/V tile is read once for the whole group.
* **Split-KV.** Program ``(row block, b·Hkv, s)`` attends to the ``s``-th chunk of the keys only
  and writes that chunk's normalised output ``o_s`` and LSE ``lse_s`` (fp32 partials). The
  chunks are disjoint, so the statistics module's associative merge puts them back together
  exactly: each partial is the online pair ``(m, s) = (lse_s, 1)`` with ``o_s`` as its
  accumulator, and

      m = max_s lse_s,   S = Σ_s e^(lse_s − m),   o = Σ_s e^(lse_s − m)·o_s / S,   lse = m + ln S

  A chunk that saw no key has ``lse_s = −inf``: weight 0, the merge's identity.
  :func:`_split_kv_combine_kernel` loads a row's S partials at once and folds them in one step
  with :func:`flashlite.stats.merge_partials` and :func:`flashlite.stats.rescale`, the helpers
  the softmax kernels merge their chunks with.
* **Paged caches.** Key ``j`` of batch ``b`` lives in page ``block_table[b, j // page_size]``;
  each tile row finds its page (:func:`~flashlite.kernels.attention.decode_parts.kv_tile`), so
  any page size from 16 up works with the same tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import (
    cap_units,
    scale_q,
)
from flashlite.kernels.attention.decode_parts import decode_attend as _decode_attend
from flashlite.kernels.common import cast
from flashlite.masking.masks import key_range
from flashlite.stats import LOG2E, finalize_lse, merge_partials, rescale


@triton.jit
def _row_ptrs(X, bat, head, pos, offs_d, strides):
    """Pointers ``[BLOCK_M, BLOCK_D]`` to packed rows of a ``(B, H, N, D)`` tensor: row ``r`` at
    batch row ``bat``, head ``head[r]`` and position ``pos[r]`` (Q's rows, and O's)."""
    stride_b, stride_h, stride_m, stride_d = strides
    return (
        X
        + bat.to(tl.int64) * stride_b
        + head.to(tl.int64)[:, None] * stride_h
        + pos.to(tl.int64)[:, None] * stride_m
        + offs_d[None, :] * stride_d
    )


@triton.jit
def _initial_state(
    SINKS,
    head,
    row_ok,
    split,
    exp_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """``(acc, m, s)`` a chunk starts from: ``[BLOCK_M, BLOCK_D]`` zeros and rows ``(−inf, 0)``;
    with ``HAS_SINKS`` chunk 0 starts from each head's sink state ``(sink, 1)`` (in the scores'
    units) instead, so the merge counts the sink once."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINKS:
        sink = tl.load(SINKS + head, mask=row_ok, other=0.0) * LOG2E / exp_scale
        m = tl.where(split == 0, sink, m)
        s = tl.where(split == 0, 1.0, s)
    return acc, m, s


@triton.jit
def _chunk_key_range(
    scoring,
    split,
    split_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """``(lo, full_lo, full_hi, hi)`` of the row block's keys (:func:`key_range`) clamped to this
    program's chunk ``[split·split_len, (split + 1)·split_len)``."""
    seq_q, seq_k, win_left, win_right, _cap, _exp_scale = scoring
    # The block's positions lie in [pos[0], pos[0] + BLOCK_M): key_range over that span is a
    # superset of what the rows see (the masked loops mask each row by its own position).
    first = tl.program_id(0) * BLOCK_M // GROUP
    lo, full_lo, full_hi, hi = key_range(
        first, seq_q, seq_k, win_left, win_right, BLOCK_M, BLOCK_N, IS_CAUSAL, WINDOW
    )
    c0 = split * split_len  # (clamping keeps the four bounds in order)
    c1 = c0 + split_len
    lo = tl.minimum(tl.maximum(lo, c0), c1)
    full_lo = tl.minimum(tl.maximum(full_lo, c0), c1)
    full_hi = tl.minimum(tl.maximum(full_hi, c0), c1)
    hi = tl.minimum(tl.maximum(hi, c0), c1)
    return lo, full_lo, full_hi, hi


@triton.jit
def _attention_decode_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_kv_heads, seq_q, seq_k, sm_scale, win_left, win_right, softcap,
    SEQLENS_K, TABLE, SINKS, Q_DESCALE, K_DESCALE, V_DESCALE, stride_sb, stride_sh,
    stride_tb, num_pages, split_len,
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_SINKS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_DESC: tl.constexpr, PRESCALE_Q: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
    MASK_MOD: tl.constexpr = None, N_MASK_BUF: tl.constexpr = 0,
    SCORE_MOD: tl.constexpr = None, N_SCORE_BUF: tl.constexpr = 0, FP8: tl.constexpr = None,
):  # fmt: skip
    """Grid ``(cdiv(Nq·GROUP, BLOCK_M), B·Hkv, S)``: packed rows ``[pid0·BLOCK_M, +BLOCK_M)`` of
    KV head ``(b, h_kv)`` against keys ``[s·split_len, (s + 1)·split_len)``.

    Q ``(B, Hq, Nq, D)``; K, V as :func:`~flashlite.kernels.attention.decode_parts.kv_tile`
    reads them; O ``(S·B, Hq, Nq, D)`` and the fp32 LSE ``(S·B·Hq, Nq)``: the partials of chunk s
    at batch rows ``s·B + b`` (with ``S = 1`` the result itself, in O's dtype). Masks, softcap,
    ``SEQLENS_K`` and ``SINKS`` as in the forward kernel; the sink's state starts chunk 0 only,
    so the merge counts it once. ``MASK_MOD``: a mask function with its buffers in
    ``MB0``–``MB3``; ``SCORE_MOD``: a score function with its buffers in ``SB0``–``SB3``
    (:func:`~flashlite.kernels.attention.decode_parts.decode_attend`). ``FP8``: an e4m3 cache
    (and Q, 16-bit or e4m3), widened to the 16-bit dtype ``FP8`` names as it is read (exactly:
    the step is bound by reading the cache, which FP8 halves), with the fp32 ``(B, Hkv)``
    descale factors (strides ``stride_sb``, ``stride_sh``) on the scores (Q's and K's) and the
    output (V's).
    """
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h_kv = pid_bh % n_kv_heads
    split = tl.program_id(2)
    q_mem = seq_q
    if HAS_SEQLENS:
        seq_k = tl.minimum(tl.maximum(tl.load(SEQLENS_K + b), 0), seq_k)
    # packed row r: query r // GROUP of head h_kv·GROUP + r % GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = rows // GROUP
    head = h_kv * GROUP + rows % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q * GROUP
    q_ptrs = _row_ptrs(Q, b, head, pos, offs_d, (stride_qb, stride_qh, stride_qm, stride_qd))
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out_scale = 1.0
    if FP8 is not None:
        q = q.to(FP8)
        d_at = b.to(tl.int64) * stride_sb + h_kv * stride_sh
        sm_scale = sm_scale * tl.load(Q_DESCALE + d_at) * tl.load(K_DESCALE + d_at)
        out_scale = tl.load(V_DESCALE + d_at)
    q, exp_scale = scale_q(q, sm_scale * LOG2E, PRESCALE_Q, ROUND_BF16)
    if DOT_FP32:
        q = q.to(tl.float32)
    cap = cap_units(softcap, exp_scale, SOFTCAP)
    acc, m, s = _initial_state(SINKS, head, row_ok, split, exp_scale, BLOCK_M, BLOCK_D, HAS_SINKS)
    scoring = (seq_q, seq_k, win_left, win_right, cap, exp_scale)
    lo, full_lo, full_hi, hi = _chunk_key_range(
        scoring, split, split_len, BLOCK_M, BLOCK_N, GROUP, IS_CAUSAL, WINDOW
    )
    # what decode_attend reads the tiles and scores with; the constexprs in annotated tuples (a
    # plain assignment would make them tensors)
    k_strides = (stride_kb, stride_kh, stride_kn, stride_kd)
    cache = (k_strides, (stride_vb, stride_vh, stride_vn, stride_vd), (TABLE, stride_tb, num_pages))
    ids = (b, h_kv, head, pos, offs_n, offs_d)
    bufs = (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3)
    tiles: tl.constexpr = (PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_DESC)
    flags: tl.constexpr = (IS_CAUSAL, WINDOW, SOFTCAP, DOT_FP32, DOT_PRECISION, ROUND_BF16, FP8)
    mods: tl.constexpr = (MASK_MOD, N_MASK_BUF, SCORE_MOD, N_SCORE_BUF)
    if WINDOW:  # the window's left edge (without one, lo = full_lo)
        acc, m, s = _decode_attend(
            acc, m, s, q, K, V, lo, full_lo, True, cache, ids, scoring, bufs, mods, tiles, flags
        )
    acc, m, s = _decode_attend(
        acc, m, s, q, K, V, full_lo, full_hi, False, cache, ids, scoring, bufs, mods, tiles, flags
    )
    acc, m, s = _decode_attend(
        acc, m, s, q, K, V, full_hi, hi, True, cache, ids, scoring, bufs, mods, tiles, flags
    )
    # rows that saw no key (a chunk past the sequence, causal with Nq > Nk): 0 and LSE −inf
    inv_s = tl.where(s > 0.0, out_scale / s, 0.0)
    part = split * (tl.num_programs(1) // n_kv_heads) + b  # batch row of the partials
    bh = part.to(tl.int64) * (n_kv_heads * GROUP) + head
    tl.store(LSE + bh * q_mem + pos, finalize_lse(m, s, exp_scale), mask=row_ok)
    o = cast(acc * inv_s[:, None], O.dtype.element_ty, ROUND_BF16)
    o_ptrs = _row_ptrs(O, part, head, pos, offs_d, (stride_ob, stride_oh, stride_om, stride_od))
    tl.store(o_ptrs, o, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _split_kv_combine_kernel(
    OP,
    LSEP,
    O,
    LSE,
    stride_ps,
    stride_pb,
    stride_ph,
    stride_pm,
    stride_pd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    n_heads,
    seq_q,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Grid ``(Nq, B·Hq)``: merge the ``n_splits`` partials ``OP`` (fp32 ``(S, B, Hq, Nq, D)``)
    and ``LSEP`` (fp32 ``(S, B·Hq, Nq)``) of one row into ``O`` ``(B, Hq, Nq, D)`` and the LSE
    (fp32 ``(B·Hq, Nq)``). All partials are loaded at once (one round of loads, not S) and
    folded in one step by :func:`flashlite.stats.merge_partials`; each partial is the pair
    ``(lse_s, 1)`` in natural units (``SCALE = log2 e`` gives ``e^(·)``), padding the identity
    ``(−inf, 0)``."""
    i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    split = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    n_bh = tl.num_programs(1)
    valid = split < n_splits
    lse_s = tl.load(
        LSEP + (split * n_bh + pid_bh).to(tl.int64) * seq_q + i, mask=valid, other=float("-inf")
    )[None, :]
    src = (
        OP
        + split.to(tl.int64)[:, None] * stride_ps
        + b.to(tl.int64) * stride_pb
        + h.to(tl.int64) * stride_ph
        + i.to(tl.int64) * stride_pm
        + offs_d[None, :] * stride_pd
    )
    o_s = tl.load(src, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m, s = merge_partials(lse_s, tl.where(valid, 1.0, 0.0)[None, :], LOG2E)
    weight = tl.trans(rescale(lse_s, m[:, None], LOG2E))  # [SPLITS_PAD, 1]
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)  # rows no chunk saw: 0, LSE −inf
    o = tl.sum(o_s * weight, 0) * inv_s
    tl.store(LSE + pid_bh.to(tl.int64) * seq_q + i + tl.arange(0, 1), finalize_lse(m, s, LOG2E))
    dst = (
        O
        + b.to(tl.int64) * stride_ob
        + h.to(tl.int64) * stride_oh
        + i.to(tl.int64) * stride_om
        + offs_d * stride_od
    )
    tl.store(dst, cast(o, O.dtype.element_ty, ROUND_BF16), mask=offs_d < HEAD_DIM)
