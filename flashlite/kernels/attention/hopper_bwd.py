"""Attention backward for Hopper (sm_90) in Gluon: one fused kernel, five products per tile.

The Triton backward (:mod:`flashlite.kernels.attention.bwd`) runs two kernels: dK/dV walks the
queries for a block of keys, dQ walks the keys for a block of queries, and each recomputes
``P`` and ``dP`` — seven products per tile of (query, key) pairs. This kernel does what
FlashAttention-3 and cuDNN do: one program owns ``BLOCK_N = 128`` keys of one K/V head, walks
the query blocks that see them (over the GQA group's heads), and adds its share of dQ into an
fp32 accumulator with a TMA reduction (``cp.reduce.async.bulk.tensor`` add): five products
per tile. The kernel adds ``scale·dS·K`` already, so a copy that rounds the accumulator
finishes dQ. The sums' order varies from run to run, so dQ is not bit-for-bit deterministic (dK
and dV are); the front-end keeps the Triton kernels under deterministic algorithms.

Per program, three partitions, as in the forward (:mod:`flashlite.kernels.attention.hopper`):

* a **producer** warp loads K and V once, then Qs and dO tiles of ``BLOCK_M = 64`` rows into a
  ring of ``STAGES`` shared-memory slots (TMA), and the tile's LSE and delta (through registers:
  64 values each);
* two **consumer** warpgroups, each owning 64 of the 128 keys: per query tile each computes
  ``Sᵀ − LSE = K·Qsᵀ`` and ``dPᵀ − delta = V·dOᵀ`` for its keys (the products start from −LSE
  and −delta broadcast over the keys: no row vector lives in registers across the step, which
  keeps ptxas's spills to a few loop counters), ``Pᵀ = 2^(Sᵀ − LSE)``,
  ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``, and accumulates ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Qs`` in
  registers (``Pᵀ`` and ``dSᵀ`` enter those products from registers);
* for dQ the two warpgroups split **columns**, not keys (FlashAttention-3's split): each
  writes its half of ``dSᵀ`` to shared memory, and once both halves are there each computes
  ``dQ[:, its 64 columns] = dS · K[:, its columns]`` over all 128 keys. Every dQ byte is then
  reduced once per 128 keys, not once per 64, and each warpgroup holds a 64×64 dQ tile, not
  64×128.

The query blocks are walked from the last down, the causal diagonal's (masked) ones last.
Without causal masking the last key block, when it runs past Nk, masks every step: TMA reads
the missing keys' rows as zeros, so their ``P = 2^(0 − LSE)`` is not 0, and with few keys and
large scores (a very negative LSE) it overflows 16 bits, and ``inf·0`` in ``dS·K`` made dQ NaN.

Qs is the backward preprocess's ``Q·scale·log2 e`` (:mod:`flashlite.kernels.attention.bwd`),
so the scores are the forward's bit for bit and ``P = 2^(Sᵀ − LSE·log2 e)``: the producer
converts the LSE with :func:`flashlite.stats_gluon.lse_log2`, and a score function's
probabilities come from :func:`~flashlite.stats_gluon.probs_from_lse_t` (the Gluon twins of the
stats helpers, which a Gluon kernel cannot call).

The same kernel serves :func:`flashlite.flex_attention`'s backward (``LISTED``): a key block
walks the query blocks its row of the ``q_*`` block tables lists for each head of the group
(two 64-row steps per 128-row table block), full ones first, then partial ones, where
``mask_mod`` zeroes ``Pᵀ``. A score function sees the natural-unit scores ``Sᵀ·ln 2`` before
the LSE is subtracted (the products then start from 0, not −LSE), and its derivative multiplies
``dPᵀ − delta``.

Runs only on a CUDA sm_90 device with Triton's Gluon (3.6 measured). Dense attention: causal
(bottom-right aligned) or not, GQA, any lengths; no window, soft cap, per-batch lengths or
packed sequences (those take the Triton kernels); or block tables with mask and score
functions.
"""

from __future__ import annotations

