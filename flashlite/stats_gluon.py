"""The online-softmax pair of :mod:`flashlite.stats`, for Gluon kernels.

A ``@gluon.jit`` kernel cannot call the stats module's ``@triton.jit`` helpers (they build their
tiles with Triton's layouts), so this module holds Gluon twins of the helpers the Gluon kernels
use, each named after its :mod:`flashlite.stats` helper and doing the same arithmetic in the
same order: the reference point 0 where a maximum is −inf (for merges, ±inf), the same ``exp2``
arguments, the same LSE. A twin's tiles keep whatever layout the caller gave them.

Statistics are taken along a tile's last axis: an ``[R, C]`` tile gives ``[R]`` statistics, as
in :mod:`flashlite.stats`; a 1-D tile (one row's chunk, as the team kernels hold) gives scalars.

=====================  ====================================================================
``rescale``            ``2^((m_old − m_new)·SCALE)``; 0 when ``m_old`` is −inf
``online_update``      fold a tile into a running pair kept in exp2 units (attention's)
``tile_stats``         ``(m, s, p)`` of a fresh tile
``merge_partials``     the merge of partial pairs along the last axis
``finalize_lse``       natural-log LSE from a pair
``lse_log2``           a finished LSE in base 2, +inf for a row that saw nothing (the stats
                       module's private ``_lse_log2``)
``probs_from_lse_t``   normalised probabilities of a transposed tile from its columns' LSE
``probs_from_pair``    normalised probabilities of a tile from the finished pair
=====================  ====================================================================

``SCALE`` is a constexpr here (the Gluon kernels fold any runtime scale into their inputs), so
that ``finalize_lse`` takes ``SCALE·ln 2`` in double precision: ``LOG2E`` gives exactly 1, and
``m + ln s`` costs no multiply. ``FMA`` (16-bit data only) computes ``2^((x − ref)·SCALE)`` as
one fused ``x·SCALE − ref·SCALE``, whose rounded ``ref·SCALE`` is off by up to ``|ref|·9e-8``
in the exponent: below a 16-bit result's rounding, not fp32's.

The module imports without Gluon (or with a Gluon that differs), on any machine: then
``GLUON_IMPORT_ERROR`` says why, and it holds no twins.
"""

from __future__ import annotations

from flashlite.stats import LN2, LOG2E

try:  # Gluon is experimental: absent or different in some Triton versions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    GLUON_IMPORT_ERROR: str | None = None
except Exception as err:  # noqa: BLE001 - any failure means: not available
    GLUON_IMPORT_ERROR = f"{type(err).__name__}: {err}"

