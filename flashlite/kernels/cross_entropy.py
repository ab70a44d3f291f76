"""Fused softmax cross-entropy on the shared (m, s) statistics: loss and gradient in one pass.

For a row of logits ``x`` (soft-capped first with ``SOFTCAP``: ``x ← c·tanh(x/c)``), target
``t``, class weights ``w`` (1 without them), label smoothing ``ε`` over ``V`` classes and z-loss
``z``, with ``lse = m + ln s`` from the row's online pair and ``p = softmax(x)``::

    loss = (1 − ε)·w_t·(lse − x_t) + (ε/V)·(lse·Σ_j w_j − Σ_j w_j·x_j) + z·lse²
    ∂loss/∂x_j = p_j·((1 − ε)·w_t + (ε/V)·Σ_k w_k + 2z·lse) − (1 − ε)·w_t·[j = t] − (ε/V)·w_j

(the first term is torch's weighted NLL, the second its label-smoothing term, the third PaLM's
z-loss), times ``1 − tanh²`` through a soft cap. A ``mean`` divides the first two terms by
``Σ w_t`` of the kept targets (torch's weighted mean) and the z-loss by their count (it bounds
each row's LSE, whatever the target's class: Liger's and PaLM's convention); with class weights
the forward scales ``z`` by ``r = Σ w_t / count`` on the device, so that dividing the whole
row by ``Σ w_t`` gives both. The gradient is the row softmax minus a
smoothed one-hot, so it is written here, in the forward, and never stored as a softmax: the
backward only scales it by the incoming gradient. A row whose target is ``ignore_index`` has loss
and gradient 0; a target outside ``[0, V)`` gives a NaN loss (the front-end rejects it first
unless told not to check).

Bytes per row (b = element size): ``SINGLE`` rows (up to :data:`SINGLE_READ_MAX` logits) fit
on chip and are read once and written once (2·V·b); longer rows are read twice, once for the
statistics and once, backwards and mostly from L2, for the gradient (3·V·b issued). Statistics
are fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.common import cast, tanh
from flashlite.kernels.configs import next_pow2
from flashlite.stats import (
    LOG2E,
    finalize_lse,
    online_update,
    probs_from_pair,
    tile_stats,
)

#: Longest row (elements, rounded up to a power of two) read once, held on chip. Longer rows
#: loop twice over 8192-column tiles with 8 warps, the second pass backwards so that it starts
#: on the tiles still in L2: at 32k columns that ran at 0.73x the copy ceiling on the H200
#: against 0.57x for the whole row held by one 32-warp program (``benchmarks/NOTES.md``).
SINGLE_READ_MAX = 8192
LOOP_TILE = 8192
LOOP_WARPS = 8


def ce_config(n_cols: int) -> dict[str, object]:
    """Kernel shape for rows of ``n_cols`` logits: one tile for the whole row, or loop tiles."""
    block = next_pow2(n_cols)
    if block <= SINGLE_READ_MAX:
        return {"SINGLE": True, "BLOCK_N": block, "num_warps": min(32, max(4, block // 512))}
    return {"SINGLE": False, "BLOCK_N": LOOP_TILE, "num_warps": LOOP_WARPS}


@triton.jit
def _logits(X, W, cols, n_cols, stride_n, softcap, SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """A ``[1, BLOCK_N]`` tile of (capped) fp32 logits (−inf past the row), ``tanh`` of the
    cap (for its derivative; 0 without one) and the class weights (0 past the row). Every
    tile is loaded 2-D, in the layout the row's arithmetic uses (a 1-D load reshaped afterwards
    went through shared memory and spilled registers on sm_90)."""
    cols = cols[None, :]
    mask = cols < n_cols
    x = tl.load(X + cols * stride_n, mask=mask, other=float("-inf")).to(tl.float32)
    t = tl.zeros_like(x)
    if SOFTCAP:
        t = tanh(x * (1.0 / softcap), X.dtype.element_ty != tl.float32)
        x = tl.where(mask, softcap * t, float("-inf"))
    w = tl.where(mask, 1.0, 0.0)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return x, t, w


@triton.jit
def _grad(x, t, w, cols, stats, consts, SOFTCAP: tl.constexpr):
    """``∂loss/∂x`` of a ``[1, BLOCK_N]`` tile from the row's finished statistics
    ``stats = (m, s, lse)`` and its constants ``consts = (target, w_t, smoothing, inv_v,
    z_loss, weight_sum, scale)`` (``scale``: the gradient's, 0 for an ignored row)."""
    m, s, lse = stats
    target, w_t, smoothing, inv_v, z_loss, weight_sum, scale = consts
    # from the pair, not the LSE: p = e^(x − lse) with lse rounded to fp32 is off by up to 5e-4
    # at |x| ≈ 1e4 (one exponential per logit and no division either way)
    p = probs_from_pair(x, m, s, LOG2E)
    coef = (1.0 - smoothing) * w_t + smoothing * inv_v * weight_sum + 2.0 * z_loss * lse
    g = p * coef[:, None] - smoothing * inv_v * w
    g = tl.where(cols[None, :] == target, g - (1.0 - smoothing) * w_t[:, None], g)
    if SOFTCAP:  # d(c·tanh(x/c))/dx = 1 − tanh²
        g = g * (1.0 - t * t)
    return g * scale


@triton.jit
def _store_grad(g_row, g, cols, n_cols, stride_gn, ROUND_BF16: tl.constexpr):
    """Store a ``[1, BLOCK_N]`` gradient tile at ``cols`` of the row at ``g_row`` (columns
    below ``n_cols``), in the gradient's dtype."""
    tl.store(
        g_row + cols[None, :] * stride_gn,
        cast(g, g_row.dtype.element_ty, ROUND_BF16),
        mask=cols[None, :] < n_cols,
    )


@triton.jit
def _stats_pass(
    x_row,
    W,
    offs,
    n_cols,
    stride_xn,
    softcap,
    target,
    SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pass 1 over a row longer than a tile: the online pair ``(m, s)``, the target's logit
    and ``Σ w·x``, tile by tile, each ``[1]``."""
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    x_t = tl.zeros([1], tl.float32)
    wx = tl.zeros([1], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        x, _t, w = _logits(x_row, W, cols, n_cols, stride_xn, softcap, SOFTCAP, HAS_WEIGHT)
        m, s, _alpha, _p = online_update(m, s, x, LOG2E)
        x_t_tile, wx_tile = _partials(x, w, cols, target, SMOOTH)
        x_t += x_t_tile
        wx += wx_tile
    return m, s, x_t, wx


@triton.jit
def _grad_pass(
    rows,
    W,
    offs,
    n_cols,
    softcap,
    stats,
    consts,
    SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Pass 2 over a row longer than a tile: its gradient (:func:`_grad`, which says what
    ``stats`` and ``consts`` hold), the row read again backwards, so that it starts on the tiles
    pass 1 read last (still in L2). ``rows = (x_row, g_row, stride_xn, stride_gn)``: the row of
    logits and of the gradient, and their column strides."""
    x_row, g_row, stride_xn, stride_gn = rows
    n_tiles = tl.cdiv(n_cols, BLOCK_N)
    for i in range(0, n_tiles):
        cols = (n_tiles - 1 - i) * BLOCK_N + offs
        x, t, w = _logits(x_row, W, cols, n_cols, stride_xn, softcap, SOFTCAP, HAS_WEIGHT)
        g = _grad(x, t, w, cols, stats, consts, SOFTCAP)
        _store_grad(g_row, g, cols, n_cols, stride_gn, ROUND_BF16)


@triton.jit
def _target(T, W, row, n_cols, ignore_index, HAS_WEIGHT: tl.constexpr):
    """A row's target, whether it is ignored or in ``[0, V)``, and its class weight ``[1]``."""
    target = tl.load(T + row).to(tl.int64)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < n_cols)
    w_t = tl.full([1], 1.0, tl.float32)
    if HAS_WEIGHT:  # (an index clamped into the row: a bad target reads class 0, then gives NaN)
        w_t = w_t * tl.load(W + tl.where(in_range, target, 0)).to(tl.float32)
    return target, ignored, in_range, w_t


@triton.jit
def _partials(x, w, cols, target, SMOOTH: tl.constexpr):
    """The target's logit in this tile (0 elsewhere) and ``Σ w·x`` over it (smoothing), ``[1]``."""
    x_t = tl.sum(tl.where(cols[None, :] == target, x, 0.0), 1)
    wx = tl.zeros_like(x_t)
    if SMOOTH:
        wx = tl.sum(w * tl.where(w != 0.0, x, 0.0), 1)
    return x_t, wx


@triton.jit
def _loss(
    m,
    s,
    lse,
    x_t,
    wx,
    w_t,
    weight_sum,
    smoothing,
    inv_v,
    z_loss,
    ignored,
    in_range,
    SMOOTH: tl.constexpr,
):
    """A row's loss from its statistics and partials: 0 when ignored, NaN for a target outside
    ``[0, V)``."""
    # lse − x_t as (m − x_t) + ln s: exact where the LSE rounded to fp32 is not (large logits)
    loss = (1.0 - smoothing) * w_t * ((m - x_t) + tl.log(s)) + z_loss * lse * lse
    if SMOOTH:
        loss += smoothing * inv_v * (lse * weight_sum - wx)
    return tl.where(ignored, 0.0, tl.where(in_range, loss, float("nan")))


@triton.jit
def _cross_entropy_fwd_kernel(
    X,
    T,
    W,
    WSUM,
    GSCALE,
    G,
    LOSS,
    LSE,
    n_cols,
    stride_xm,
    stride_xn,
    stride_gm,
    stride_gn,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    Z_SCALE: tl.constexpr,
):
    """One program per row: loss (fp32), LSE (fp32) and the gradient ``G`` (the logits' dtype;
    ``G`` may be ``X`` itself: each tile is read before it is overwritten). ``WSUM`` holds
    ``Σ_j w_j`` (fp32, on the device: no host sync for it); ``GSCALE`` the gradient's scale,
    the incoming gradient a unit loss sends each row (``1/Σ`` for a mean, else 1), so that the
    backward has nothing to do when that is what arrives. ``Z_SCALE`` (a weighted mean with
    z-loss): ``GSCALE[1]`` holds ``r = Σ w_t / count`` of the kept targets and the z-loss is
    ``z·r·lse²``, which the mean's ``1/Σ w_t`` turns into ``z·lse²/count``."""
    row = tl.program_id(0).to(tl.int64)
    weight_sum = n_cols * 1.0
    if HAS_WEIGHT:
        weight_sum = tl.load(WSUM)
    if Z_SCALE:
        z_loss = z_loss * tl.load(GSCALE + 1)
    x_row = X + row * stride_xm
    g_row = G + row * stride_gm
    rows = (x_row, g_row, stride_xn, stride_gn)
    target, ignored, in_range, w_t = _target(T, W, row, n_cols, ignore_index, HAS_WEIGHT)
    offs = tl.arange(0, BLOCK_N)
    if COL_INT64:
        offs = offs.to(tl.int64)
    inv_v = 1.0 / n_cols

    if SINGLE:  # the row on chip: statistics, loss and gradient from one read
        x, t, w = _logits(x_row, W, offs, n_cols, stride_xn, softcap, SOFTCAP, HAS_WEIGHT)
        m, s, _p = tile_stats(x, LOG2E)
        x_t, wx = _partials(x, w, offs, target, SMOOTH)
    else:  # pass 1: the online pair, the target's logit and Σ w·x, tile by tile
        m, s, x_t, wx = _stats_pass(
            x_row, W, offs, n_cols, stride_xn, softcap, target, SOFTCAP, HAS_WEIGHT, SMOOTH, BLOCK_N
        )

    lse = finalize_lse(m, s, LOG2E)
    loss = _loss(
        m, s, lse, x_t, wx, w_t, weight_sum, smoothing, inv_v, z_loss, ignored, in_range, SMOOTH
    )
    tl.store(LOSS + row + tl.arange(0, 1), loss)
    tl.store(LSE + row + tl.arange(0, 1), lse)

    # ignored rows: zero gradient (not 0·GSCALE: a mean over no target has GSCALE = inf);
    # a target outside [0, V): NaN, like its loss
    scale = tl.where(ignored, 0.0, tl.where(in_range, tl.load(GSCALE), float("nan")))
    stats = (m, s, lse)
    consts = (target, w_t, smoothing, inv_v, z_loss, weight_sum, scale)
    if SINGLE:
        g = _grad(x, t, w, offs, stats, consts, SOFTCAP)
        _store_grad(g_row, g, offs, n_cols, stride_gn, ROUND_BF16)
    else:  # pass 2: read the row again, backwards (the tiles pass 1 read last are in L2)
        _grad_pass(
            rows, W, offs, n_cols, softcap, stats, consts, SOFTCAP, HAS_WEIGHT, BLOCK_N, ROUND_BF16
        )


@triton.jit
def _cross_entropy_bwd_kernel(
    G,
    DX,
    DLOSS,
    n_rows,
    n_cols,
    stride_gm,
    stride_gn,
    stride_dm,
    stride_dn,
    stride_l,
    SCALAR: tl.constexpr,
    SKIP_UNIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    COL_INT64: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """``DX[row] = G[row]·DLOSS[row·stride_l]``: the stored gradient of a unit loss times the
    incoming one (``SCALAR``: one value for every row, a mean or a sum). ``SKIP_UNIT`` (``DX``
    is ``G``): a row whose incoming gradient is exactly 1 (``loss.backward()``) is already right
    and is not touched: no bytes. Grid ``(programs, cdiv(V, TILES·BLOCK_N))``, fewer programs
    than rows: each loops over rows ``pid, pid + programs, …``, so that a skipped scalar costs
    one load per program, not a program per row (16 µs → a few for 8192 × 128k on the H200)."""
    if SCALAR:
        d_all = tl.load(DLOSS).to(tl.float32)
        if SKIP_UNIT and d_all == 1.0:
            return
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        if SCALAR:
            d = d_all
        else:
            d = tl.load(DLOSS + row * stride_l).to(tl.float32)
        if not (SKIP_UNIT and d == 1.0):
            for i in tl.range(0, TILES):
                cols = (tl.program_id(1) * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
                if COL_INT64:
                    cols = cols.to(tl.int64)
                mask = cols < n_cols
                g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0)
                # a zero stays zero: an ignored row's gradient is 0 whatever arrives (torch's too)
                dx = tl.where(g == 0.0, 0.0, g.to(tl.float32) * d)
                tl.store(
                    DX + row * stride_dm + cols * stride_dn,
                    cast(dx, DX.dtype.element_ty, ROUND_BF16),
                    mask=mask,
                )


#: Targets per tile of :func:`_cross_entropy_scale_kernel` (one program loops over them all: a
#: few µs for the 8k-64k tokens of a training step, no atomics between programs).
SCALE_BLOCK = 4096


@triton.jit
def _cross_entropy_scale_kernel(
    T,
    W,
    GSCALE,
    SEEN,
    BAD,
    n_rows,
    n_cols,
    ignore_index,
    MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
    Z_SCALE: tl.constexpr,
):
    """What the forward kernels need before they start, in one launch over the ``n_rows``
    targets: ``GSCALE[0]``, the gradient a unit loss sends each row (``1/Σ`` of the kept
    targets' weights, 1 each without ``W``, for a mean: torch's weighted mean; 1 otherwise), and
    with ``CHECK`` the targets checked on the device: the first one outside ``[0, V)`` that is
    not ``ignore_index`` is recorded in ``BAD = (flag, class, V)`` unless a bad target is
    recorded there already, and ``SEEN[0]`` set to 1: the host's pinned memory on a GPU, which
    the host reads later without waiting for this kernel (no copy launched per call).
    ``Z_SCALE`` (a weighted mean with z-loss): also ``GSCALE[1] = Σ w / count`` of the kept
    targets, the z-loss's scale in the forward kernel (0 when none is kept)."""
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    first = tl.zeros([], tl.int32) + n_rows  # (a tensor: n_rows = 1 comes as a constant)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        inside = rows < n_rows
        t = tl.load(T + rows, mask=inside, other=0).to(tl.int64)
        kept = inside & (t != ignore_index)
        if HAS_WEIGHT:  # (a bad target's weight read at class 0: its row is NaN anyway)
            in_range = (t >= 0) & (t < n_cols)
            total += tl.load(W + tl.where(in_range, t, 0), mask=kept, other=0.0).to(tl.float32)
        else:
            total += tl.where(kept, 1.0, 0.0)
        if Z_SCALE:
            count += kept.to(tl.int32)
        if CHECK:
            bad = kept & ((t < 0) | (t >= n_cols))
            first = tl.minimum(first, tl.min(tl.where(bad, rows, n_rows)))
    scale = 1.0
    if MEAN:  # torch's weighted mean, whatever the divisor's sign (class weights may be
        # negative: torch and Liger take any). A zero one gives inf: the mean is then NaN when
        # every target is ignored (0·inf, torch's 0/0) and ±inf for kept weights summing to 0
        scale = 1.0 / tl.sum(total)
    tl.store(GSCALE, scale)
    if Z_SCALE:  # (no target kept: 0, not 0/0, so that ignored rows' gradients stay 0, not NaN)
        kept_n = tl.sum(count).to(tl.float32)
        denom = tl.sum(total)
        tl.store(GSCALE + 1, tl.where(kept_n > 0, denom / tl.maximum(kept_n, 1.0), 0.0))
    if CHECK:  # noqa: SIM102 - (a compile-time branch, then the device's)
        if first < n_rows:  # noqa: SIM102 - (the exchange only where there is a bad target)
            none = tl.zeros([], tl.int64)  # (the exchange's operands: the flag's type)
            if tl.atomic_cas(BAD, none, none + 1) == 0:  # the first report stands till read
                tl.store(BAD + 1, tl.load(T + first).to(tl.int64))
                tl.store(BAD + 2, n_cols)
                tl.store(SEEN, 1)
