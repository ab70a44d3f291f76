"""Row softmax / log_softmax kernels, forward and backward, on the shared (m, s) statistics.

Every kernel sees a 2-D strided view ``x[row, col]`` of ``n_rows`` rows of ``n_cols`` values and
works on ``[ROWS, BLOCK_N]`` tiles; statistics are fp32 whatever the input dtype. Bytes moved per
element of x (b = element size), which is what bounds them all on a GPU:

=================  ==========================================  ===========================
kernel             passes over a row                           HBM bytes/elem
=================  ==========================================  ===========================
three_pass         max; sum of e^(x − m); write                3 reads + 1 write = 4b
online             (m, s) folded tile by tile; write           2 reads + 1 write = 3b
single_read        row held on chip: (m, s) and write at once  1 read + 1 write = 2b
split (2 kernels)  chunk pairs → workspace; merge; write       2 reads + 1 write = 3b (+ε)
team (GPU)         chunks on chip, pairs merged; write         1 read + 1 write = 2b (+ε)
=================  ==========================================  ===========================

``split`` and ``team`` are for rows too long to hold on one program (64k–256k+ vocabularies):
many programs share a row, each publishes the (m, s) of its chunk, and ``merge_partials``
combines them. ``split`` re-reads the row in a second kernel; ``team`` programs wait for each
other and write from the chunk they still hold.
No validation here: the front-end (``flashlite/ops/softmax.py``) owns that.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.common import cast
from flashlite.kernels.configs import cdiv, next_pow2
from flashlite.stats import LOG2E, merge_partials, online_update, rescale, tile_stats

# ----------------------------------------------------------------------------- block tables
#: Longest row the single-read kernel holds on chip: elements (rounded up to a power of two)
#: and bytes of input (on the H200 a 128 KB row still streams at ~0.75x the copy ceiling from
#: registers; longer rows spill).
SINGLE_READ_MAX = 65536
SINGLE_READ_BYTES = 131072
#: Columns each program of the split kernels owns (one tile, held in registers).
SPLIT_CHUNK = 8192
#: Tile width of the looping kernels (three_pass, online, long-row backward).
LOOP_TILE = 4096
#: Elements per program the single-read kernels aim for, per element size (small rows are
#: packed together). On the H200, bf16 rows of 1k ran 3-7% faster forward with 2048 than with
#: 4096 (log_softmax 0.94 -> 1.00x copy); fp32 within 1% from 2048 to 8192.
ELEMS_PER_PROGRAM = {2: 2048, 4: 4096}


def fits_single_read(n_cols: int, elem_bytes: int, tensors: int = 1) -> bool:
    """Whether a row of ``n_cols`` elements takes the single-read kernel; ``tensors``: rows of
    that length it holds at once as fp32 values (the backward holds y and dy: 2)."""
    block_n = next_pow2(n_cols)
    return block_n * tensors <= SINGLE_READ_MAX and block_n * elem_bytes <= SINGLE_READ_BYTES


def single_read_config(n_cols: int, elem_bytes: int) -> dict[str, int]:
    """Block shape and warps for the single-read kernels, from the row length and the size of
    an element."""
    block_n = next_pow2(n_cols)
    rows = max(1, ELEMS_PER_PROGRAM[elem_bytes] // block_n)
    elems = rows * block_n
    # about 16 fp32 values per thread: enough loads in flight, no spills
    num_warps = min(32, max(4, elems // 512))
    return {"ROWS": rows, "BLOCK_N": block_n, "num_warps": num_warps}


#: Bytes of input each program of the team kernel holds, and its warps, per element size (best
#: of 8-64 KB chunks and 4-16 warps on the H200: fp32 rows of 64k ran at 0.83x copy with
#: 16 KB / 4 warps against 0.78x with 32 KB / 8; bf16 log_softmax at 256k lost 8% with them).
TEAM_CHUNK_BYTES = {2: 32768, 4: 16384}
TEAM_WARPS = {2: 8, 4: 4}
#: Most programs per team: longer rows take wider chunks (and warps with them) instead.
TEAM_MAX_PROGRAMS = 128


def _chunked(n_cols: int, max_chunk: int, num_warps: int) -> dict[str, int]:
    """A row cut into power-of-two chunks of at most ``max_chunk`` columns."""
    chunk = min(max_chunk, next_pow2(n_cols))
    n_chunks = cdiv(n_cols, chunk)
    return {
        "BLOCK_N": chunk,
        "n_chunks": n_chunks,
        "CHUNKS_PAD": next_pow2(n_chunks),
        "num_warps": num_warps,
    }


def team_config(n_cols: int, elem_bytes: int) -> dict[str, int]:
    """Chunk width, chunk count and warps for the team (cooperative) kernel."""
    chunk_bytes, warps = TEAM_CHUNK_BYTES[elem_bytes], TEAM_WARPS[elem_bytes]
    # chunks and warps double together (the same values per thread) until the team is small
    # enough to be resident with room to spare
    while cdiv(n_cols * elem_bytes, chunk_bytes) > TEAM_MAX_PROGRAMS and warps < 32:
        chunk_bytes, warps = 2 * chunk_bytes, 2 * warps
    return _chunked(n_cols, chunk_bytes // elem_bytes, warps)


def loop_config(n_cols: int) -> dict[str, int]:
    """Tile width and warps for the looping kernels."""
    block_n = min(LOOP_TILE, next_pow2(n_cols))
    return {"ROWS": 1, "BLOCK_N": block_n, "num_warps": min(16, max(4, block_n // 256))}


def split_config(n_cols: int) -> dict[str, int]:
    """Chunk width, chunk count and warps for the split kernels."""
    chunk = min(SPLIT_CHUNK, next_pow2(n_cols))
    return _chunked(n_cols, SPLIT_CHUNK, min(16, max(4, chunk // 512)))


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _tile_offsets(
    row0,
    col0,
    n_rows,
    n_cols,
    stride_m,
    stride_n,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
):
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, BLOCK_N)
    if COL_INT64:
        cols = cols.to(tl.int64)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * stride_m + cols[None, :] * stride_n
    return offs, mask


@triton.jit
def _normalise(x, m, s, LOG: tl.constexpr):
    # softmax = e^(x − m) / s;  log_softmax = (x − m) − log s, exact for close values of x − m.
    # A row that is all −inf has m = −inf and gives NaN here, as torch does.
    if LOG:
        return (x - m[:, None]) - tl.log(s)[:, None]
    return tl.exp2((x - m[:, None]) * LOG2E) * (1.0 / s)[:, None]


# ----------------------------------------------------------------------------- forward
@triton.jit
def _softmax_single_read_fwd_kernel(
    X,
    Y,
    n_rows,
    n_cols,
    stride_xm,
    stride_xn,
    stride_ym,
    stride_yn,
    LOG: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Rows that fit on chip: one read, statistics from the identity pair, one write."""
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    offs, mask = _tile_offsets(
        row0, 0, n_rows, n_cols, stride_xm, stride_xn, ROWS, BLOCK_N, COL_INT64
    )
    x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m, s, p = tile_stats(x, LOG2E)
    if LOG:
        y = _normalise(x, m, s, True)
    else:  # reuse the exponentials already computed for s
        y = p * (1.0 / s)[:, None]
    offs, mask = _tile_offsets(
        row0, 0, n_rows, n_cols, stride_ym, stride_yn, ROWS, BLOCK_N, COL_INT64
    )
    tl.store(Y + offs, cast(y, Y.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit
def _softmax_online_fwd_kernel(
    X,
    Y,
    n_rows,
    n_cols,
    stride_xm,
    stride_xn,
    stride_ym,
    stride_yn,
    LOG: tl.constexpr,
    THREE_PASS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One program per row, tiles of BLOCK_N. ``THREE_PASS`` finds the max in a pass of its own
    (the textbook safe softmax); otherwise the max and the sum come from one online pass."""
    row = tl.program_id(0).to(tl.int64)
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    if THREE_PASS:
        for col0 in tl.range(0, n_cols, BLOCK_N):  # pass 1: the max
            offs, mask = _tile_offsets(
                row, col0, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
            )
            x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(x, 1))
    for col0 in tl.range(0, n_cols, BLOCK_N):
        # online: (m, s) folded in one pass. three_pass: m is already final, so the same update
        # is a plain sum (the rescale factor is e^0 = 1).
        offs, mask = _tile_offsets(
            row, col0, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
        )
        x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m, s, _, _ = online_update(m, s, x, LOG2E)
    for col0 in tl.range(0, n_cols, BLOCK_N):  # last pass: write
        offs, mask = _tile_offsets(
            row, col0, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
        )
        x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
        y = _normalise(x, m, s, LOG)
        offs, mask = _tile_offsets(
            row, col0, n_rows, n_cols, stride_ym, stride_yn, 1, BLOCK_N, COL_INT64
        )
        tl.store(Y + offs, cast(y, Y.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit
def _softmax_split_stats_kernel(
    X,
    M_ws,
    S_ws,
    n_rows,
    n_cols,
    stride_xm,
    stride_xn,
    n_chunks,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
):
    """Split rows, step 1: each program writes the (m, s) pair of one chunk of one row."""
    pid = tl.program_id(0).to(tl.int64)  # a row's chunks are adjacent in launch order
    row = pid // n_chunks
    chunk = pid % n_chunks
    offs, mask = _tile_offsets(
        row, chunk * BLOCK_N, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
    )
    x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m, s, _ = tile_stats(x, LOG2E)
    ws = row * n_chunks + chunk + tl.arange(0, 1)
    tl.store(M_ws + ws, m)
    tl.store(S_ws + ws, s)


@triton.jit
def _softmax_split_write_kernel(
    X,
    Y,
    M_ws,
    S_ws,
    n_rows,
    n_cols,
    stride_xm,
    stride_xn,
    stride_ym,
    stride_yn,
    n_chunks,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Split rows, step 2: merge the row's chunk pairs, then normalise this program's chunk.

    Every program of a row repeats the (cheap) C-way merge instead of waiting for one another.
    Programs run in the reverse of step 1's order, so the first chunks read are the ones step 1 read
    last and are most likely still in L2.
    """
    pid = n_rows * n_chunks - 1 - tl.program_id(0).to(tl.int64)
    row = pid // n_chunks
    chunk = pid % n_chunks
    c = tl.arange(0, CHUNKS_PAD)
    ws = row * n_chunks + c
    m_part = tl.load(M_ws + ws, mask=c < n_chunks, other=float("-inf"))  # identity padding
    s_part = tl.load(S_ws + ws, mask=c < n_chunks, other=0.0)
    m, s = merge_partials(m_part[None, :], s_part[None, :], LOG2E)
    offs, mask = _tile_offsets(
        row, chunk * BLOCK_N, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
    )
    x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    y = _normalise(x, m, s, LOG)
    offs, mask = _tile_offsets(
        row, chunk * BLOCK_N, n_rows, n_cols, stride_ym, stride_yn, 1, BLOCK_N, COL_INT64
    )
    tl.store(Y + offs, cast(y, Y.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit
def _arrive(count_ptr):
    """Count this program in on a row its team shares: *release*, so that the pair it stored
    for the row before is visible to whoever sees the count."""
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _await_team(count_ptr, n_chunks):
    """Spin until all ``n_chunks`` programs of a team have arrived: *acquire*, so that their
    pairs are visible to the loads that follow."""
    while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < n_chunks:
        pass


@triton.jit
def _softmax_team_fwd_kernel(
    X,
    Y,
    M_ws,
    S_ws,
    Count,
    n_rows,
    n_cols,
    stride_xm,
    stride_xn,
    stride_ym,
    stride_yn,
    n_chunks,
    n_teams,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Long rows read once: a team of ``n_chunks`` co-resident programs shares a row.

    Each program holds its chunk on chip, publishes the chunk's (m, s) pair, waits until the
    whole team has published (a per-row arrival counter), merges the team's pairs and writes its
    chunk from registers: 1 read + 1 write per element, like the single-read kernel. The host
    launches it as a cooperative grid (``_teams.launch_teams``), which the driver only starts
    when every program fits on the GPU at once, so the wait cannot deadlock. The interpreter
    runs programs one after another, so there it runs only with one program per row; on CPU
    ``auto`` takes the two-kernel ``split`` path instead.
    """
    pid = tl.program_id(0)
    team = pid // n_chunks
    chunk = pid % n_chunks
    for row in tl.range(team, n_rows, n_teams):
        row64 = tl.cast(row, tl.int64)  # (the interpreter loops over Python ints)
        offs, mask = _tile_offsets(
            row64, chunk * BLOCK_N, n_rows, n_cols, stride_xm, stride_xn, 1, BLOCK_N, COL_INT64
        )
        x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m, s, p = tile_stats(x, LOG2E)
        ws = row64 * n_chunks + chunk + tl.arange(0, 1)
        tl.store(M_ws + ws, m)
        tl.store(S_ws + ws, s)
        _arrive(Count + row64)
        c = tl.arange(0, CHUNKS_PAD)
        _await_team(Count + row64, n_chunks)
        pairs = row64 * n_chunks + c
        m_part = tl.load(M_ws + pairs, mask=c < n_chunks, other=float("-inf"), cache_modifier=".cg")
        s_part = tl.load(S_ws + pairs, mask=c < n_chunks, other=0.0, cache_modifier=".cg")
        m_row, s_row = merge_partials(m_part[None, :], s_part[None, :], LOG2E)
        if LOG:
            y = _normalise(x, m_row, s_row, True)
        else:  # move our exponentials from the chunk's maximum onto the row's
            y = p * (rescale(m, m_row, LOG2E) / s_row)[:, None]
        offs, mask = _tile_offsets(
            row64, chunk * BLOCK_N, n_rows, n_cols, stride_ym, stride_yn, 1, BLOCK_N, COL_INT64
        )
        tl.store(Y + offs, cast(y, Y.dtype.element_ty, ROUND_BF16), mask=mask)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _softmax_bwd_kernel(
    Y,
    DY,
    DX,
    n_rows,
    n_cols,
    stride_ym,
    stride_yn,
    stride_gm,
    stride_gn,
    stride_dm,
    stride_dn,
    LOG: tl.constexpr,
    ONE_TILE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Backward of softmax and log_softmax from the saved output.

    softmax:      y = e^(x − lse)  ⇒  dx_i = Σ_j dy_j ∂y_j/∂x_i = y_i (dy_i − Σ_j y_j dy_j)
    log_softmax:  z = x − lse      ⇒  dx_i = dy_i − e^(z_i) Σ_j dy_j

    ``ONE_TILE``: the row fits one tile, read once and kept; otherwise two passes over tiles (the
    row reduction, then the write), one program per row.
    """
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    if ONE_TILE:
        offs, mask = _tile_offsets(
            row0, 0, n_rows, n_cols, stride_ym, stride_yn, ROWS, BLOCK_N, COL_INT64
        )
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        offs, mask = _tile_offsets(
            row0, 0, n_rows, n_cols, stride_gm, stride_gn, ROWS, BLOCK_N, COL_INT64
        )
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp2(y * LOG2E) * tl.sum(dy, 1)[:, None]
        else:
            dx = y * (dy - tl.sum(y * dy, 1)[:, None])
        offs, mask = _tile_offsets(
            row0, 0, n_rows, n_cols, stride_dm, stride_dn, ROWS, BLOCK_N, COL_INT64
        )
        tl.store(DX + offs, cast(dx, DX.dtype.element_ty, ROUND_BF16), mask=mask)
    else:
        acc = tl.zeros([ROWS], tl.float32)
        for col0 in tl.range(0, n_cols, BLOCK_N):
            offs, mask = _tile_offsets(
                row0, col0, n_rows, n_cols, stride_gm, stride_gn, ROWS, BLOCK_N, COL_INT64
            )
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                acc += tl.sum(dy, 1)
            else:
                offs, mask = _tile_offsets(
                    row0, col0, n_rows, n_cols, stride_ym, stride_yn, ROWS, BLOCK_N, COL_INT64
                )
                y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
                acc += tl.sum(y * dy, 1)
        for col0 in tl.range(0, n_cols, BLOCK_N):
            offs, mask = _tile_offsets(
                row0, col0, n_rows, n_cols, stride_ym, stride_yn, ROWS, BLOCK_N, COL_INT64
            )
            y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
            offs, mask = _tile_offsets(
                row0, col0, n_rows, n_cols, stride_gm, stride_gn, ROWS, BLOCK_N, COL_INT64
            )
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                dx = dy - tl.exp2(y * LOG2E) * acc[:, None]
            else:
                dx = y * (dy - acc[:, None])
            offs, mask = _tile_offsets(
                row0, col0, n_rows, n_cols, stride_dm, stride_dn, ROWS, BLOCK_N, COL_INT64
            )
            tl.store(DX + offs, cast(dx, DX.dtype.element_ty, ROUND_BF16), mask=mask)
