"""The load side of the fused Hopper attention backward
(:mod:`flashlite.kernels.attention.hopper_bwd`): the load warp (:func:`producer`) and the block
tables' rows it and the consumers walk (:func:`table_row`, :func:`query_start`). Gluon's imports
live here too, and the TMA and barrier names of this Triton: :data:`GLUON_BWD_ERROR` says why it
cannot build the kernel (``None`` when it can)."""

from __future__ import annotations

from flashlite.kernels.attention.hopper_parts import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from flashlite.stats_gluon import lse_log2


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

if GLUON_BWD_ERROR is None:
    # the consumers' names for this Triton's barrier and TMA reduce-add
    thread_barrier = _thread_barrier
    tma_add = _tma_add

    @gluon.jit
    def _table_row(tables, b, h, kb):
        """Key block ``kb``'s row of the ``q_*`` tables for query head ``h``: how many full query
        blocks and where their indices start, then the same of the partial ones. ``tables``:
        ``(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, strides)``, the strides over (batch, head,
        key block) of the counts, then of the indices."""
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, strides = tables
        stb, sth, stn, sib, sih, sin = strides
        trow = b * stb + h * sth + kb * stn
        irow = b.to(gl.int64) * sib + h * sih + kb * sin
        n_full = gl.load(FULL_NUM + trow)
        n_part = gl.load(PART_NUM + trow)
        return n_full, FULL_IDX + irow, n_part, PART_IDX + irow

    @gluon.jit
    def _listed_start(j, idx_row, block_m: gl.constexpr):
        """The first query row of step ``j`` over a table row's blocks: a table block is two
        steps (``2·block_m`` queries)."""
        return gl.load(idx_row + j // 2) * (2 * block_m) + (j % 2) * block_m

    @gluon.jit
    def _query_start(j, first, idx_row, lo, n_qblocks, block_m: gl.constexpr, LISTED: gl.constexpr):
        """The first query row of the consumers' step ``j``: ``LISTED``, of step ``j − first``
        over the table row ``idx_row`` (:func:`_listed_start`); else of the ``j``-th query
        block from the last (of ``n_qblocks`` from ``lo``)."""
        if LISTED:
            start = _listed_start(j - first, idx_row, block_m)
        else:
            start = lo + (n_qblocks - 1 - j) * block_m
        return start

    @gluon.jit
    def _load_step(slot, start_m, h, loads, ring, b, n_heads, seq_q, offs):
        """Ring slot ``slot`` filled with the query tile at ``start_m`` of head ``h``: its rows'
        LSE (exp2 units) and delta through registers, Qs and dO by TMA. ``loads``: as the
        producer's; ``offs``: ``arange(block_m)``."""
        qs_desc, do_desc, _, _, LSE, DELTA = loads
        qs_bufs, do_bufs, lse_bufs, delta_bufs, q_ready, do_ready, _ = ring
        rows = start_m + offs
        at = (b * n_heads + h).to(gl.int64) * seq_q + rows
        lse = gl.load(LSE + at, mask=rows < seq_q, other=float("-inf"))
        lse_bufs.index(slot).store(lse_log2(lse))
        delta_bufs.index(slot).store(gl.load(DELTA + at, mask=rows < seq_q, other=0.0))
        mbarrier.expect(q_ready.index(slot), qs_desc.block_type.nbytes)
        _tma_load(qs_desc, [b, h, start_m, 0], q_ready.index(slot), qs_bufs.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        _tma_load(do_desc, [b, h, start_m, 0], do_ready.index(slot), do_bufs.index(slot))

    @gluon.jit
    def producer(loads, smem, blk, sizes, tables, LISTED: gl.constexpr):
        """The load warp: K and V once, then step by step into the ring: Qs and dO (TMA), and
        their rows' statistics (through registers: LSE in exp2 units, +inf for rows past Nq or
        that saw no key, so that their P is 0; delta). The steps are the consumers': per head
        of the group, the query blocks from the last down, or (``LISTED``) the blocks the
        tables list, full ones first.

        ``loads``: the Qs, dO, K and V descriptors, the LSE and delta; ``smem``: the ring, K/V
        and dS buffers with their barriers; ``blk``: the key block (``hopper_bwd._key_block``);
        ``sizes``: ``(Hq, group, Nq)``; ``tables``: see :func:`_table_row`."""
        _, _, k_desc, v_desc, _, _ = loads
        ring, kv, _ = smem
        k_buf, v_buf, kv_ready = kv
        b, h_kv, start_n, lo, _, n_qblocks = blk
        n_heads, group, seq_q = sizes
        empty = ring[6]  # the slots' "free" barriers
        block_m: gl.constexpr = ring[0].shape[3]
        block_n: gl.constexpr = k_buf.shape[2]
        stages: gl.constexpr = ring[0].shape[0]
        stat_l: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        offs = gl.arange(0, block_m, layout=stat_l)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [b, h_kv, start_n, 0], kv_ready, k_buf)
        _tma_load(v_desc, [b, h_kv, start_n, 0], kv_ready, v_buf)
        t = 0
        for g in range(group):
            h = h_kv * group + g
            if LISTED:
                n_full, full_row, n_part, part_row = _table_row(tables, b, h, start_n // block_n)
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
                _load_step(slot, start_m, h, loads, ring, b, n_heads, seq_q, offs)
                t += 1

    table_row = _table_row
    query_start = _query_start
