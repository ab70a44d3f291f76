"""The online-softmax pair (m, s): the one piece of math every flashlite kernel shares.

For a set of logits x, ``m`` is the largest value seen and ``s = Σ exp(x − m)``. A new tile updates
the pair with one rescale, two pairs over disjoint sets merge associatively::

    m = max(m1, m2);  s = s1·e^(m1 − m) + s2·e^(m2 − m);   identity (−inf, 0)

and ``lse = m + log s`` finalises it. ``docs/how-it-works/online-softmax.md`` derives all of this.

Triton helpers (``@triton.jit``, called from kernels):

=======================  ============================================================
``tile_stats``           (m, s) of a fresh ``[R, C]`` tile along its last axis
``online_update``        fold a tile into a running pair; also returns the rescale factor and
                         the tile's exponentials (attention needs both)
``online_update_lazy``   the same, moving the reference only when the maximum grows by > TAU
``fixed_update``         fold a tile into a sum taken against a fixed reference that bounds
                         every logit (a soft cap): no maximum, no rescale
``rescale``              ``2^(m_old − m_new)``, the factor that moves sums (and accumulators)
``merge_pair``           the associative merge of two pairs
``merge_partials``       the same merge over the last axis of ``[R, C]`` partial pairs
``finalize_lse``         natural-log LSE from a pair
``probs_from_lse``       normalised probabilities of a tile from a finished LSE (backward)
``probs_from_lse_t``     the same for a transposed ``[C, R]`` tile (one LSE per column)
``probs_from_pair``      the same from the finished pair ``(m, s)``: exact at large logits
=======================  ============================================================

``m`` is kept in the logits' own units and every exponential is ``2^((x − m)·SCALE)`` for a
positive ``SCALE`` (a runtime value or a constexpr). Softmax passes ``LOG2E``, so the helper
computes ``e^(x − m)``; attention passes ``sm_scale·LOG2E``, folding the softmax scale into the
one multiply that ``exp2`` needs anyway. Subtracting before scaling keeps ``x − m`` exact for close
values, which is what makes inputs like ``1e4 + small`` come out right in fp32 on both machines
(the interpreter has no fused multiply-add to hide a rounded ``x·SCALE``).

Every helper is safe when maxima are −inf (an empty or fully masked set): the reference point for
the subtraction is 0 there, so no ``−inf − (−inf)`` NaN appears and sums stay 0. A set holding
+inf has ``m = +inf`` and an LSE of +inf, as ``torch.logsumexp``: the merges take 0 as the
reference there too (the union's ``s`` stays positive, never ``inf − inf``), and
``finalize_lse`` returns +inf whatever ``s`` is. Inside one tile ``e^(x − m)`` of the +inf logit
itself is NaN, as in torch's softmax, whose rows holding +inf are NaN.

Torch twins (natural log, any shape, used by tests, split-KV merging and docs):
``merge`` (twin of ``merge_pair``), ``merge_attention``, ``torch_tile_stats``,
``torch_online_update``, ``torch_fixed_update``, ``torch_rescale``, ``torch_finalize_lse``.

Gluon kernels cannot call these helpers: :mod:`flashlite.stats_gluon` holds their Gluon twins.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# (flashlite/__init__.py imports _backend before anything imports triton, which is what
# switches the interpreter on for machines without a GPU)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # ln(2)

__all__ = [
    "LOG2E",
    "LN2",
    "tile_stats",
    "online_update",
    "online_update_lazy",
    "fixed_update",
    "rescale",
    "merge_pair",
    "merge_partials",
    "finalize_lse",
    "probs_from_lse",
    "probs_from_lse_t",
    "probs_from_pair",
    "merge",
    "merge_attention",
    "torch_tile_stats",
    "torch_online_update",
    "torch_fixed_update",
    "torch_rescale",
    "torch_finalize_lse",
    "torch_probs_from_lse",
]


# --------------------------------------------------------------------------- Triton helpers
@triton.jit
def _reference_point(m):
    # Subtract 0 instead of −inf when nothing finite was seen: 2^(−inf − 0) = 0, not NaN.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _merge_point(m):
    # A merge's reference: 0 where the union's maximum is infinite. −inf: both parts are empty;
    # +inf: a part holds +inf, and its weight 2^(+inf − 0) = inf keeps the union's LSE +inf
    # (2^(+inf − +inf) would be NaN).
    return tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)


@triton.jit
def rescale(m_old, m_new, SCALE):
    """``2^((m_old − m_new)·SCALE)``: moves a sum (or accumulator) taken against ``m_old`` onto
    ``m_new``; 0 when ``m_old`` is −inf."""
    return tl.exp2((m_old - _reference_point(m_new)) * SCALE)


@triton.jit
def _fold(m, m_new, s, x, SCALE):
    # the update against a chosen new reference m_new >= m (any reference works: s is
    # Σ 2^((x − m)·SCALE) for whatever m it was taken against)
    ref = _reference_point(m_new)
    alpha = tl.exp2((m - ref) * SCALE)
    p = tl.exp2((x - ref[:, None]) * SCALE)
    return m_new, s * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def online_update(m, s, x, SCALE):
    """Fold the ``[R, C]`` tile of logits ``x`` into the running pair ``(m, s)`` (each ``[R]``).

    Returns ``(m_new, s_new, alpha, p)``: ``alpha = 2^((m − m_new)·SCALE)`` rescales anything
    summed against the old maximum (the attention accumulator), ``p = 2^((x − m_new)·SCALE)`` are
    the tile's unnormalised probabilities.
    """
    return _fold(m, tl.maximum(m, tl.max(x, 1)), s, x, SCALE)


@triton.jit
def online_update_lazy(m, s, x, SCALE, TAU: tl.constexpr):
    """:func:`online_update` whose reference moves only when a row's maximum grows by more than
    ``TAU`` (log2 units) — the pair's math holds for any reference, the maximum only keeps the
    exponentials small, and ``p <= 2^TAU`` is still small. Most tiles then leave every reference
    where it was (``alpha = 1``), so a caller can skip rescaling its accumulator; the returned
    ``moved`` says whether any row's reference changed.
    """
    m_tile = tl.max(x, 1)
    grow = (m_tile - m) * SCALE > TAU  # False for −inf − (−inf) = NaN: empty rows stay −inf
    m_new = tl.where(grow, m_tile, m)
    m_new, s_new, alpha, p = _fold(m, m_new, s, x, SCALE)
    return m_new, s_new, alpha, p, tl.max(grow.to(tl.int32), 0) > 0


@triton.jit
def fixed_update(m, s, x, SCALE, P_DTYPE: tl.constexpr = tl.float32):
    """Fold the ``[R, C]`` tile ``x`` into ``s``, a sum against the fixed reference ``m`` (each
    ``[R]``): ``(s_new, p)``, ``p = 2^((x − m)·SCALE)``. The pair's math holds for any reference;
    the maximum only keeps the exponentials in range, so when a known bound does that (a soft
    cap c bounds every logit: the attention forward takes m = c − δ) there is no maximum to take
    and nothing to rescale: ``alpha`` is 1 for good.

    ``P_DTYPE``: the precision of the caller's ``p·v`` product. ``p`` is rounded to it before it
    is summed, so that ``Σ p·v / Σ p`` stays an exact weighted mean of v (one key gives v
    itself). Under the running maximum the largest ``p`` is exactly 1 in any precision; here no
    ``p`` need be, and an unrounded sum would put each ``p``'s rounding into the output."""
    p = _rounded_to(tl.exp2((x - m[:, None]) * SCALE), P_DTYPE)
    return s + tl.sum(p, 1), p


