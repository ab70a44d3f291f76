"""The key-tile loops of the attention forward (:mod:`flashlite.kernels.attention.fwd`): one tile
after the other (:func:`attend`), or reordered so that each tile's ``p·v`` runs on the tensor
cores under the next tile's softmax (:func:`attend_overlapped`); :func:`attend_rows` sets up a
query block's statistics and runs the loops over its key range.

The loops take their operands in tuples: ``ops = (q, k_tiles, v_tiles, pos, units)`` with
``k_tiles``/``v_tiles`` = ``(source, batch, head, first row, row stride, column stride)`` of K
and V, ``pos = (offs_m, offs_n, offs_d, seq_q, seq_k, left, right)`` and ``units = (cap,
exp_scale)``. Their constexprs travel in the bundles :class:`Loops`, :class:`Tiles` and
:class:`Stats`, built in the call itself (``Tiles(HEAD_DIM, ...)`` as an argument): Triton
turns the constexprs of an assigned tuple into tensors."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from flashlite.kernels.attention.common import accumulate, cap_units, scores, update
from flashlite.masking.masks import key_range
from flashlite.stats import LOG2E


class Loops(NamedTuple):
    """Constexprs of the key loops: the tile sizes, the mask, which loop variant runs."""

    BLOCK_M: int
    BLOCK_N: int
    IS_CAUSAL: bool
    WINDOW: bool
    OVERLAP: bool
    WARP_SPECIALIZE: bool


class Tiles(NamedTuple):
    """Constexprs of loading and multiplying the K and V tiles (``HEAD_DIM_V``, ``BLOCK_DV``:
    V's and O's head dim, which may differ from Q's and K's)."""

    HEAD_DIM: int
    BLOCK_D: int
    USE_DESC: bool
    DOT_FP32: bool
    DOT_PRECISION: str
    ROUND_BF16: bool
    VARLEN: bool
    HEAD_DIM_V: int
    BLOCK_DV: int


class Stats(NamedTuple):
    """Constexprs of the running statistics: soft cap, sink, rescaling."""

    SOFTCAP: bool
    HAS_SINKS: bool
    LAZY_RESCALE: bool
    FIXED_REF: bool


@triton.jit
def _tile_scores(q, start_n, k_tiles, pos, cap, MASKED: tl.constexpr, LOOPS, TILES, STATS):
    """:func:`scores` of the key tile at ``start_n``: fp32 ``q·kᵀ``, capped, masked if
    ``MASKED``."""
    k_src, b, h_kv, k_row, stride_kn, stride_kd = k_tiles
    offs_m, offs_n, offs_d, seq_q, seq_k, left, right = pos
    return scores(
        q,
        k_src,
        b,
        h_kv,
        start_n,
        k_row,
        offs_m,
        offs_n,
        offs_d,
        seq_q,
        seq_k,
        left,
        right,
        cap,
        stride_kn,
        stride_kd,
        MASKED,
        LOOPS.IS_CAUSAL,
        LOOPS.WINDOW,
        STATS.SOFTCAP,
        TILES.HEAD_DIM,
        TILES.BLOCK_D,
        TILES.USE_DESC,
        TILES.DOT_FP32,
        TILES.DOT_PRECISION,
    )


@triton.jit
def _tile_values(acc, alpha, moved, p, start_n, v_tiles, pos, MASKED: tl.constexpr, TILES):
    """:func:`accumulate`: ``acc·alpha + p·v`` for the value tile at ``start_n``."""
    v_src, b, h_kv, k_row, stride_vn, stride_vd = v_tiles
    offs_m, offs_n, _offs_d, seq_q, seq_k, left, right = pos
    offs_dv = tl.arange(0, TILES.BLOCK_DV)
    return accumulate(
        acc,
        alpha,
        moved,
        p,
        v_src,
        b,
        h_kv,
        start_n,
        k_row,
        seq_k,
        stride_vn,
        stride_vd,
        offs_n,
        offs_dv,
        MASKED,
        TILES.HEAD_DIM_V,
        TILES.BLOCK_DV,
        TILES.USE_DESC,
        TILES.DOT_FP32,
        TILES.DOT_PRECISION,
        TILES.ROUND_BF16,
        TILES.VARLEN,
    )


@triton.jit
def _fold(m, s, qk, exp_scale, STATS, P_DTYPE: tl.constexpr):
    """:func:`update`: fold a score tile into ``(m, s)``; ``(m, s, alpha, p, moved)``."""
    return update(m, s, qk, exp_scale, STATS.LAZY_RESCALE, STATS.FIXED_REF, P_DTYPE)


@triton.jit
def attend(
    acc,
    m,
    s,
    ops,
    lo,
    hi,
    MASKED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    LOOPS,
    TILES,
    STATS,
    P_DTYPE: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into ``(acc, m, s)``, one tile after the other: scores,
    statistics, ``acc = acc·alpha + p·v``. ``k_row`` of the tiles: the sequence's first row in
    the K and V sources (0 but for varlen descriptors)."""
    q, k_tiles, v_tiles, pos, units = ops
    cap, exp_scale = units
    for start_n in tl.range(lo, hi, LOOPS.BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        qk = _tile_scores(q, start_n, k_tiles, pos, cap, MASKED, LOOPS, TILES, STATS)
        m, s, alpha, p, moved = _fold(m, s, qk, exp_scale, STATS, P_DTYPE)
        acc = _tile_values(acc, alpha, moved, p, start_n, v_tiles, pos, MASKED, TILES)
    return acc, m, s


@triton.jit
def attend_overlapped(acc, m, s, ops, lo, hi, LOOPS, TILES, STATS, P_DTYPE: tl.constexpr):
    """:func:`attend` over unmasked tiles ``[lo, hi)`` (``hi > lo``), reordered so that the
    tensor cores work while the statistics are computed: the loop computes tile j's softmax,
    then tile j+1's scores, then issues tile j's ``p·v`` and moves on without waiting for it, so
    that product runs under tile j+1's softmax. Same arithmetic, same order of accumulation."""
    q, k_tiles, v_tiles, pos, units = ops
    cap, exp_scale = units
    BLOCK_N: tl.constexpr = LOOPS.BLOCK_N
    qk = _tile_scores(q, lo, k_tiles, pos, cap, False, LOOPS, TILES, STATS)
    for start_n in tl.range(lo, hi - BLOCK_N, BLOCK_N):
        m, s, alpha, p, moved = _fold(m, s, qk, exp_scale, STATS, P_DTYPE)
        # the next scores; Triton waits for this dot (and the p·v still running) right here
        qk = _tile_scores(q, start_n + BLOCK_N, k_tiles, pos, cap, False, LOOPS, TILES, STATS)
        # the rescale reads acc after that wait; the product is left in flight: only the next
        # iteration's score dot waits for it
        acc = _tile_values(acc, alpha, moved, p, start_n, v_tiles, pos, False, TILES)
    m, s, alpha, p, moved = _fold(m, s, qk, exp_scale, STATS, P_DTYPE)
    acc = _tile_values(acc, alpha, moved, p, hi - BLOCK_N, v_tiles, pos, False, TILES)
    return acc, m, s


@triton.jit
def _start_state(SINKS, h, softcap, exp_scale, LOOPS, TILES, STATS):
    """``(acc, m, s, cap)`` before the first key tile: ``(m, s)`` the identity ``(−inf, 0)``,
    or head h's sink ``(SINKS[h], 1)``, or with ``FIXED_REF`` the fixed reference; ``cap`` the
    soft cap in the scores' units."""
    BLOCK_M: tl.constexpr = LOOPS.BLOCK_M
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, TILES.BLOCK_DV], tl.float32)
    if STATS.HAS_SINKS:  # the sink's own state, in the scores' units: the loop folds keys into it
        m = tl.full([BLOCK_M], 1.0, tl.float32) * (tl.load(SINKS + h) * LOG2E / exp_scale)
        s = tl.full([BLOCK_M], 1.0, tl.float32)
    # the cap in the scores' units (softcap is in natural units: scores·scale)
    cap = cap_units(softcap, exp_scale, STATS.SOFTCAP)  # the cap in the scores' units
    if STATS.FIXED_REF:  # scores <= cap: a fixed reference replaces the running maximum (see ops)
        delta = tl.maximum(2.0 * softcap - 80.0, 0.0)  # natural units: e^(−80) stays normal
        m = tl.full([BLOCK_M], (softcap - delta) * LOG2E / exp_scale, tl.float32)
    return acc, m, s, cap


