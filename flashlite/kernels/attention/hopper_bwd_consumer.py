"""The consumer warpgroups of the fused Hopper attention backward
(:mod:`flashlite.kernels.attention.hopper_bwd`): one step over a query tile (:func:`_step`: the
five products, dK and dV in registers, this warpgroup's columns of dQ reduced into the fp32
accumulator) and the walk over the query blocks of a key block (:func:`consumer`)."""

from __future__ import annotations

from flashlite.kernels.attention.hopper_bwd_parts import GLUON_BWD_ERROR
from flashlite.masking.mods import apply_mask, apply_score
from flashlite.stats import LN2, LOG2E

if GLUON_BWD_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from flashlite.kernels.attention.hopper_bwd_parts import query_start as _query_start
    from flashlite.kernels.attention.hopper_bwd_parts import table_row as _table_row
    from flashlite.kernels.attention.hopper_bwd_parts import thread_barrier as _thread_barrier
    from flashlite.kernels.attention.hopper_bwd_parts import tma_add as _tma_add
    from flashlite.kernels.attention.hopper_parts import wgmma_layout
    from flashlite.stats_gluon import probs_from_lse_t

if GLUON_BWD_ERROR is None:

    @gluon.jit
    def _mask_of(mask, b, h, q_idx, kv_idx):
        """``mask_mod`` over a tile's indices; ``mask``: ``(MASK_MOD, N_MASK_BUF, MB0..MB3)``
        (indexed, not unpacked: a name would turn a constant buffer into a tensor)."""
        return apply_mask(mask[0], b, h, q_idx, kv_idx, mask[2], mask[3], mask[4], mask[5], mask[1])

    @gluon.jit
    def _score_of(fn: gl.constexpr, score, x, b, h, q_idx, kv_idx):
        """``fn`` (``score_mod`` or its derivative) over a tile; ``score``: ``(SCORE_MOD,
        SCORE_GRAD, N_SCORE_BUF, SB0..SB3)``."""
        return apply_score(
            fn, x, b, h, q_idx, kv_idx, score[3], score[4], score[5], score[6], score[2]
        )

    @gluon.jit
    def _products_t(ring, slot, phase, qs, do, k_mine, v_mine, s_zero, HAS_SCORE: gl.constexpr):
        """The step's first two products, once the ring slot is loaded: ``Sᵀ − LSE = K·Qsᵀ``
        (waited for) and ``dPᵀ − delta = V·dOᵀ`` (left running: its token is returned), each
        ``[half, block_m]``, and the rows' LSE. ``HAS_SCORE``: the raw ``Sᵀ``."""
        _, _, lse_bufs, delta_bufs, q_ready, do_ready, _ = ring
        stat_l: gl.constexpr = gl.SliceLayout(0, wgmma_layout(qs.shape[0]))
        # the products start from −LSE and −delta (broadcast over the keys): the tensor cores
        # hand back Sᵀ − LSE and dPᵀ − delta, and no row vector stays in registers
        mbarrier.wait(q_ready.index(slot), phase)
        lse2 = lse_bufs.index(slot).load(stat_l)
        if HAS_SCORE:  # the raw scores: score_mod comes before the LSE is subtracted
            st_tok = warpgroup_mma(k_mine, qs.permute((1, 0)), s_zero, is_async=True)
        else:
            st_tok = warpgroup_mma(
                k_mine, qs.permute((1, 0)), s_zero - gl.expand_dims(lse2, 0), is_async=True
            )
        mbarrier.wait(do_ready.index(slot), phase)
        delta = delta_bufs.index(slot).load(stat_l)
        dpt_tok = warpgroup_mma(
            v_mine, do.permute((1, 0)), s_zero - gl.expand_dims(delta, 0), is_async=True
        )
        st = warpgroup_mma_wait(1, deps=[st_tok])
        return st, dpt_tok, lse2

    @gluon.jit
    def _probs_t(st, lse2, start_m, h, keys, where, flags, MASKED: gl.constexpr, mask, score):
        """``Pᵀ`` ``[half, block_m]`` from the step's ``Sᵀ`` (less the LSE unless
        ``HAS_SCORE``), masked where ``MASKED``; with what the score's derivative needs: the
        natural-unit scores and the mods' indices (placeholders where unused)."""
        b, diag, seq_q, seq_k, _ = where
        IS_CAUSAL: gl.constexpr = flags[1]
        LISTED: gl.constexpr = flags[2]
        HAS_SCORE: gl.constexpr = flags[3]
        block_m: gl.constexpr = st.shape[1]
        stat_l: gl.constexpr = gl.SliceLayout(0, wgmma_layout(block_m))
        xt, q_idx, kv_idx = st, 0, 0  # (placeholders, never read)
        if LISTED:  # the mods' indices, clamped (a mod may gather by them)
            rows = start_m + gl.arange(0, block_m, layout=stat_l)
            q_idx = gl.expand_dims(gl.minimum(rows, seq_q - 1), 0)
            kv_idx = gl.expand_dims(gl.minimum(keys, seq_k - 1), 1)
        if HAS_SCORE:  # Qs carries scale·log2 e: natural units are st·ln 2
            xt = st * LN2
            pt = probs_from_lse_t(
                _score_of(score[0], score, xt, b, h, q_idx, kv_idx), lse2, LOG2E, True
            )
        else:  # (the products subtracted the LSE: probs_from_lse_t's last step is left)
            pt = gl.exp2(st)
        if MASKED:
            if LISTED:
                seen = _mask_of(mask, b, h, q_idx, kv_idx)
                seen = seen & gl.expand_dims(keys < seq_k, 1)
            elif IS_CAUSAL:  # keys past a row's last visible one (bottom-right aligned)
                rows = start_m + gl.arange(0, block_m, layout=stat_l)
                seen = gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + diag
            else:  # keys past Nk: TMA reads their rows as zeros, so S = 0 and P = 2^(−LSE),
                # which a very negative LSE (few keys, large scores) overflows to inf in 16 bits
                seen = gl.expand_dims(keys < seq_k, 1)
            pt = gl.where(seen, pt, 0.0)
        return pt, xt, q_idx, kv_idx

    @gluon.jit
    def _dk_and_dq(t, buf, dst16, qs, dk, dv_tok, k_cols, share, WG: gl.constexpr):
        """This warpgroup's half of ``dSᵀ`` into dS buffer ``buf`` (once both warpgroups are
        done with its use two steps back), ``dK += dSᵀ·Qs`` and, once both halves are in,
        ``dQ[:, its columns] = dS·K[:, its columns]`` (``[block_m, dcols]``). Waits for these
        and dV's product, and returns dV, dK and the dQ tile."""
        ds_bufs, ds_ready, ds_free, _, _ = share
        half: gl.constexpr = dst16.shape[0]
        block_m: gl.constexpr = dst16.shape[1]
        dcols: gl.constexpr = k_cols.shape[1]
        acc_layout: gl.constexpr = wgmma_layout(qs.shape[1])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dq_zero = gl.zeros([block_m, dcols], gl.float32, layout=wgmma_layout(dcols))
        if t >= 2:
            mbarrier.wait(ds_free.index(buf), ((t // 2) - 1) & 1)
        ds_all = ds_bufs.index(buf)
        ds_all.slice(WG * half, half, dim=0).store(dst16)
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        dk_tok = warpgroup_mma(gl.convert_layout(dst16, a_layout), qs, dk, is_async=True)
        mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
        dq_tok = warpgroup_mma(
            ds_all.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
        )
        return warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])

    @gluon.jit
    def _reduce_dq(dq, start_m, h, b, sm_scale, share, WG: gl.constexpr):
        """``scale·dQ`` tile added into the fp32 accumulator (TMA reduction) through this
        warpgroup's staging buffer, scaled here so that the accumulator only needs rounding;
        first waits until the last reduction has read the staging buffer."""
        _, _, _, dq_buf, dq_desc = share
        block_m: gl.constexpr = dq.shape[0]
        dcols: gl.constexpr = dq.shape[1]
        tma.store_wait(pendings=0)
        _thread_barrier()
        dq_buf.reshape([block_m, dcols]).store(dq * sm_scale)
        fence_async_shared()
        _thread_barrier()
        _tma_add(dq_desc, [b, h, start_m, WG * dcols], dq_buf)

    @gluon.jit
    def _step(t, start_m, h, dk, dv, mem, where, flags, MASKED: gl.constexpr, mask, score):
        """The ``t``-th step of one consumer warpgroup (``flags[0]``), the query tile at
        ``start_m`` of head ``h``: dK and dV updated and returned, this warpgroup's columns of
        dQ added to the accumulator. ``MASKED``: the tile holds the causal diagonal (causal)
        or keys past Nk (not causal: the last key block), or (``LISTED``) is a partial block:
        ``mask_mod`` and the keys past Nk mask it. ``HAS_SCORE``: the scores pass through
        ``score_mod`` (natural units), and ``dS`` is multiplied by its derivative
        ``SCORE_GRAD``. ``mem``, ``where``: see :func:`consumer`."""
        ring, mine, share = mem
        qs_bufs, do_bufs, _, _, _, _, empty = ring
        k_mine, v_mine, k_cols, keys = mine
        ds_free = share[2]
        b, _, _, _, sm_scale = where
        WG: gl.constexpr = flags[0]
        HAS_SCORE: gl.constexpr = flags[3]
        block_m: gl.constexpr = qs_bufs.shape[3]
        head_dim: gl.constexpr = qs_bufs.shape[4]
        stages: gl.constexpr = qs_bufs.shape[0]
        half: gl.constexpr = k_mine.shape[0]
        dtype: gl.constexpr = k_mine.dtype
        # wgmma register layouts: the transposed scores [keys, queries], dK/dV [keys, head_dim];
        # Pᵀ and dSᵀ enter dV and dK's products from registers
        s_layout: gl.constexpr = wgmma_layout(block_m)
        acc_layout: gl.constexpr = wgmma_layout(head_dim)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        slot = t % stages
        phase = (t // stages) & 1
        buf = t % 2
        s_zero = gl.zeros([half, block_m], gl.float32, layout=s_layout)

        qs = qs_bufs.index(slot).reshape([block_m, head_dim])
        do = do_bufs.index(slot).reshape([block_m, head_dim])
        st, dpt_tok, lse2 = _products_t(
            ring, slot, phase, qs, do, k_mine, v_mine, s_zero, HAS_SCORE
        )
        pt, xt, q_idx, kv_idx = _probs_t(
            st, lse2, start_m, h, keys, where, flags, MASKED, mask, score
        )
        pt16 = pt.to(dtype)
        dv_tok = warpgroup_mma(gl.convert_layout(pt16, a_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        if HAS_SCORE:
            dpt = dpt * _score_of(score[1], score, xt, b, h, q_idx, kv_idx)
        dst16 = (pt * dpt).to(dtype)
        # share this warpgroup's half of dSᵀ: the two warpgroups split dQ's columns
        dv, dk, dq = _dk_and_dq(t, buf, dst16, qs, dk, dv_tok, k_cols, share, WG)
        mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.arrive(ds_free.index(buf), count=1)
        _reduce_dq(dq, start_m, h, b, sm_scale, share, WG)
        return dk, dv

    @gluon.jit
    def _head_blocks(tables, b, h, kb, n_masked, n_qblocks, LISTED: gl.constexpr):
        """Head ``h``'s steps: how many are unmasked, how many in all, and the table rows of
        the full and partial blocks (``LISTED``: key block ``kb``'s row of the tables; else
        the ``n_qblocks`` query blocks, the last ``n_masked`` masked, and placeholder rows)."""
        if LISTED:
            n_full, full_row, n_part, part_row = _table_row(tables, b, h, kb)
            n_whole = 2 * n_full
            n_all = n_whole + 2 * n_part
        else:
            full_row, part_row = tables[3], tables[3]  # (placeholders, never read)
            n_whole = n_qblocks - n_masked
            n_all = n_qblocks
        return n_whole, n_all, full_row, part_row

    @gluon.jit
    def _store_dkdv(dk, dv, out, b, h_kv, start_n, seq_k, WG: gl.constexpr, dtype: gl.constexpr):
        """This warpgroup's rows of dK and dV stored (dK is summed against Qs = Q·scale·log2 e:
        the log2 e is divided out). Keys past Nk are not stored."""
        _, DK, DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn = out
        half: gl.constexpr = dk.shape[0]
        head_dim: gl.constexpr = dk.shape[1]
        acc_layout: gl.constexpr = wgmma_layout(head_dim)
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
    def consumer(smem, out, blk, seqs, tables, flags, mask, score):
        """One warpgroup (``flags``: ``(WG, IS_CAUSAL, LISTED, HAS_SCORE)``): dK and dV of its
        64 keys, and its 64 columns of each step's dQ.

        ``smem``: the ring (Qs, dO, LSE, delta and their barriers), K/V and dS buffers with
        their barriers; ``out``: dQ's accumulator, dK and dV with their (batch, head, key)
        strides; ``blk``: the key block (``hopper_bwd._key_block``); ``seqs``: ``(Nq, Nk,
        scale, group)``; ``tables``, ``mask``, ``score``: the block tables and the mods
        (:func:`_table_row`, :func:`_mask_of`, :func:`_score_of`)."""
        ring, kv, ds = smem
        k_buf, v_buf, kv_ready = kv
        ds_bufs, ds_ready, ds_free, dq_bufs = ds
        b, h_kv, start_n, lo, n_masked, n_qblocks = blk
        seq_q, seq_k, sm_scale, group = seqs
        WG: gl.constexpr = flags[0]
        LISTED: gl.constexpr = flags[2]
        block_m: gl.constexpr = ring[0].shape[3]
        head_dim: gl.constexpr = ring[0].shape[4]
        half: gl.constexpr = k_buf.shape[2] // 2  # this warpgroup's keys
        dcols: gl.constexpr = head_dim // 2  # this warpgroup's dQ columns
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
        # what _step reads and writes: the ring; this warpgroup's K, V, dQ's K columns and key
        # positions; the dS exchange and dQ's staging buffer and accumulator
        mem = (ring, (k_mine, v_mine, k_cols, keys), (ds_bufs, ds_ready, ds_free, dq_buf, out[0]))
        where = (b, diag, seq_q, seq_k, sm_scale)
        mbarrier.wait(kv_ready, 0)
        t = 0  # steps so far: the ring's and the dS buffers' phases follow it
        for g in range(group):
            h = h_kv * group + g
            # the unmasked steps, then the masked ones: LISTED, the blocks this key block's
            # table row lists (full ones, then partial); else the query blocks from the last
            # down (programs of one head then reduce into the same dQ rows at about the same
            # time), the masked ones (the diagonal's, or every one of a key block that runs
            # past Nk) last
            kb = start_n // (2 * half)
            n_whole, n_all, full_row, part_row = _head_blocks(
                tables, b, h, kb, n_masked, n_qblocks, LISTED
            )
            for phase in gl.static_range(2):  # the unmasked steps, then the masked ones
                if phase == 0:
                    j0, j1, idx_row = 0, n_whole, full_row
                else:
                    j0, j1, idx_row = n_whole, n_all, part_row
                for j in range(j0, j1):
                    start_m = _query_start(j, j0, idx_row, lo, n_qblocks, block_m, LISTED)
                    dk, dv = _step(
                        t, start_m, h, dk, dv, mem, where, flags, phase == 1, mask, score
                    )
                    t += 1
        tma.store_wait(pendings=0)
        _store_dkdv(dk, dv, out, b, h_kv, start_n, seq_k, WG, k_buf.dtype)