from flashlite.kernels.attention.hopper import GLUON_IMPORT_ERROR
from flashlite.masking.mods import apply_mask, apply_score
from flashlite.stats import LN2, LOG2E

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from flashlite.kernels.attention.hopper import wgmma_layout
    from flashlite.stats_gluon import lse_log2, probs_from_lse_t

#: Keys per program (two warpgroups of 64), query rows per step, ring slots for Qs and dO.
BLOCK_N = 128
BLOCK_M = 64
STAGES = 2
#: Head dims this kernel is built for.
HEAD_DIMS = (64, 128)
#: Causal launches order programs in groups of this many (batch, K/V head) pairs, heads
#: fastest: each group's heaviest key blocks start first (balance), and the group's Qs, dO and
#: dQ rows stay in L2 (on the H200 at B 4, Hq 16, Hkv 8, N 4k: 4 beat 1 by 8%, 2 by 8% and 8
#: by 1%; 16k: 2 and 4 within 2%).
CAUSAL_GROUP_H = 4


#: Why this Triton cannot build the kernel, or None.
GLUON_BWD_ERROR: str | None = GLUON_IMPORT_ERROR
if GLUON_BWD_ERROR is None:
    try:  # the names differ between Triton versions; a missing one only disables the kernel
        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
        # a CTA barrier (inside a partition: its warps only); Triton 3.9 names it gl.barrier
        _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
        _tma_add = getattr(tma, "async_atomic_add", None)
        if _tma_add is None:  # Triton 3.6 has the operation but no Python name for it
            import triton

            from flashlite._launch import gluon_tma_add

            _tma_add = gluon_tma_add()
            if _tma_add is None:
                raise ImportError(f"triton {triton.__version__}'s Gluon has no TMA reduce-add")
    except Exception as err:  # noqa: BLE001 - any failure means: not available
        GLUON_BWD_ERROR = f"{type(err).__name__}: {err}"


def available() -> bool:
    """Whether this Triton has the Gluon pieces the kernel uses."""
    return GLUON_BWD_ERROR is None