@triton.jit
def attend_rows(block, start, LOOPS, TILES, STATS):
    """``(acc, m, s)`` of a query block after all the key tiles it sees. ``block = (q, k_tiles,
    v_tiles, pos)``; ``start = (start_m, exp_scale, softcap, SINKS, h)``: the block's first
    row, the scores' exponent scale, the soft cap (natural units), the sinks and the head."""
    q, k_tiles, v_tiles, pos = block
    p_dtype = q.dtype  # the inputs' precision, that p·v multiplies p in
    if TILES.DOT_FP32:
        q = q.to(tl.float32)
    start_m, exp_scale, softcap, SINKS, h = start
    offs_m, offs_n, offs_d, seq_q, seq_k, left, right = pos
    BLOCK_M: tl.constexpr = LOOPS.BLOCK_M
    BLOCK_N: tl.constexpr = LOOPS.BLOCK_N
    WARP_SPECIALIZE: tl.constexpr = LOOPS.WARP_SPECIALIZE
    acc, m, s, cap = _start_state(SINKS, h, softcap, exp_scale, LOOPS, TILES, STATS)
    # Key tiles [full_lo, full_hi) are seen by every row of the block and lie inside the
    # sequence; [lo, full_lo) (a window's left edge) and [full_hi, hi) (the diagonal and
    # boundary tiles) are masked; other tiles are never visited.
    lo, full_lo, full_hi, hi = key_range(
        start_m, seq_q, seq_k, left, right, BLOCK_M, BLOCK_N, LOOPS.IS_CAUSAL, LOOPS.WINDOW
    )
    ops = (q, k_tiles, v_tiles, pos, (cap, exp_scale))
    if LOOPS.WINDOW:  # (without a window lo = full_lo)
        acc, m, s = attend(acc, m, s, ops, lo, full_lo, True, False, LOOPS, TILES, STATS, p_dtype)
    if LOOPS.OVERLAP:
        if full_hi > full_lo:
            acc, m, s = attend_overlapped(
                acc, m, s, ops, full_lo, full_hi, LOOPS, TILES, STATS, p_dtype
            )
    else:
        acc, m, s = attend(
            acc, m, s, ops, full_lo, full_hi, False, WARP_SPECIALIZE, LOOPS, TILES, STATS, p_dtype
        )
    acc, m, s = attend(acc, m, s, ops, full_hi, hi, True, False, LOOPS, TILES, STATS, p_dtype)
    return acc, m, s
