"""Long-row softmax forward in Gluon: a persistent team that keeps its rows in shared memory.

The team kernel of :mod:`flashlite.kernels.softmax` reads a long row once: ``n_chunks``
co-resident programs each hold a chunk in registers, publish its ``(m, s)`` pair, wait for the
rest of the team and write. On the H200 it stayed at 0.65–0.84× the copy ceiling
(``benchmarks/NOTES.md``): while a program waits, nothing of its own is loading, and the wait
itself is long. This kernel removes both costs:

* **Rows go through shared memory.** Each program owns one chunk (16 KB) of every row its team
  handles and a ring of ``STAGES`` chunk-sized slots, filled by ``cp.async`` copies a few rows
  ahead. Every thread copies, reads and re-reads only its own elements, so the slots need no
  layout of their own and no barrier beyond the copy's own wait.
* **A row is written one step after its pair is published** (a relay): step ``i`` computes and
  publishes row ``i``'s pair, then merges and writes row ``i − 1``, whose team has had a whole
  step to publish theirs, reading the chunk again from shared memory; then the slot row
  ``i − 1`` left starts loading row ``i + STAGES − 1``.
* **The pair is its own flag.** ``(m, s)`` travel as one 64-bit word (``s`` in the high half),
  stored with a relaxed atomic exchange into a workspace that starts at −1; ``s`` is never
  negative (the sign bit of a NaN is cleared), so a reader spins until every word of the row is
  non-negative. No counter, no fence: one round trip to L2 per row, usually already satisfied.
  (Measured on the H200 against a per-row counter with *release* arrival and *acquire* spin:
  7–18% faster, probably because a release must first wait for the program's earlier stores.)

As for the team kernel, the spin needs every program of a team resident at once: the host
launches a cooperative grid sized from the compiled kernel (``_teams.launch_teams``).
Statistics are :mod:`flashlite.stats`'s pair (``m`` the maximum, ``s = Σ 2^((x − m)·log2 e)``);
Gluon cannot call ``@triton.jit`` helpers, so the kernel calls their Gluon twins in
:mod:`flashlite.stats_gluon` (``tile_stats``, ``merge_partials``). Each copy moves 16 bytes, so
rows need a length and a stride that are multiples of 16 bytes
(``ops.prefetch.prefetch_applies``). Runs on a CUDA sm_80+ device with Triton's Gluon (3.6
measured, on the H200); the interpreter cannot run Gluon, so the ``gpu`` tests cover the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from flashlite.stats import LOG2E

try:  # Gluon is experimental: absent or different in some Triton versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # the asynchronous row copy: ``async_load`` from Triton 3.9 (the older name raises there)
    _copy_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    GLUON_IMPORT_ERROR: str | None = None
except Exception as err:  # noqa: BLE001 - any failure means: not available
    GLUON_IMPORT_ERROR = f"{type(err).__name__}: {err}"


class PrefetchConfig(NamedTuple):
    """Columns per program, shared-memory slots per program, and warps."""

    chunk: int
    stages: int
    num_warps: int


def available() -> bool:
    """Whether this Triton has the Gluon pieces the kernel uses."""
    return GLUON_IMPORT_ERROR is None


if GLUON_IMPORT_ERROR is None:
    from flashlite.stats_gluon import merge_partials, tile_stats

    @gluon.jit
    def _publish(slot_ptr, m, s):
        """Store this chunk's pair as one 64-bit word, ``s`` in the high half: the word is the
        message and its own flag (the workspace starts at −1, and ``s`` is never negative: a
        sign bit of NaN is cleared), so no fence or counter is needed."""
        m_bits = m.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
        s_bits = (s.to(gl.int32, bitcast=True) & 0x7FFFFFFF).to(gl.int64)
        gl.atomic_xchg(slot_ptr, (s_bits << 32) | m_bits, sem="relaxed", scope="gpu")

    @gluon.jit
    def _await_words(ptrs, got):
        """The words at ``ptrs`` (lanes ``got``; 0 elsewhere), once every one of them has been
        published: non-negative (a spin: the team is resident, see the module notes)."""
        w = gl.load(ptrs, mask=got, other=0, volatile=True)
        while gl.min(w, axis=0) < 0:
            w = gl.load(ptrs, mask=got, other=0, volatile=True)
        return w

    @gluon.jit
    def _gather(row_ptr, c, n_chunks, STRIDE: gl.constexpr = 1):
        """The row's merged ``(m, s)`` from its team's words ``row_ptr[STRIDE·k]``."""
        got = c < n_chunks
        w = _await_words(row_ptr + STRIDE * c, got)
        m_part = gl.where(
            got, (w & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True), float("-inf")
        )
        s_part = gl.where(got, (w >> 32).to(gl.int32).to(gl.float32, bitcast=True), 0.0)
        return merge_partials(m_part, s_part, LOG2E)

    @gluon.jit
    def _chunk(slot, in_row, layout: gl.constexpr, EVEN: gl.constexpr = False):
        """This program's chunk of a row, from shared memory, fp32, −inf past the row
        (``EVEN``: the row ends on a chunk boundary, nothing to mask)."""
        if EVEN:
            return slot.load(layout).to(gl.float32)
        else:
            return gl.where(in_row, slot.load(layout).to(gl.float32), float("-inf"))

    @gluon.jit
    def _chunk_pair(
        slots,
        i,
        in_row,
        layout: gl.constexpr,
        EVEN: gl.constexpr = False,
        FMA: gl.constexpr = False,
    ):
        """Row ``i``'s chunk once its copy has landed, and the chunk's pair
        (:func:`flashlite.stats_gluon.tile_stats`: ``m``, and ``s`` against it, 0 when
        ``m = −inf``; ``FMA``: fused exponents, for 16-bit rows)."""
        async_copy.wait_group(slots.shape[0] - 2)  # (the later rows' copies may still fly)
        x = _chunk(slots.index(i % slots.shape[0]), in_row, layout, EVEN)
        m, s, _p = tile_stats(x, LOG2E, FMA)
        return x, m, s

    @gluon.jit
    def _prefetch(slots, i, X, team, n_teams, n_mine, stride_xm, cols, in_row):
        """Start copying row ``i`` of the team's rows into slot ``i % STAGES`` (nothing past
        the team's rows, but a group is committed all the same)."""
        row = (team + i * n_teams).to(gl.int64)
        _copy_async(
            slots.index(i % slots.shape[0]), X + row * stride_xm + cols, mask=in_row & (i < n_mine)
        )
        async_copy.commit_group()

    @gluon.jit
    def _team_setup(
        X,
        n_rows,
        n_vecs,
        stride_xm,
        n_chunks,
        n_teams,
        CHUNK: gl.constexpr,
        CHUNKS_PAD: gl.constexpr,
        STAGES: gl.constexpr,
        VEC: gl.constexpr,
        layout: gl.constexpr,
        part_layout: gl.constexpr,
    ):
        """This program's place in its team, the same in every prefetching kernel: its slots,
        team and chunk, its columns and which of them are in the row, how many rows the team
        has, the lanes the row's words are merged on; and the first ``STAGES − 1`` rows set
        loading."""
        slots = gl.allocate_shared_memory(
            X.dtype.element_ty, [STAGES, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        pid = gl.program_id(0)
        team = pid // n_chunks
        chunk = pid % n_chunks
        cols = chunk * CHUNK + gl.arange(0, CHUNK, layout=layout)
        in_row = cols // VEC < n_vecs
        n_mine = (n_rows - team + n_teams - 1) // n_teams
        c = gl.arange(0, CHUNKS_PAD, layout=part_layout)
        for i in gl.static_range(STAGES - 1):  # the first rows start loading
            _prefetch(slots, i, X, team, n_teams, n_mine, stride_xm, cols, in_row)
        return slots, team, chunk, cols, in_row, n_mine, c

    @gluon.jit
    def _softmax_prefetch_team_kernel(
        X,
        Y,
        W,
        n_rows,
        n_vecs,
        xv_stride,
        yv_stride,
        n_chunks,
        n_teams,
        LOG: gl.constexpr,
        CHUNK: gl.constexpr,
        CHUNKS_PAD: gl.constexpr,
        STAGES: gl.constexpr,
        VEC: gl.constexpr,
        NUM_WARPS: gl.constexpr,
    ):
        """Rows ``team, team + n_teams, …`` of ``X`` (columns contiguous) into ``Y``; this
        program owns columns ``[chunk·CHUNK, (chunk + 1)·CHUNK)`` of each and word ``chunk``
        of each row's ``n_chunks`` in ``W``. Row lengths and row strides come in vectors of
        ``VEC`` elements (16 bytes), so that the compiler knows every copy can move 16 bytes.

        Step ``i`` publishes row ``i``'s pair, then writes row ``i − 1``, whose team has had a
        whole step to publish, then starts loading row ``i + STAGES − 1`` into the slot row
        ``i − 1`` has left."""
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        part_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        stride_xm = xv_stride * VEC
        stride_ym = yv_stride * VEC
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
        for i in range(n_mine + 1):
            if i < n_mine:  # row i: this chunk's pair, published
                _x, m, s = _chunk_pair(slots, i, in_row, layout)
                row = (team + i * n_teams).to(gl.int64)
                _publish(W + row * n_chunks + chunk, m, s)
            if i > 0:  # row i - 1: the team's pairs merged, the chunk written
                row = (team + (i - 1) * n_teams).to(gl.int64)
                m_row, s_row = _gather(W + row * n_chunks, c, n_chunks)
                x = _chunk(slots.index((i - 1) % STAGES), in_row, layout)
                if LOG:
                    y = (x - m_row) - gl.log(s_row)
                else:
                    y = gl.exp2((x - m_row) * LOG2E) * (1.0 / s_row)
                gl.store(Y + row * stride_ym + cols, y.to(Y.dtype.element_ty), mask=in_row)
            _prefetch(slots, i + STAGES - 1, X, team, n_teams, n_mine, stride_xm, cols, in_row)
        async_copy.wait_group(0)  # no copy outlives the program


#: Bytes of a row each program owns, shared-memory slots and warps: 16 KB chunks, three slots,
#: four warps (H200 sweep, ``benchmarks/NOTES.md``: 0.89-0.95x the copy ceiling at 64k-256k).
CHUNK_BYTES = 16384
STAGES = 3
WARPS = 4
#: Most programs per team (the pairs of a row are merged in one vector of this many lanes).
MAX_CHUNKS = 64
#: Per element size, the longest rows (columns) the single-read kernel still runs faster
#: (H200: 16-bit rows of 16k 0.96x copy against 0.89x here, of 32k 0.81x against 0.90x;
#: fp32 rows of 32k 0.98x against 0.92x, of 64k 0.84x against 0.93x).
SINGLE_READ_WINS = {2: 16384, 4: 32768}


def prefetch_config(n_cols: int, elem_bytes: int, cfg: PrefetchConfig | None = None) -> dict:
    """Launch options for rows of ``n_cols`` values of ``elem_bytes`` bytes: ``CHUNK`` columns
    per program (a power of two), ``n_chunks`` programs per row. ``cfg`` (columns, slots,
    warps) overrides the defaults, for sweeps."""
    vec = 16 // elem_bytes
    if cfg is None:
        chunk, stages, warps = CHUNK_BYTES // elem_bytes, STAGES, WARPS
        # rows too long for MAX_CHUNKS programs: wider chunks, more warps (same per thread)
        while -(-n_cols // chunk) > MAX_CHUNKS and warps < 16:
            chunk, warps = 2 * chunk, 2 * warps
    else:
        chunk, stages, warps = cfg
    chunk = max(vec * 32 * warps, min(chunk, 1 << (n_cols - 1).bit_length()))
    n_chunks = -(-n_cols // chunk)
    return {
        "CHUNK": chunk,
        "n_chunks": n_chunks,
        "CHUNKS_PAD": max(32, 1 << (n_chunks - 1).bit_length()),
        "STAGES": stages,
        "VEC": vec,
        "NUM_WARPS": warps,
        "num_warps": warps,
    }
