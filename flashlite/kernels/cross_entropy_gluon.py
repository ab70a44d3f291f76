"""Fused cross-entropy forward for long rows in Gluon: the prefetching team of
:mod:`flashlite.kernels.softmax_gluon`, writing the gradient instead of the softmax.

The Triton kernel (:mod:`flashlite.kernels.cross_entropy`) reads a row longer than 8192 logits
twice: once for the statistics, once (mostly from L2) for the gradient, and ran at 0.62–0.73×
the copy ceiling on the H200. Here a team of programs shares each row, every program keeping
its chunk in shared memory, so the logits are read from memory once:

* step ``i`` loads row ``i``'s chunk from shared memory, publishes its ``(m, s)`` word (and,
  with label smoothing, a second word holding ``Σ x`` of the chunk), as the softmax kernel;
* then it gathers row ``i − 1``'s words, forms ``lse = m + ln s``, and writes the chunk's
  gradient ``(p·(1 + 2z·lse) − ε/V − (1 − ε)·[j = t])·scale`` over the logits or into ``G``
  (each chunk is read into shared memory before the same program writes its gradient, so ``G``
  may be ``X``);
* the program whose chunk holds the target (chunk 0 when the target is ignored or out of range)
  writes the row's loss and LSE, as the Triton kernel defines them, and the target's gradient
  as a scalar after the chunk's vector store: ``[j = t]`` compared on every column kept the
  column indices live (232 registers a thread against 96) and cost 12% of the time.

An eager call runs the whole forward in this one launch (``COUNT``, ``CHECK``, ``REDUCE``): every
program first counts the kept targets of its share of the rows into one grid-wide word (and
records a bad target), waits for all programs' counts (the grid is resident) and takes the
mean's ``1/Σ``; the last program to finish sums the losses in a fixed order (times the
gradient scale for a mean). A traced call (the custom op), a call that checked its targets with
a host sync and linear cross-entropy pass the gradient scale in ``GSCALE`` instead.

Per logit the gradient pass costs a shared-memory load, one fused exponent (16-bit logits) and
one multiply: rows that end on a chunk boundary skip the column masks (``EVEN``), and the
gradient's scale is folded into the row's constants. On the H200 that took the forward from
0.85–0.89× to 0.90–0.92× the copy ceiling, which is where a variant of this kernel that only
moves the data (the same copies, loads and stores, no arithmetic, no exchange) runs too
(``benchmarks/NOTES.md``, Cross-entropy): the data path, not the arithmetic or the team's
exchange, is what is left. Rows are dealt to the teams statically, and the teams finish up to
8% of the kernel's time apart; teams that claim their rows from a counter finish together but
were not reliably faster (same notes).

Plain rows only: class weights and soft caps take the Triton kernel. Same layout rules as the
softmax kernel: 16-byte copies, so row lengths and strides in multiples of 16 bytes.
"""

from __future__ import annotations

from flashlite.kernels.softmax_gluon import GLUON_IMPORT_ERROR
from flashlite.stats import LOG2E