@triton.jit
def _rounded_to(p, P_DTYPE: tl.constexpr):
    """Non-negative finite fp32 ``p`` rounded to the nearest ``P_DTYPE`` value, kept in fp32
    (the same on a GPU and in the interpreter: bf16 by integer ops, fp16 by a conversion,
    which the interpreter rounds to nearest too)."""
    if P_DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr, not a constant)
        # bf16 is fp32's top 16 bits: two integer ops round to them (ties away from zero). The
        # GPU's conversion unit is as scarce as its exp2 unit, and a round trip through bf16
        # per score took the softcap forward from 1.01x to 1.27x the uncapped time on the H200.
        bits = p.to(tl.uint32, bitcast=True)
        p = ((bits + 0x8000) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif P_DTYPE != tl.float32:  # noqa: SIM300
        p = p.to(P_DTYPE).to(tl.float32)
    return p


@triton.jit
def tile_stats(x, SCALE):
    """``(m, s, p)`` of a fresh ``[R, C]`` tile along axis 1: the identity pair (−inf, 0) updated
    with ``x``; ``p`` are the exponentials, for kernels that hold the tile anyway."""
    m0 = tl.full([x.shape[0]], float("-inf"), tl.float32)
    m, s, _, p = online_update(m0, tl.zeros([x.shape[0]], tl.float32), x, SCALE)
    return m, s, p


@triton.jit
def merge_pair(m_a, s_a, m_b, s_b, SCALE):
    """Associative, commutative merge of two pairs; identity (−inf, 0)."""
    m = tl.maximum(m_a, m_b)
    ref = _merge_point(m)
    return m, s_a * tl.exp2((m_a - ref) * SCALE) + s_b * tl.exp2((m_b - ref) * SCALE)


@triton.jit
def merge_partials(m, s, SCALE):
    """Merge ``[R, C]`` partial pairs along axis 1 into ``[R]`` pairs.

    Associativity lets the C-way fold happen in one step: the common maximum first, then every
    partial sum moved onto it. Padding partials must be the identity (−inf, 0).
    """
    m_all = tl.max(m, 1)
    w = tl.exp2((m - _merge_point(m_all)[:, None]) * SCALE)
    return m_all, tl.sum(s * w, 1)


@triton.jit
def finalize_lse(m, s, SCALE):
    """Natural-log LSE of the scaled logits, ``ln Σ e^(x·SCALE·ln2)``; −inf for an empty set,
    +inf for a set holding +inf (``m = +inf``; its ``s`` may be NaN), as ``torch.logsumexp``."""
    return tl.where(m == float("inf"), m, m * (SCALE * LN2) + tl.log(s))


@triton.jit
def probs_from_lse(x, lse, SCALE):
    """The normalised probabilities ``2^(x·SCALE − lse·log2 e)`` of an ``[R, C]`` tile of logits
    from its rows' finished natural-log LSE (``[R]``): how a backward pass gets P back without a
    second pass of statistics. Rows whose LSE is −inf (they saw nothing) give 0, not NaN."""
    return tl.exp2(x * SCALE - _lse_log2(lse)[:, None])


@triton.jit
def probs_from_lse_t(xt, lse, SCALE):
    """:func:`probs_from_lse` of a transposed ``[C, R]`` tile, the rows' LSE (``[R]``) running
    along its columns: the backward's dK/dV kernel works keys-major (``Sᵀ = K·Qᵀ``) so that
    ``Pᵀ`` feeds the next products straight from registers."""
    return tl.exp2(xt * SCALE - _lse_log2(lse)[None, :])


@triton.jit
def probs_from_pair(x, m, s, SCALE):
    """The normalised probabilities ``2^((x − m)·SCALE) / s`` of an ``[R, C]`` tile from its
    rows' finished pair (``[R]`` each): one more multiply per element than
    :func:`probs_from_lse`, and exact near the row's maximum. The LSE rounded to fp32 is off by
    up to half its ulp (5e-4 at |x| ≈ 1e4), and ``p`` from it inherits that relative error: fine
    for attention's scaled scores, not for cross-entropy's raw logits, whose gradient is ``p``.
    Rows that saw nothing (``m = −inf``, ``s = 0``) give 0."""
    ref = tl.where(m == float("-inf"), 0.0, m)
    inv_s = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)
    return tl.exp2((x - ref[:, None]) * SCALE) * inv_s[:, None]