if GLUON_BWD_ERROR is None:

    @gluon.jit
    def _table_row(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, kb, stride_tb, stride_th,
                   stride_tn, stride_ib, stride_ih, stride_in):  # fmt: skip
        """Key block ``kb``'s row of the ``q_*`` tables for query head ``h``: how many full query
        blocks and where their indices start, then the same of the partial ones."""
        trow = b * stride_tb + h * stride_th + kb * stride_tn
        irow = b.to(gl.int64) * stride_ib + h * stride_ih + kb * stride_in
        n_full = gl.load(FULL_NUM + trow)
        n_part = gl.load(PART_NUM + trow)
        return n_full, FULL_IDX + irow, n_part, PART_IDX + irow

    @gluon.jit
    def _listed_start(j, idx_row, block_m: gl.constexpr):
        """The first query row of step ``j`` over a table row's blocks: a table block is two
        steps (``2·block_m`` queries)."""
        return gl.load(idx_row + j // 2) * (2 * block_m) + (j % 2) * block_m

    @gluon.jit
    def _query_start(j, first, idx_row, lo, n_qblocks, block_m: gl.constexpr,
                     LISTED: gl.constexpr):  # fmt: skip
        """The first query row of the consumers' step ``j``: ``LISTED``, of step ``j − first``
        over the table row ``idx_row`` (:func:`_listed_start`); else of the ``j``-th query
        block from the last (of ``n_qblocks`` from ``lo``)."""
        if LISTED:
            start = _listed_start(j - first, idx_row, block_m)
        else:
            start = lo + (n_qblocks - 1 - j) * block_m
        return start

    @gluon.jit
    def _producer(qs_desc, do_desc, k_desc, v_desc, LSE, DELTA, qs_bufs, do_bufs, lse_bufs,
                  delta_bufs, k_buf, v_buf, kv_ready, q_ready, do_ready, empty, b, h_kv, n_heads,
                  group, seq_q, start_n, lo, n_qblocks, FULL_NUM, FULL_IDX, Q_NUM, Q_IDX,
                  stride_tb, stride_th, stride_tn, stride_ib, stride_ih, stride_in,
                  LISTED: gl.constexpr):  # fmt: skip
        """The load warp: K and V once, then step by step into the ring: Qs and dO (TMA), and
        their rows' statistics (through registers: LSE in exp2 units, +inf for rows past Nq or
        that saw no key, so that their P is 0; delta). The steps are the consumers': per head
        of the group, the query blocks from the last down, or (``LISTED``) the blocks the
        tables list, full ones first."""
        block_m: gl.constexpr = qs_bufs.shape[3]
        block_n: gl.constexpr = k_buf.shape[2]
        stages: gl.constexpr = qs_bufs.shape[0]
        stat_l: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        offs = gl.arange(0, block_m, layout=stat_l)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b, h_kv, start_n, 0], kv_ready, k_buf)
        _tma_load(v_desc, [b, h_kv, start_n, 0], kv_ready, v_buf)
        t = 0
        for g in range(group):
            h = h_kv * group + g
            if LISTED:
                n_full, full_row, n_part, part_row = _table_row(
                    FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, b, h, start_n // block_n, stride_tb,
                    stride_th, stride_tn, stride_ib, stride_ih, stride_in)  # fmt: skip
                n_here = 2 * (n_full + n_part)
            else:
                n_here = n_qblocks
            for j in range(n_here):
                slot = t % stages
                if t >= stages:
                    mbarrier.wait(empty.index(slot), ((t // stages) - 1) & 1)
                if LISTED:
                    if j < 2 * n_full:
                        start_m = _listed_start(j, full_row, block_m)
                    else:
                        start_m = _listed_start(j - 2 * n_full, part_row, block_m)
                else:
                    start_m = lo + (n_qblocks - 1 - j) * block_m  # the consumers' order
                rows = start_m + offs
                at = (b * n_heads + h).to(gl.int64) * seq_q + rows
                lse = gl.load(LSE + at, mask=rows < seq_q, other=float("-inf"))
                lse_bufs.index(slot).store(lse_log2(lse))
                delta_bufs.index(slot).store(gl.load(DELTA + at, mask=rows < seq_q, other=0.0))
                mbarrier.expect(q_ready.index(slot), qs_desc.block_type.nbytes)
                _tma_load(qs_desc, [b, h, start_m, 0], q_ready.index(slot), qs_bufs.index(slot))
                mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
                _tma_load(do_desc, [b, h, start_m, 0], do_ready.index(slot), do_bufs.index(slot))
                t += 1

    @gluon.jit
    def _step(t, start_m, h, dk, dv, qs_bufs, do_bufs, lse_bufs, delta_bufs, k_mine, v_mine,
              k_cols, ds_bufs, dq_buf, q_ready, do_ready, empty, ds_ready, ds_free, dq_desc, b,
              keys, diag, seq_q, seq_k, sm_scale, MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
              WG: gl.constexpr, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
              LISTED: gl.constexpr, MASK_MOD: gl.constexpr, N_MASK_BUF: gl.constexpr,
              SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, N_SCORE_BUF: gl.constexpr,
              HAS_SCORE: gl.constexpr):  # fmt: skip
        """The ``t``-th step of one consumer warpgroup, the query tile at ``start_m`` of head
        ``h``: dK and dV updated and returned, this warpgroup's columns of dQ added to the
        accumulator. ``MASKED``: the tile holds the causal diagonal (causal) or keys past Nk
        (not causal: the last key block), or (``LISTED``) is a partial block: ``mask_mod``
        and the keys past Nk mask it. ``HAS_SCORE``: the scores pass through ``score_mod``
        (natural units), and ``dS`` is multiplied by its derivative ``SCORE_GRAD``."""
        block_m: gl.constexpr = qs_bufs.shape[3]
        head_dim: gl.constexpr = qs_bufs.shape[4]
        stages: gl.constexpr = qs_bufs.shape[0]
        half: gl.constexpr = k_mine.shape[0]
        dcols: gl.constexpr = k_cols.shape[1]
        dtype: gl.constexpr = k_mine.dtype
        # wgmma register layouts: the transposed scores [keys, queries], dK/dV [keys, head_dim],
        # dQ [queries, dcols]; Pᵀ and dSᵀ enter dV and dK's products from registers
        s_layout: gl.constexpr = wgmma_layout(block_m)
        acc_layout: gl.constexpr = wgmma_layout(head_dim)
        dq_layout: gl.constexpr = wgmma_layout(dcols)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                     k_width=2)  # fmt: skip
        slot = t % stages
        phase = (t // stages) & 1
        buf = t % 2
        stat_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        s_zero = gl.zeros([half, block_m], gl.float32, layout=s_layout)
        dq_zero = gl.zeros([block_m, dcols], gl.float32, layout=dq_layout)

        qs = qs_bufs.index(slot).reshape([block_m, head_dim])
        do = do_bufs.index(slot).reshape([block_m, head_dim])
        # the products start from −LSE and −delta (broadcast over the keys): the tensor cores
        # hand back Sᵀ − LSE and dPᵀ − delta, and no row vector stays in registers
        mbarrier.wait(q_ready.index(slot), phase)
        lse2 = lse_bufs.index(slot).load(stat_l)
        if HAS_SCORE:  # the raw scores: score_mod comes before the LSE is subtracted
            st_tok = warpgroup_mma(k_mine, qs.permute((1, 0)), s_zero, is_async=True)
        else:
            st_tok = warpgroup_mma(k_mine, qs.permute((1, 0)), s_zero - gl.expand_dims(lse2, 0),
                                   is_async=True)  # fmt: skip
        mbarrier.wait(do_ready.index(slot), phase)
        delta = delta_bufs.index(slot).load(stat_l)
        dpt_tok = warpgroup_mma(v_mine, do.permute((1, 0)), s_zero - gl.expand_dims(delta, 0),
                                is_async=True)  # fmt: skip
        st = warpgroup_mma_wait(1, deps=[st_tok])
        if LISTED:  # the mods' indices, clamped (a mod may gather by them)
            rows = start_m + gl.arange(0, block_m, layout=stat_l)
            q_idx = gl.expand_dims(gl.minimum(rows, seq_q - 1), 0)
            kv_idx = gl.expand_dims(gl.minimum(keys, seq_k - 1), 1)
        if HAS_SCORE:  # Qs carries scale·log2 e: natural units are st·ln 2
            xt = st * LN2
            score = apply_score(SCORE_MOD, xt, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF)
            pt = probs_from_lse_t(score, lse2, LOG2E, True)
        else:  # (the products subtracted the LSE: probs_from_lse_t's last step is left)
            pt = gl.exp2(st)
        if MASKED:
            if LISTED:
                seen = apply_mask(MASK_MOD, b, h, q_idx, kv_idx, MB0, MB1, MB2, MB3, N_MASK_BUF)
                seen = seen & gl.expand_dims(keys < seq_k, 1)
            elif IS_CAUSAL:  # keys past a row's last visible one (bottom-right aligned)
                rows = start_m + gl.arange(0, block_m, layout=stat_l)
                seen = gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + diag
            else:  # keys past Nk: TMA reads their rows as zeros, so S = 0 and P = 2^(−LSE),
                # which a very negative LSE (few keys, large scores) overflows to inf in 16 bits
                seen = gl.expand_dims(keys < seq_k, 1)
            pt = gl.where(seen, pt, 0.0)
        pt16 = pt.to(dtype)
        dv_tok = warpgroup_mma(gl.convert_layout(pt16, a_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        if HAS_SCORE:
            dpt = dpt * apply_score(SCORE_GRAD, xt, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3,
                                    N_SCORE_BUF)  # fmt: skip
        dst16 = (pt * dpt).to(dtype)
        # share this warpgroup's half of dSᵀ; the buffer's previous use (two steps back) must
        # be finished by both warpgroups
        if t >= 2:
            mbarrier.wait(ds_free.index(buf), ((t // 2) - 1) & 1)
        ds_all = ds_bufs.index(buf)
        ds_all.slice(WG * half, half, dim=0).store(dst16)
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        dk_tok = warpgroup_mma(gl.convert_layout(dst16, a_layout), qs, dk, is_async=True)
        mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
        dq_tok = warpgroup_mma(ds_all.permute((1, 0)), k_cols, dq_zero, use_acc=False,
                               is_async=True)  # fmt: skip
        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
        mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.arrive(ds_free.index(buf), count=1)
        # dQ's share, scaled here so that the accumulator only needs rounding; first wait
        # until the last reduction has read the staging buffer
        tma.store_wait(pendings=0)
        _thread_barrier()
        dq_buf.reshape([block_m, dcols]).store(dq * sm_scale)
        fence_async_shared()
        _thread_barrier()
        _tma_add(dq_desc, [b, h, start_m, WG * dcols], dq_buf)
        return dk, dv

    @gluon.jit
    def _consumer(qs_bufs, do_bufs, lse_bufs, delta_bufs, k_buf, v_buf, ds_bufs, dq_bufs,
                  kv_ready, q_ready, do_ready, empty, ds_ready, ds_free, dq_desc, DK, DV,
                  stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, b, h_kv,
                  group, start_n, lo, n_masked, n_qblocks, seq_q, seq_k, sm_scale, FULL_NUM,
                  FULL_IDX, Q_NUM, Q_IDX, stride_tb, stride_th, stride_tn, stride_ib, stride_ih,
                  stride_in, MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3, WG: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, LISTED: gl.constexpr, MASK_MOD: gl.constexpr,
                  N_MASK_BUF: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr,
                  N_SCORE_BUF: gl.constexpr, HAS_SCORE: gl.constexpr):  # fmt: skip
        """One warpgroup: dK and dV of its 64 keys, and its 64 columns of each step's dQ."""
        block_m: gl.constexpr = qs_bufs.shape[3]
        head_dim: gl.constexpr = qs_bufs.shape[4]
        half: gl.constexpr = k_buf.shape[2] // 2  # this warpgroup's keys
        dcols: gl.constexpr = head_dim // 2  # this warpgroup's dQ columns
        dtype: gl.constexpr = k_buf.dtype
        # wgmma register layouts (see _step): the transposed scores, dK and dV
        s_layout: gl.constexpr = wgmma_layout(block_m)
        acc_layout: gl.constexpr = wgmma_layout(head_dim)
        key_l: gl.constexpr = gl.SliceLayout(1, s_layout)

        keys = start_n + WG * half + gl.arange(0, half, layout=key_l)
        k_all = k_buf.reshape([2 * half, head_dim])
        k_mine = k_all.slice(WG * half, half, dim=0)
        v_mine = v_buf.reshape([2 * half, head_dim]).slice(WG * half, half, dim=0)
        k_cols = k_all.slice(WG * dcols, dcols, dim=1)  # [128 keys, dcols]: dQ's B operand
        dk = gl.zeros([half, head_dim], gl.float32, layout=acc_layout)
        dv = gl.zeros([half, head_dim], gl.float32, layout=acc_layout)
        dq_buf = dq_bufs.index(WG)
        diag = seq_k - seq_q
        mbarrier.wait(kv_ready, 0)
        t = 0  # steps so far: the ring's and the dS buffers' phases follow it
        for g in range(group):
            h = h_kv * group + g
            # the unmasked steps, then the masked ones: LISTED, the blocks this key block's
            # table row lists (full ones, then partial); else the query blocks from the last
            # down (programs of one head then reduce into the same dQ rows at about the same
            # time), the masked ones (the diagonal's, or every one of a key block that runs
            # past Nk) last
            if LISTED:
                n_full, full_row, n_part, part_row = _table_row(
                    FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, b, h, start_n // (2 * half), stride_tb,
                    stride_th, stride_tn, stride_ib, stride_ih, stride_in)  # fmt: skip
                n_whole = 2 * n_full
                n_all = n_whole + 2 * n_part
            else:
                full_row, part_row = Q_IDX, Q_IDX  # (placeholders, never read)
                n_whole = n_qblocks - n_masked
                n_all = n_qblocks
            for phase in gl.static_range(2):  # the unmasked steps, then the masked ones
                if phase == 0:
                    j0, j1, idx_row = 0, n_whole, full_row
                else:
                    j0, j1, idx_row = n_whole, n_all, part_row
                for j in range(j0, j1):
                    start_m = _query_start(j, j0, idx_row, lo, n_qblocks, block_m, LISTED)
                    dk, dv = _step(t, start_m, h, dk, dv, qs_bufs, do_bufs, lse_bufs, delta_bufs,
                                   k_mine, v_mine, k_cols, ds_bufs, dq_buf, q_ready, do_ready,
                                   empty, ds_ready, ds_free, dq_desc, b, keys, diag, seq_q,
                                   seq_k, sm_scale, MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3, WG,
                                   phase == 1, IS_CAUSAL, LISTED, MASK_MOD, N_MASK_BUF,
                                   SCORE_MOD, SCORE_GRAD, N_SCORE_BUF, HAS_SCORE)  # fmt: skip
                    t += 1
        tma.store_wait(pendings=0)

        # dK is summed against Qs = Q·scale·log2 e: divide the log2 e out. Keys past Nk are
        # not stored.
        r = start_n + WG * half + gl.arange(0, half, layout=gl.SliceLayout(1, acc_layout))
        c = gl.arange(0, head_dim, layout=gl.SliceLayout(0, acc_layout))
        mask = gl.expand_dims(r < seq_k, 1)
        k_off = gl.expand_dims(r.to(gl.int64) * stride_kn, 1) + gl.expand_dims(c, 0)
        v_off = gl.expand_dims(r.to(gl.int64) * stride_vn, 1) + gl.expand_dims(c, 0)
        dk_base = DK + b.to(gl.int64) * stride_kb + h_kv.to(gl.int64) * stride_kh
        dv_base = DV + b.to(gl.int64) * stride_vb + h_kv.to(gl.int64) * stride_vh
        gl.store(dk_base + k_off, (dk * LN2).to(dtype), mask=mask)
        gl.store(dv_base + v_off, dv.to(dtype), mask=mask)

    @gluon.jit
    def _attention_bwd_hopper_kernel(qs_desc, do_desc, k_desc, v_desc, dq_desc, LSE, DELTA, DK,
                                     DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                     stride_vn, n_heads, kv_heads, group, seq_q, seq_k,
                                     sm_scale, FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, stride_tb,
                                     stride_th, stride_tn, stride_ib, stride_ih, stride_in, MB0,
                                     MB1, MB2, MB3, SB0, SB1, SB2, SB3, STAGES: gl.constexpr,
                                     GROUP_H: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                     LISTED: gl.constexpr = False,
                                     MASK_MOD: gl.constexpr = None,
                                     N_MASK_BUF: gl.constexpr = 0,
                                     SCORE_MOD: gl.constexpr = None,
                                     SCORE_GRAD: gl.constexpr = None,
                                     N_SCORE_BUF: gl.constexpr = 0,
                                     HAS_SCORE: gl.constexpr = False):  # fmt: skip
        """Grid ``(cdiv(Nk, 128), B·Hkv)``; 4 warps (the first consumer) plus the worker
        partitions. Qs, dO: ``[1, 1, 64, D]`` blocks; K, V: ``[1, 1, 128, D]``; dQ's fp32
        accumulator: ``[1, 1, 64, D/2]``. dK and dV (strided like K and V, with a unit last
        stride) are written by pointer. Causal is bottom-right aligned; the first key blocks,
        seen by the most queries, start first.

        ``LISTED`` (:func:`flashlite.flex_attention`): the query blocks are the ones a key
        block's row of the ``q_*`` block tables lists for each head of the group
        (:mod:`flashlite.block_mask`, blocks of 128 × 128: two steps each), full ones first,
        and ``mask_mod`` / ``score_mod`` with its derivative ``SCORE_GRAD``
        (:mod:`flashlite.mods`, buffers ``MB*`` / ``SB*``) shape the scores as the forward's;
        otherwise the table arguments are placeholders, never read."""
        block_m: gl.constexpr = qs_desc.block_type.shape[2]
        block_n: gl.constexpr = k_desc.block_type.shape[2]
        head_dim: gl.constexpr = qs_desc.block_type.shape[3]
        dtype: gl.constexpr = qs_desc.dtype
        # 1-D grid over (key block, batch·head) in groups of GROUP_H heads: within a group the
        # heads run fastest, so the heaviest causal blocks of GROUP_H heads start first
        n_kb = gl.cdiv(seq_k, block_n)
        n_bh = gl.num_programs(0) // n_kb
        pid = gl.program_id(0)
        first_bh = (pid // (GROUP_H * n_kb)) * GROUP_H
        in_group = gl.minimum(n_bh - first_bh, GROUP_H)
        idx = pid - first_bh * n_kb
        pid_bh = first_bh + idx % in_group
        b = pid_bh // kv_heads
        h_kv = pid_bh % kv_heads
        start_n = (idx // in_group) * block_n
        # query blocks [lo, full_lo) hold the diagonal (masked), [full_lo, Nq) see every key
        if IS_CAUSAL:
            diag = seq_k - seq_q
            lo = (gl.maximum(start_n - diag, 0) // block_m) * block_m
            full_lo = gl.cdiv(gl.maximum(start_n + block_n - 1 - diag, 0), block_m) * block_m
        else:
            lo = 0
            full_lo = 0
        n_qblocks = gl.cdiv(gl.maximum(seq_q - lo, 0), block_m)
        n_masked = gl.minimum((full_lo - lo) // block_m, n_qblocks)
        if not IS_CAUSAL:  # the last key block, past Nk: every step masks the missing keys
            n_masked = gl.where(start_n + block_n > seq_k, n_qblocks, 0)

        qs_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, block_m, head_dim],
                                            qs_desc.layout)  # fmt: skip
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, block_m, head_dim],
                                            do_desc.layout)  # fmt: skip
        stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, block_m], stat_layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, block_m], stat_layout)
        k_buf = gl.allocate_shared_memory(dtype, [1, 1, block_n, head_dim], k_desc.layout)
        v_buf = gl.allocate_shared_memory(dtype, [1, 1, block_n, head_dim], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([block_n, block_m], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, block_n, block_m], ds_layout)
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 1, 1, block_m, head_dim // 2],
                                            dq_desc.layout)  # fmt: skip
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=2)

        # (argument tuples written out: constexprs must reach the partitions as literals)
        gl.warp_specialize([
            (_consumer, (qs_bufs, do_bufs, lse_bufs, delta_bufs, k_buf, v_buf, ds_bufs, dq_bufs,
                         kv_ready, q_ready, do_ready, empty, ds_ready, ds_free, dq_desc, DK, DV,
                         stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, b,
                         h_kv, group, start_n, lo, n_masked, n_qblocks, seq_q, seq_k, sm_scale,
                         FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, stride_tb, stride_th, stride_tn,
                         stride_ib, stride_ih, stride_in, MB0, MB1, MB2, MB3, SB0, SB1, SB2,
                         SB3, 0, IS_CAUSAL, LISTED, MASK_MOD, N_MASK_BUF, SCORE_MOD,
                         SCORE_GRAD, N_SCORE_BUF, HAS_SCORE)),
            (_consumer, (qs_bufs, do_bufs, lse_bufs, delta_bufs, k_buf, v_buf, ds_bufs, dq_bufs,
                         kv_ready, q_ready, do_ready, empty, ds_ready, ds_free, dq_desc, DK, DV,
                         stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, b,
                         h_kv, group, start_n, lo, n_masked, n_qblocks, seq_q, seq_k, sm_scale,
                         FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, stride_tb, stride_th, stride_tn,
                         stride_ib, stride_ih, stride_in, MB0, MB1, MB2, MB3, SB0, SB1, SB2,
                         SB3, 1, IS_CAUSAL, LISTED, MASK_MOD, N_MASK_BUF, SCORE_MOD,
                         SCORE_GRAD, N_SCORE_BUF, HAS_SCORE)),
            (_producer, (qs_desc, do_desc, k_desc, v_desc, LSE, DELTA, qs_bufs, do_bufs,
                         lse_bufs, delta_bufs, k_buf, v_buf, kv_ready, q_ready, do_ready, empty,
                         b, h_kv, n_heads, group, seq_q, start_n, lo, n_qblocks, FULL_NUM,
                         FULL_IDX, Q_NUM, Q_IDX, stride_tb, stride_th, stride_tn, stride_ib,
                         stride_ih, stride_in, LISTED)),
        ], [4, 1], [240, 24])  # fmt: skip