#: The twins, by name: each is a helper of :mod:`flashlite.stats` (``lse_log2``: ``_lse_log2``).
TWINS = (
    "rescale",
    "online_update",
    "tile_stats",
    "merge_partials",
    "finalize_lse",
    "lse_log2",
    "probs_from_lse_t",
    "probs_from_pair",
)
__all__ = ["GLUON_IMPORT_ERROR", "TWINS", *(TWINS if GLUON_IMPORT_ERROR is None else ())]


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _per_row(v, x):
        # a row statistic against its tile: a column of an [R, C] tile; a 1-D tile's is a scalar
        if len(x.shape) == 2:
            v = gl.expand_dims(v, 1)
        return v

    @gluon.jit
    def _reference_point(m):
        # stats._reference_point: 0 instead of −inf, so that 2^(−inf − 0) = 0, not NaN
        return gl.where(m == float("-inf"), 0.0, m)

    @gluon.jit
    def _merge_point(m):
        # stats._merge_point: 0 where the union's maximum is ±inf
        return gl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)

    @gluon.jit
    def _exp2_from(x, ref, SCALE: gl.constexpr, FMA: gl.constexpr = False):
        # 2^((x − ref)·SCALE), ref one per row of x; subtract first unless FMA
        if FMA:
            return gl.exp2(x * SCALE - _per_row(ref * SCALE, x))
        else:
            return gl.exp2((x - _per_row(ref, x)) * SCALE)

    @gluon.jit
    def rescale(m_old, m_new, SCALE: gl.constexpr = 1.0):
        """``2^((m_old − m_new)·SCALE)``: moves a sum (or accumulator) taken against ``m_old``
        onto ``m_new``; 0 when ``m_old`` is −inf (:func:`flashlite.stats.rescale`)."""
        return gl.exp2((m_old - _reference_point(m_new)) * SCALE)

    @gluon.jit
    def online_update(m, s, x, UNITS: gl.constexpr = 1.0, shift=0.0, SHIFTED: gl.constexpr = False):
        """Fold the ``[R, C]`` tile ``x`` into the running pair ``(m, s)`` (each ``[R]``), kept
        in exp2 units of ``x·UNITS``: :func:`flashlite.stats.online_update` of ``x·UNITS`` with
        ``SCALE = 1``, returning ``(m_new, s_new, alpha, p)``. Attention's scores are in exp2
        units already (``UNITS = 1``) or in natural ones (``LOG2E``); the units go on the
        row maxima and inside exp2's argument, one fused multiply-add a score.

        ``SHIFTED``: the tile is ``x + shift`` (``shift`` one per row), the shift added to each
        row's maximum and taken out of its reference rather than added to every element."""
        row_max = gl.max(x, axis=1) * UNITS
        if SHIFTED:
            row_max = row_max + shift
        m_new = gl.maximum(m, row_max)
        alpha = rescale(m, m_new)
        ref = _reference_point(m_new)  # a row that saw nothing stays (−inf, 0)
        if SHIFTED:
            p = gl.exp2(x * UNITS - gl.expand_dims(ref - shift, 1))
        else:
            p = gl.exp2(x * UNITS - gl.expand_dims(ref, 1))
        return m_new, s * alpha + gl.sum(p, axis=1), alpha, p

    @gluon.jit
    def tile_stats(x, SCALE: gl.constexpr, FMA: gl.constexpr = False):
        """``(m, s, p)`` of a fresh tile along its last axis: ``m`` the maximum, ``p`` the
        exponentials ``2^((x − m)·SCALE)``, ``s`` their sum; ``(−inf, 0)`` for a row of −inf
        (:func:`flashlite.stats.tile_stats`)."""
        m = gl.max(x, axis=len(x.shape) - 1)
        p = _exp2_from(x, _reference_point(m), SCALE, FMA)
        return m, gl.sum(p, axis=len(x.shape) - 1), p

    @gluon.jit
    def merge_partials(m, s, SCALE: gl.constexpr):
        """Merge partial pairs along the last axis (:func:`flashlite.stats.merge_partials`):
        the common maximum first, then every partial sum moved onto it. Padding partials must
        be the identity (−inf, 0)."""
        m_all = gl.max(m, axis=len(m.shape) - 1)
        w = gl.exp2((m - _per_row(_merge_point(m_all), m)) * SCALE)
        return m_all, gl.sum(s * w, axis=len(m.shape) - 1)

    @gluon.jit
    def finalize_lse(m, s, SCALE: gl.constexpr):
        """Natural-log LSE ``m·SCALE·ln 2 + ln s``: −inf for an empty set, +inf where ``m`` is
        (:func:`flashlite.stats.finalize_lse`). ``SCALE·ln 2`` is a constexpr product: 1 for
        ``LOG2E`` (a pair in natural units), ``ln 2`` for 1 (a pair in exp2 units)."""
        return gl.where(m == float("inf"), m, m * (SCALE * LN2) + gl.log(s))

    @gluon.jit
    def lse_log2(lse):
        """A finished natural-log LSE in base 2; +inf where a row saw nothing (−inf), so that
        its probabilities come out 0, not NaN (``flashlite.stats._lse_log2``)."""
        return gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)

    @gluon.jit
    def probs_from_lse_t(xt, lse, SCALE: gl.constexpr, LSE_LOG2: gl.constexpr = False):
        """``2^(xt·SCALE − lse·log2 e)`` of a transposed ``[C, R]`` tile, the rows' LSE
        (``[R]``) running along its columns (:func:`flashlite.stats.probs_from_lse_t`).
        ``LSE_LOG2``: ``lse`` is :func:`lse_log2`'s already (a kernel that converts it once
        per row)."""
        if LSE_LOG2:
            lse2 = lse
        else:
            lse2 = lse_log2(lse)
        return gl.exp2(xt * SCALE - gl.expand_dims(lse2, 0))

    @gluon.jit
    def probs_from_pair(x, m, s, SCALE: gl.constexpr, FMA: gl.constexpr = False, weight=1.0):
        """``2^((x − m)·SCALE)·weight/s`` of a tile from its rows' finished pair
        (:func:`flashlite.stats.probs_from_pair`, whose ``weight`` is 1): exact near the row's
        maximum, where ``e^(x − lse)`` inherits the rounded LSE's error. ``weight`` (one per
        row) is folded into ``1/s``: one multiply an element. Rows that saw nothing give 0."""
        inv_s = gl.where(s > 0.0, 1.0 / gl.where(s > 0.0, s, 1.0), 0.0)
        return _exp2_from(x, _reference_point(m), SCALE, FMA) * _per_row(weight * inv_s, x)