#: Shortest rows (logits) this kernel takes; shorter ones keep the Triton kernel. H200, bf16,
#: forward alone, × copy: 16k 0.86 against the Triton kernel's 0.77, 32k 0.88 against 0.73;
#: 128k 0.89; 256k 0.86 (``benchmarks/NOTES.md``, Cross-entropy).
MIN_COLS = 16384

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from flashlite.kernels.softmax_gluon import (
        _await_words,
        _chunk,
        _chunk_pair,
        _gather,
        _prefetch,
        _publish,
        _team_setup,
    )
    from flashlite.stats_gluon import finalize_lse, probs_from_pair

    # a CTA-wide barrier, which also orders the block's global loads and stores (Triton 3.6's
    # name; later versions call it barrier)
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _gather_sum(row_ptr, c, n_chunks):
        """``Σ x`` of a row from its team's second words (low half, high half 0), once all are
        published."""
        got = c < n_chunks
        w = _await_words(row_ptr + 2 * c + 1, got)
        part = (w & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)
        return gl.sum(gl.where(got, part, 0.0), axis=0)

    @gluon.jit
    def _targets_share(
        T,
        SEEN,
        BAD,
        n_rows,
        n_cols,
        ignore_index,
        CHECK: gl.constexpr,
        BLOCK: gl.constexpr,
        layout: gl.constexpr,
    ):
        """This program's share of the targets (blocks ``pid, pid + programs, …``): how many are
        kept (not ``ignore_index``), and with ``CHECK`` the first one outside ``[0, V)`` that
        is not ``ignore_index`` recorded in ``BAD = (flag, class, V)`` unless one is already,
        and ``SEEN[0]`` set to 1 (the host's pinned memory: read there without a copy)."""
        pid = gl.program_id(0)
        kept = pid * 0
        for start in range(pid * BLOCK, n_rows, gl.num_programs(0) * BLOCK):
            rows = start + gl.arange(0, BLOCK, layout=layout)
            inside = rows < n_rows
            t = gl.load(T + rows, mask=inside, other=0).to(gl.int64)
            keep = inside & (t != ignore_index)
            kept += gl.sum(keep.to(gl.int32), axis=0)
            if CHECK:
                bad = keep & ((t < 0) | (t >= n_cols))
                first = gl.min(gl.where(bad, rows, n_rows), axis=0)
                if first < n_rows:  # (the exchange only where there is a bad target)
                    none = first.to(gl.int64) * 0  # (the exchange's operands: the flag's type)
                    if gl.atomic_cas(BAD, none, none + 1) == 0:  # the first report stands
                        gl.store(BAD + 1, gl.load(T + first).to(gl.int64))
                        gl.store(BAD + 2, n_cols.to(gl.int64))
                        gl.store(SEEN, none + 1)
        return kept

    @gluon.jit
    def _mean_scale(ctrl, kept):
        """``1/Σ`` over the kept targets of every program (NaN for none, as torch's 0/0): each
        adds ``2³² + kept`` to the word at ``ctrl`` (−1 to start), so the word's high half counts
        the programs in and its low half their targets; then each spins until all are in (the
        grid is resident: a cooperative launch)."""
        gl.atomic_add(ctrl, (1 << 32) + kept.to(gl.int64), sem="relaxed", scope="gpu")
        w = gl.load(ctrl, volatile=True)
        while (w + 1) >> 32 < gl.num_programs(0):
            w = gl.load(ctrl, volatile=True)
        total = ((w + 1) & 0xFFFFFFFF).to(gl.float32)
        return gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), float("nan"))

    @gluon.jit
    def _reduce_losses(
        LOSS,
        OUT,
        ctrl,
        n_rows,
        g_scale,
        SCALED: gl.constexpr,
        BLOCK: gl.constexpr,
        layout: gl.constexpr,
    ):
        """The last program to finish (a count at ``ctrl``, −1 to start) sums the ``(N,)``
        losses in a fixed order (the same total every run) into ``OUT[0]``, times ``g_scale``
        with ``SCALED`` (a mean)."""
        _thread_barrier()  # every thread's loss stores come before the count below
        done = gl.atomic_add(ctrl, 1, sem="acq_rel", scope="gpu")
        if done == gl.num_programs(0) - 2:
            _thread_barrier()
            acc = gl.zeros([BLOCK], gl.float32, layout)
            for start in range(0, n_rows, BLOCK):
                rows = start + gl.arange(0, BLOCK, layout=layout)
                acc += gl.load(LOSS + rows, mask=rows < n_rows, other=0.0)
            total = gl.sum(acc, axis=0)
            if SCALED:
                total = total * g_scale
            gl.store(OUT, total)

    @gluon.jit
    def _publish_chunk(words, x, m, s, in_row, EVEN: gl.constexpr, SMOOTH: gl.constexpr):
        """Publish this chunk's words of a row at ``words``: its ``(m, s)`` pair and, with
        ``SMOOTH``, ``Σ x`` of the chunk in the next word (high half 0, so the word is its own
        flag)."""
        if SMOOTH:
            if EVEN:
                sx = gl.sum(x, axis=0)
            else:
                sx = gl.sum(gl.where(in_row, x, 0.0), axis=0)
            sx_word = sx.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
            gl.atomic_xchg(words + 1, sx_word, sem="relaxed", scope="gpu")
        _publish(words, m, s)

    @gluon.jit
    def _finish_row(
        data,
        W,
        slots,
        i,
        row,
        target,
        place,
        opts,
        layout: gl.constexpr,
        EVEN: gl.constexpr,
        FMA: gl.constexpr,
        SMOOTH: gl.constexpr,
        CHUNK: gl.constexpr,
    ):
        """Row ``row``, the team's row ``i − 1`` (its chunk in slot ``(i − 1) % STAGES`` of
        ``slots``), once its team's words in ``W`` are all published: this chunk's gradient,
        and where the target is, the row's loss, LSE and the target's gradient. ``data = (X, G,
        LOSS, LSE, stride_xm, stride_gm)``: the tensors and the logits' and gradient's row
        strides; ``place = (chunk, c, n_chunks, cols, in_row)``, this program's place in its
        team (:func:`_team_setup`); ``opts = (ignore_index, n_cols, inv_v, smoothing, z_loss,
        g_scale)``."""
        WORDS: gl.constexpr = 2 if SMOOTH else 1  # (the kernel's: words per (row, chunk))
        X, G, LOSS, LSE, stride_xm, stride_gm = data
        chunk, c, n_chunks, cols, in_row = place
        ignore_index, n_cols, inv_v, smoothing, z_loss, g_scale = opts
        row_words = W + row * n_chunks * WORDS
        m_row, s_row = _gather(row_words, c, n_chunks, WORDS)
        lse = finalize_lse(m_row, s_row, LOG2E)  # (+inf for a row holding +inf)
        ignored = target == ignore_index
        in_range = (target >= 0) & (target < n_cols)
        t_col = gl.where(in_range, target, 0).to(gl.int32)
        # ignored rows: zero gradient (not 0·scale: a mean over no target has an
        # infinite scale); a target outside [0, V): NaN, like its loss
        scale = gl.where(ignored, 0.0, gl.where(in_range, g_scale, float("nan")))
        # p = 2^((x − m)·log2 e)/s from the pair, not e^(x − lse): the LSE rounded to
        # fp32 is off by up to 5e-4 at |x| ≈ 1e4 (flashlite.stats.probs_from_pair)
        coef = 1.0 + 2.0 * z_loss * lse
        # The program whose chunk holds the target (chunk 0 for none) writes the loss
        # and the target's gradient as scalars: comparing every column with the target
        # kept the column indices live and cost 12% of the kernel's time on the H200.
        owner = t_col // CHUNK == chunk
        # the target's logit, read before this chunk's gradient replaces it (G may be X)
        x_t = gl.load(X + row * stride_xm + t_col, mask=owner, other=0.0).to(gl.float32)
        if owner:
            _thread_barrier()
        x = _chunk(slots.index((i - 1) % slots.shape[0]), in_row, layout, EVEN)
        # (the scale folded into the row's constants: one multiply a logit)
        g = probs_from_pair(x, m_row, s_row, LOG2E, FMA, coef * scale)
        if SMOOTH:
            g -= smoothing * inv_v * scale
        if EVEN:
            gl.store(G + row * stride_gm + cols, g.to(G.dtype.element_ty))
        else:
            gl.store(G + row * stride_gm + cols, g.to(G.dtype.element_ty), mask=in_row)
        if owner:
            _thread_barrier()  # every thread's store lands before the target's below
            g_t = probs_from_pair(x_t, m_row, s_row, LOG2E, False, coef) - smoothing * inv_v
            g_t = (g_t - (1.0 - smoothing)) * scale
            gl.store(G + row * stride_gm + t_col, g_t.to(G.dtype.element_ty))
            # lse − x_t as (m − x_t) + ln s, exact where the rounded LSE is not
            gap = (m_row - x_t) + gl.log(s_row)
            loss = (1.0 - smoothing) * gap + z_loss * lse * lse
            if SMOOTH:
                sx_row = _gather_sum(row_words, c, n_chunks)
                loss += smoothing * inv_v * (lse * n_cols - sx_row)
            loss = gl.where(ignored, 0.0, gl.where(in_range, loss, float("nan")))
            gl.store(LOSS + row, loss)
            gl.store(LSE + row, lse)

    @gluon.jit
    def _cross_entropy_prefetch_kernel(
        X, T, GSCALE, G, LOSS, LSE, W, SEEN, BAD, OUT,
        n_rows, n_cols, n_vecs, xv_stride, gv_stride, n_chunks,
        ignore_index, smoothing, z_loss,
        n_teams,
        SMOOTH: gl.constexpr, COUNT: gl.constexpr, CHECK: gl.constexpr, REDUCE: gl.constexpr,
        EVEN: gl.constexpr, CHUNK: gl.constexpr, CHUNKS_PAD: gl.constexpr, STAGES: gl.constexpr,
        VEC: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):  # fmt: skip
        """Rows ``team, team + n_teams, …`` of the ``(N, V)`` logits ``X``: losses and LSE
        (fp32, ``(N,)``) and the gradient of a unit loss into ``G``, times ``GSCALE[0]``, or
        with ``COUNT`` times ``1/Σ`` over the kept targets, counted here. ``W`` holds
        ``WORDS = 1 + SMOOTH`` words per (row, chunk), then two control words, all −1 to start.
        ``CHECK``: bad targets recorded in ``BAD`` (and flagged in ``SEEN``); ``REDUCE`` 1: the
        losses' sum into ``OUT[0]``, 2: their mean (the sum times the gradient scale, ``1/Σ``),
        0: neither. So one launch serves an eager call's whole forward.
        ``EVEN``: the row length is a multiple of ``CHUNK`` (no column masks)."""
        WORDS: gl.constexpr = 2 if SMOOTH else 1
        # 16-bit logits: fused exponents (precise enough for a 16-bit gradient; fp32 keeps
        # subtract-first, flashlite.stats.probs_from_pair)
        FMA: gl.constexpr = X.dtype.element_ty != gl.float32
        TARGETS: gl.constexpr = 4 * 32 * NUM_WARPS  # targets per block of the count and the sum
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        part_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        stride_xm = xv_stride * VEC
        stride_gm = gv_stride * VEC
        slots, team, chunk, cols, in_row, n_mine, c = _team_setup(
            X,
            n_rows,
            n_vecs,
            stride_xm,
            n_chunks,
            n_teams,
            CHUNK,
            CHUNKS_PAD,
            STAGES,
            VEC,
            layout,
            part_layout,
        )
        ctrl = W + n_rows.to(gl.int64) * n_chunks * WORDS
        inv_v = 1.0 / n_cols
        if COUNT or CHECK:  # (while the first rows load)
            kept = _targets_share(
                T, SEEN, BAD, n_rows, n_cols, ignore_index, CHECK, TARGETS, part_layout
            )
        if COUNT:
            g_scale = _mean_scale(ctrl, kept)
        else:
            g_scale = gl.load(GSCALE)
        # (what _finish_row's tuples hold: its docstring)
        data = (X, G, LOSS, LSE, stride_xm, stride_gm)
        place = (chunk, c, n_chunks, cols, in_row)
        opts = (ignore_index, n_cols, inv_v, smoothing, z_loss, g_scale)
        for i in range(n_mine + 1):
            # row i - 1's target, loaded now so that its latency hides under row i's statistics
            prev = (team + (i - 1) * n_teams).to(gl.int64)
            target = gl.load(T + prev, mask=i > 0, other=0).to(gl.int64)
            if i < n_mine:  # row i: this chunk's words
                x, m, s = _chunk_pair(slots, i, in_row, layout, EVEN, FMA)
                row = (team + i * n_teams).to(gl.int64)
                words = W + (row * n_chunks + chunk) * WORDS
                _publish_chunk(words, x, m, s, in_row, EVEN, SMOOTH)
            if i > 0:  # row i - 1: gradient, and the loss where the target is
                _finish_row(
                    data, W, slots, i, prev, target, place, opts, layout, EVEN, FMA, SMOOTH, CHUNK
                )
            _prefetch(slots, i + STAGES - 1, X, team, n_teams, n_mine, stride_xm, cols, in_row)
        async_copy.wait_group(0)
        if REDUCE > 0:
            _reduce_losses(LOSS, OUT, ctrl + 1, n_rows, g_scale, REDUCE == 2, TARGETS, part_layout)
