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
    def _step(
        t,
        start_m,
        h,
        dk,
        dv,
        qs_bufs,
        do_bufs,
        lse_bufs,
        delta_bufs,
        k_mine,
        v_mine,
        k_cols,
        ds_bufs,
        dq_buf,
        q_ready,
        do_ready,
        empty,
        ds_ready,
        ds_free,
        dq_desc,
        b,
        keys,
        diag,
        seq_q,
        seq_k,
        sm_scale,
        MB0,
        MB1,
        MB2,
        MB3,
        SB0,
        SB1,
        SB2,
        SB3,
        WG: gl.constexpr,
        MASKED: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        LISTED: gl.constexpr,
        MASK_MOD: gl.constexpr,
        N_MASK_BUF: gl.constexpr,
        SCORE_MOD: gl.constexpr,
        SCORE_GRAD: gl.constexpr,
        N_SCORE_BUF: gl.constexpr,
        HAS_SCORE: gl.constexpr,
    ):
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
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
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
            st_tok = warpgroup_mma(
                k_mine, qs.permute((1, 0)), s_zero - gl.expand_dims(lse2, 0), is_async=True
            )
        mbarrier.wait(do_ready.index(slot), phase)
        delta = delta_bufs.index(slot).load(stat_l)
        dpt_tok = warpgroup_mma(
            v_mine, do.permute((1, 0)), s_zero - gl.expand_dims(delta, 0), is_async=True
        )
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
            dpt = dpt * apply_score(
                SCORE_GRAD, xt, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF
            )
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
        dq_tok = warpgroup_mma(
            ds_all.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
        )
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
    def consumer(
        qs_bufs,
        do_bufs,
        lse_bufs,
        delta_bufs,
        k_buf,
        v_buf,
        ds_bufs,
        dq_bufs,
        kv_ready,
        q_ready,
        do_ready,
        empty,
        ds_ready,
        ds_free,
        dq_desc,
        DK,
        DV,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        b,
        h_kv,
        group,
        start_n,
        lo,
        n_masked,
        n_qblocks,
        seq_q,
        seq_k,
        sm_scale,
        FULL_NUM,
        FULL_IDX,
        Q_NUM,
        Q_IDX,
        stride_tb,
        stride_th,
        stride_tn,
        stride_ib,
        stride_ih,
        stride_in,
        MB0,
        MB1,
        MB2,
        MB3,
        SB0,
        SB1,
        SB2,
        SB3,
        WG: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        LISTED: gl.constexpr,
        MASK_MOD: gl.constexpr,
        N_MASK_BUF: gl.constexpr,
        SCORE_MOD: gl.constexpr,
        SCORE_GRAD: gl.constexpr,
        N_SCORE_BUF: gl.constexpr,
        HAS_SCORE: gl.constexpr,
    ):
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
                    FULL_NUM,
                    FULL_IDX,
                    Q_NUM,
                    Q_IDX,
                    b,
                    h,
                    start_n // (2 * half),
                    stride_tb,
                    stride_th,
                    stride_tn,
                    stride_ib,
                    stride_ih,
                    stride_in,
                )
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
                    dk, dv = _step(
                        t,
                        start_m,
                        h,
                        dk,
                        dv,
                        qs_bufs,
                        do_bufs,
                        lse_bufs,
                        delta_bufs,
                        k_mine,
                        v_mine,
                        k_cols,
                        ds_bufs,
                        dq_buf,
                        q_ready,
                        do_ready,
                        empty,
                        ds_ready,
                        ds_free,
                        dq_desc,
                        b,
                        keys,
                        diag,
                        seq_q,
                        seq_k,
                        sm_scale,
                        MB0,
                        MB1,
                        MB2,
                        MB3,
                        SB0,
                        SB1,
                        SB2,
                        SB3,
                        WG,
                        phase == 1,
                        IS_CAUSAL,
                        LISTED,
                        MASK_MOD,
                        N_MASK_BUF,
                        SCORE_MOD,
                        SCORE_GRAD,
                        N_SCORE_BUF,
                        HAS_SCORE,
                    )
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