@triton.jit
def _lse_log2(lse):
    # base-2 LSE; +inf where a row saw nothing, so that its probabilities come out 0, not NaN
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


# --------------------------------------------------------------------------- torch twins
def _ref_point(m: torch.Tensor) -> torch.Tensor:
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


def _merge_ref(m: torch.Tensor) -> torch.Tensor:
    # twin of _merge_point: 0 where the union's maximum is ±inf
    return torch.where(m.isinf(), torch.zeros_like(m), m)


def torch_rescale(m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`rescale` in natural units: ``e^(m_old − m_new)``."""
    return torch.exp(m_old - _ref_point(m_new))


def torch_tile_stats(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`tile_stats`: ``(m, s)`` of ``x`` along ``dim`` (kept out of the result)."""
    m = x.amax(dim)
    return m, torch.exp(x - _ref_point(m).unsqueeze(dim)).sum(dim)


def torch_online_update(
    m: torch.Tensor, s: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of :func:`online_update` for ``x`` of shape ``(..., C)`` and ``m, s`` of ``(...)``."""
    m_new = torch.maximum(m, x.amax(-1))
    ref = _ref_point(m_new)
    alpha = torch.exp(m - ref)
    p = torch.exp(x - ref.unsqueeze(-1))
    return m_new, s * alpha + p.sum(-1), alpha, p


def torch_fixed_update(
    m: torch.Tensor, s: torch.Tensor, x: torch.Tensor, p_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`fixed_update` for ``x`` of shape ``(..., C)`` and ``m, s`` of ``(...)``;
    ``p_dtype``: round ``p`` to it before summing (None: keep ``x``'s precision)."""
    p = torch.exp(x - m.unsqueeze(-1))
    if p_dtype is not None:
        p = p.to(p_dtype).to(x.dtype)
    return s + p.sum(-1), p


def merge(
    m_a: torch.Tensor, s_a: torch.Tensor, m_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two online-softmax pairs computed over disjoint sets (natural log).

    Args:
        m_a, s_a: running maximum and ``Σ e^(x − m_a)`` of the first set, any broadcastable shape.
        m_b, s_b: the same for the second set.

    Returns:
        ``(m, s)`` of the union: ``m = max(m_a, m_b)``, ``s = s_a e^(m_a − m) + s_b e^(m_b − m)``.
        ``(−inf, 0)`` is the identity; two empty sets give ``(−inf, 0)``, never NaN. Where a part
        holds +inf (``m = +inf``), ``s`` is taken against 0 instead of ``m`` and is +inf, so
        ``m + log s`` is +inf, as ``torch.logsumexp`` of the union.
    """
    m = torch.maximum(m_a, m_b)
    ref = _merge_ref(m)
    return m, s_a * torch.exp(m_a - ref) + s_b * torch.exp(m_b - ref)


def torch_finalize_lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`finalize_lse` in natural units: ``m + log s``; +inf where ``m`` is."""
    return torch.where(m == math.inf, m, m + torch.log(s))


def merge_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets into the exact result.

    Each partial is ``o = softmax(S_part) V_part`` with ``lse = logsumexp(S_part)``, so
    ``(m, s) = (lse, 1)`` is its online pair and the merge weights are ``e^(lse_part − lse)``.

    Args:
        o_a, o_b: ``(..., n, d)`` partial outputs (any float dtype).
        lse_a, lse_b: ``(..., n)`` natural-log LSE of each part; −inf where a part saw no key.

    Returns:
        ``(o, lse)``: ``o`` ``(..., n, d)`` in ``o_a``'s dtype, ``lse`` ``(..., n)`` fp32.
        Rows that saw no key in either part give ``o = 0``, ``lse = −inf``; a part whose LSE is
        +inf (a score of +inf) gives ``lse = +inf`` (and ``o`` NaN, as torch's attention).
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    ref = _merge_ref(m)
    w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    total = w_a + w_b
    lse = m + torch.log(total)
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    o = (o_a.float() * (w_a * inv).unsqueeze(-1) + o_b.float() * (w_b * inv).unsqueeze(-1)).to(
        o_a.dtype
    )
    return o, lse


def torch_probs_from_lse(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`probs_from_lse` in natural units: ``e^(x − lse)`` along the last axis of
    ``x``; 0 for rows whose ``lse`` is −inf."""
    safe = torch.where(lse == -math.inf, math.inf, lse)
    return torch.exp(x - safe.unsqueeze(-1))
