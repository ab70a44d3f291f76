"""The partitions of the Hopper attention forward (:mod:`flashlite.kernels.attention.hopper`):
the load warp (:func:`producer`) and the consumer warpgroups' online softmax (:func:`consumer`),
with the tile folding they share. Gluon's imports live here too: :data:`GLUON_IMPORT_ERROR` says
why this Triton cannot run them (``None`` when it can)."""

from __future__ import annotations

from flashlite.masking.mods import apply_mask, apply_score
from flashlite.stats import LN2, LOG2E

try:  # Gluon is experimental: absent or different in some Triton versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_IMPORT_ERROR: str | None = None
except Exception as err:  # noqa: BLE001 - any failure means: not available
    GLUON_IMPORT_ERROR = f"{type(err).__name__}: {err}"


if GLUON_IMPORT_ERROR is None:
    from flashlite.stats_gluon import finalize_lse, online_update

    # Triton 3.7+ names the TMA copies async_load / async_store (3.6: async_copy_*)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.constexpr_function
    def wgmma_layout(n):  # noqa: ANN001, ANN202
        """The register layout of a warpgroup's ``[64, n]`` wgmma accumulator (4 warps)."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16]
        )

    @gluon.jit
    def _online_update(
        s,
        m,
        l_sum,
        start_n,
        rows,
        cols,
        seq_q,
        seq_k,
        MASK: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        UNITS: gl.constexpr = 1.0,
        shift=0.0,
        SHIFTED: gl.constexpr = False,
    ):
        """Fold the ``[R, BLOCK_N]`` score tile ``s`` (``s·UNITS`` in exp2 units: ``UNITS`` is
        1, or ``log2 e`` for a score function's natural units) into ``(m, l_sum)`` (exp2
        units): ``(p, alpha, m, l_sum)`` of :func:`flashlite.stats_gluon.online_update`.
        ``MASK``: keys past ``seq_k`` (and, causal, past each row's diagonal) get −inf first.
        ``SHIFTED``: the tile's scores are ``s + shift`` (``shift``: one per row), the shift
        taken into each row's maximum and reference, not added to every score."""
        if MASK:
            key = gl.expand_dims(start_n + cols, 0)
            seen = key < seq_k
            if IS_CAUSAL:  # bottom-right aligned, as flashlite.masks.visible
                seen = seen & (key <= gl.expand_dims(rows, 1) + (seq_k - seq_q))
            s = gl.where(seen, s, float("-inf"))
        m, l_sum, alpha, p = online_update(m, l_sum, s, UNITS, shift, SHIFTED)
        return p, alpha, m, l_sum

    @gluon.jit
    def _fold(s, m, l_sum, t, tiles, rows, cols, prog, sizes, bufs, slope2, flags, mods):
        """:func:`_online_update` of tile ``t``; the first ``n_full`` tiles are seen whole, later
        ones masked. Without ``LISTED`` the tile's keys start at ``t·BLOCK_N`` and the mask is
        ``seq_k`` and the causal diagonal. ``LISTED`` (tiles from block tables): the first key
        is read from the tables (:func:`_tile_start`) only where a mod needs it — reading it
        ahead for every tile measured slower — and ``mask_mod`` masks; a score function sees
        the scores first, in natural units (``s·ln 2``: Q carries ``log2 e``), and its
        result stays in them (:func:`_online_update` takes the units). ``ALIBI`` (a score
        function that declares the head-linear bias, as ALiBi does): the bias
        ``slope·(kv − q)``, in exp2 units ``slope2·(kv − q)``, is split at the tile's first key
        ``k0`` into a column term ``slope2·(kv − k0)`` (the same every tile: one add a score)
        and a row term ``slope2·(k0 − q)`` that shifts each row's maximum and reference; both
        stay small where the weights are, as ``slope·(kv − q)`` itself does. The tuples are
        :func:`consumer`'s."""
        IS_CAUSAL: gl.constexpr = flags[0]
        LISTED: gl.constexpr = flags[2]
        HAS_SCORE: gl.constexpr = flags[3]
        ALIBI: gl.constexpr = flags[4]
        MASK_MOD: gl.constexpr = mods[0]
        N_MASK_BUF: gl.constexpr = mods[1]
        SCORE_MOD: gl.constexpr = mods[2]
        N_SCORE_BUF: gl.constexpr = mods[3]
        n_tiles, n_full, full_row, part_row = tiles
        b, h, pid_bh, start_m = prog
        seq_q, seq_k, qk_scale = sizes
        MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3 = bufs
        block_n: gl.constexpr = s.shape[1]
        start_n = t * block_n
        shift = 0.0
        if LISTED:
            if ALIBI:
                first = _tile_start(t, n_full, full_row, part_row, block_n, True)
                shift = slope2 * (first - rows).to(gl.float32)
                s = s + gl.expand_dims(slope2 * cols.to(gl.float32), 0)
            elif HAS_SCORE:
                first = _tile_start(t, n_full, full_row, part_row, block_n, True)
                q_idx = gl.expand_dims(gl.minimum(rows, seq_q - 1), 1)
                kv_idx = gl.expand_dims(gl.minimum(first + cols, seq_k - 1), 0)
                s = apply_score(
                    SCORE_MOD, s * LN2, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF
                )
            if t >= n_full:
                first = _tile_start(t, n_full, full_row, part_row, block_n, True)
                q_idx = gl.expand_dims(gl.minimum(rows, seq_q - 1), 1)
                keys = gl.expand_dims(first + cols, 0)
                # clamped: a mod may gather by key (not named kv_idx: reusing the score's name
                # would make this runtime `if` yield it, keeping the score's kv_idx alive)
                kv_seen = gl.minimum(keys, seq_k - 1)
                seen = apply_mask(MASK_MOD, b, h, q_idx, kv_seen, MB0, MB1, MB2, MB3, N_MASK_BUF)
                s = gl.where(seen & (keys < seq_k), s, float("-inf"))
            units: gl.constexpr = LOG2E if HAS_SCORE and not ALIBI else 1.0
            p, alpha, m, l_sum = _online_update(
                s,
                m,
                l_sum,
                start_n,
                rows,
                cols,
                seq_q,
                seq_k,
                False,
                IS_CAUSAL,
                units,
                shift,
                ALIBI,
            )
        elif t >= n_full:
            p, alpha, m, l_sum = _online_update(
                s, m, l_sum, start_n, rows, cols, seq_q, seq_k, True, IS_CAUSAL
            )
        else:
            p, alpha, m, l_sum = _online_update(
                s, m, l_sum, start_n, rows, cols, seq_q, seq_k, False, IS_CAUSAL
            )
        return p, alpha, m, l_sum

    @gluon.jit
    def _tile_start(t, n_full, full_row, part_row, block_n: gl.constexpr, LISTED: gl.constexpr):
        """The first key of tile ``t``: ``t·block_n``, or (``LISTED``) of the ``t``-th block the
        tables list, full blocks first."""
        if LISTED:
            if t < n_full:
                block = gl.load(full_row + t)
            else:
                block = gl.load(part_row + (t - n_full))
            start = block * block_n
        else:
            start = t * block_n
        return start

    @gluon.jit
    def producer(descs, ring, prog, tiles, LISTED: gl.constexpr):
        """The load warp: both halves of Q, then K and V tile by tile (:func:`_tile_start`)
        into the ring, each slot reused once both consumers have released the tile before.
        ``descs``: the Q, K, V descriptors; ``prog``: ``(b, h, h_kv, start_m)``; ``ring`` and
        ``tiles`` as :func:`consumer`'s."""
        q_desc, k_desc, v_desc = descs
        q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, empty = ring
        b, h, h_kv, start_m = prog
        n_tiles, n_full, full_row, part_row = tiles
        half: gl.constexpr = q_bufs.shape[3]
        block_n: gl.constexpr = k_bufs.shape[3]
        stages: gl.constexpr = k_bufs.shape[0]
        for i in gl.static_range(2):
            mbarrier.expect(q_ready.index(i), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, start_m + i * half, 0], q_ready.index(i), q_bufs.index(i))
        for t in range(n_tiles):
            slot = t % stages
            if t >= stages:
                mbarrier.wait(empty.index(slot), ((t // stages) - 1) & 1)
            start_n = _tile_start(t, n_full, full_row, part_row, block_n, LISTED)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, h_kv, start_n, 0], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, h_kv, start_n, 0], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def consumer(ring, io, prog, tiles, sizes, bufs, WG: gl.constexpr, flags, mods):
        """One warpgroup: the online softmax of its 64-row half (:func:`_attend`); writes its O
        rows (TMA) and LSE. ``HAS_SINKS``: the rows start from the sink's state ``(SINKS[h],
        1)``. The kernel's arguments, grouped: ``ring`` ``(q_bufs, k_bufs, v_bufs, q_ready,
        k_ready, v_ready, empty)``, ``io`` ``(o_desc, LSE, SINKS)``, ``prog`` ``(b, h, pid_bh,
        start_m)``, ``tiles`` ``(n_tiles, n_full, full_row, part_row)``, ``sizes`` ``(seq_q,
        seq_k, qk_scale)``, ``bufs`` the mods' eight buffer slots, and the constexprs ``flags``
        ``(IS_CAUSAL, HAS_SINKS, LISTED, HAS_SCORE, ALIBI)`` and ``mods`` ``(MASK_MOD,
        N_MASK_BUF, SCORE_MOD, N_SCORE_BUF)`` (tuples written out where the kernel passes them:
        a tuple assigned to a name would turn its constexprs into tensors)."""
        q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, empty = ring
        o_desc, LSE, SINKS = io
        b, h, pid_bh, start_m = prog
        seq_q, seq_k, qk_scale = sizes
        HAS_SINKS: gl.constexpr = flags[1]
        half: gl.constexpr = q_bufs.shape[3]
        head_dim: gl.constexpr = q_bufs.shape[4]
        block_n: gl.constexpr = k_bufs.shape[3]
        dtype: gl.constexpr = o_desc.dtype
        # wgmma register layouts: the scores [half, block_n] and the output [half, head_dim];
        # Q enters the products from registers as the A operand
        s_layout: gl.constexpr = wgmma_layout(block_n)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, wgmma_layout(head_dim))

        row0 = start_m + WG * half
        q_buf = q_bufs.index(WG)
        mbarrier.wait(q_ready.index(WG), 0)
        q = q_buf.reshape([half, head_dim]).load(q_layout)
        q = (q.to(gl.float32) * qk_scale).to(dtype)  # scores in exp2 units (PRESCALE_Q)
        rows = row0 + gl.arange(0, half, layout=row_s)
        cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, s_layout))
        m = gl.full([half], float("-inf"), gl.float32, layout=row_s)
        l_sum = gl.zeros([half], gl.float32, layout=row_s)
        if HAS_SINKS:  # the sink's state in exp2 units (the scores' own, Q being prescaled)
            m = gl.full([half], 1.0, gl.float32, layout=row_s) * (gl.load(SINKS + h) * LOG2E)
            l_sum = gl.full([half], 1.0, gl.float32, layout=row_s)
        out, m, l_sum = _attend(
            q, m, l_sum, rows, cols, ring, prog, tiles, sizes, bufs, flags, mods
        )

        # natural-log LSE (the pair is in exp2 units: the scale is folded into Q); rows that
        # saw no key keep s = 0: output 0 and LSE −inf; a score of +inf gives +inf
        lse = finalize_lse(m, l_sum, 1.0)
        gl.store(LSE + pid_bh.to(gl.int64) * seq_q + rows, lse, mask=rows < seq_q)
        l_o = gl.convert_layout(l_sum, row_o)
        o = (out * gl.expand_dims(gl.where(l_o > 0.0, 1.0 / l_o, 0.0), 1)).to(dtype)
        q_buf.reshape([half, head_dim]).store(o)  # Q is in registers: its buffer stages O
        fence_async_shared()
        _tma_store(o_desc, [b, h, row0, 0], q_buf)  # rows past N are clipped
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attend(q, m, l_sum, rows, cols, ring, prog, tiles, sizes, bufs, flags, mods):
        """The key tiles of one warpgroup: ``(out, m, l_sum)``, the unnormalised ``[half,
        head_dim]`` output and the rows' pair, from the prescaled Q ``[half, head_dim]`` (its
        A operand) and the pair it starts from. Tile j+1's scores ``Q·Kᵀ`` and tile j's ``P·V``
        are issued together; tile j+1's softmax (:func:`_fold`) overlaps ``P·V``. The
        arguments are :func:`consumer`'s."""
        q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, empty = ring
        n_tiles, n_full, full_row, part_row = tiles
        b, h, pid_bh, start_m = prog
        ALIBI: gl.constexpr = flags[4]
        half: gl.constexpr = q.shape[0]
        head_dim: gl.constexpr = q.shape[1]
        block_n: gl.constexpr = k_bufs.shape[3]
        stages: gl.constexpr = k_bufs.shape[0]
        dtype: gl.constexpr = q.dtype
        # P enters the product with V from registers as the A operand
        s_layout: gl.constexpr = wgmma_layout(block_n)
        o_layout: gl.constexpr = wgmma_layout(head_dim)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        s_zero = gl.zeros([half, block_n], gl.float32, layout=s_layout)
        out = gl.zeros([half, head_dim], gl.float32, layout=o_layout)
        if ALIBI:  # the slope (in SB0, the fifth slot) in exp2 units (see _fold)
            slope2 = gl.load(bufs[4] + h) * LOG2E
        else:
            slope2 = 0.0
        if n_tiles > 0:
            k0 = k_bufs.index(0).reshape([block_n, head_dim]).permute((1, 0))
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma_wait(
                0, deps=[warpgroup_mma(q, k0, s_zero, use_acc=False, is_async=True)]
            )
            p, alpha, m, l_sum = _fold(
                s, m, l_sum, 0, tiles, rows, cols, prog, sizes, bufs, slope2, flags, mods
            )
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = out
            for j in range(0, n_tiles - 1):
                slot = j % stages
                nxt = (j + 1) % stages
                kt = k_bufs.index(nxt).reshape([block_n, head_dim]).permute((1, 0))
                mbarrier.wait(k_ready.index(nxt), ((j + 1) // stages) & 1)
                s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
                vt = v_bufs.index(slot).reshape([block_n, head_dim])
                mbarrier.wait(v_ready.index(slot), (j // stages) & 1)
                acc_tok = warpgroup_mma(p_op, vt, acc, is_async=True)
                # tile j+1's scores are ready (p·v may still run): its softmax overlaps p·v
                s = warpgroup_mma_wait(1, deps=[s_tok])
                p, alpha, m, l_sum = _fold(
                    s, m, l_sum, j + 1, tiles, rows, cols, prog, sizes, bufs, slope2, flags, mods
                )
                acc = warpgroup_mma_wait(0, deps=[acc_tok])
                mbarrier.arrive(empty.index(slot), count=1)  # this warpgroup is done with tile j
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            slot = (n_tiles - 1) % stages
            vt = v_bufs.index(slot).reshape([block_n, head_dim])
            mbarrier.wait(v_ready.index(slot), ((n_tiles - 1) // stages) & 1)
            out = warpgroup_mma_wait(0, deps=[warpgroup_mma(p_op, vt, acc, is_async=True)])
            mbarrier.arrive(empty.index(slot), count=1)
        return out, m, l_sum
