"""The sliding window as a band of the score matrix, in block tables: query i sees key j iff
``lo <= j − i <= hi``. Its tables list, per query block, the few key tiles the band crosses (full
inside it, partial on its edges), with a mask function for the partial ones, so that flex's
kernels walk the band as the Triton window kernel does, tile by tile (the tables backend runs
them: :func:`~flashlite.ops.attention.backends.tables.fwd.plan_window_fwd` and
:func:`~flashlite.ops.attention.backends.tables.bwd.plan_window_bwd`). Because both are the flex
kernels over the same tables, a window written as a mask function
(:func:`flashlite.masking.gallery.sliding_window`) gives the built-in's bits. The tables are
built once per shape and band (:func:`band_tables`, on the device, in closed form:
:func:`band_classes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (the jit mask below runs with it in scope)

from flashlite._caches import Cache
from flashlite.masking import block_mask as BM
from flashlite.masking import masks
from flashlite.masking import mods as M

__all__ = ["band_tables", "band_classes"]


@triton.jit
def _band(b, h, q_idx, kv_idx, lo, hi):
    rel = kv_idx - q_idx  # (as masks.visible: the key's offset from the query)
    return (rel >= lo) & (rel <= hi)


def _band_t(b, h, q_idx, kv_idx, lo, hi):  # type: ignore[no-untyped-def]
    rel = kv_idx - q_idx
    return (rel >= lo) & (rel <= hi)


_bands: Cache = Cache("attention.window_bands", 32)


def band_tables(
    km: masks.KernelMask, nq: int, nk: int, block: tuple[int, int], device: torch.device
) -> BM.BlockMask:
    """The band of a window mask ``km`` (``WINDOW`` set: :meth:`~flashlite.masking.masks.Mask.
    kernel`, unlimited sides already far) as tables of ``block`` tiles on ``device``, its mask
    function with them; built once per (lengths, band, tile, device)."""
    lo, hi = (nk - nq) - km.left, (nk - nq) + km.right
    return _bands.made((nq, nk, lo, hi, block, device), _make_band, nq, nk, lo, hi, block, device)


def _make_band(
    nq: int, nk: int, lo: int, hi: int, block: tuple[int, int], device: torch.device
) -> BM.BlockMask:
    mod = M.mask_mod(
        _band, lo, hi, torch_fn=_band_t, name="flashlite.window.band", tile_reads=lambda bm, bn: 0
    )
    return BM.BlockMask.from_classes(
        band_classes(nq, nk, lo, hi, block, device), (nq, nk), block, mod
    )


def band_classes(
    nq: int, nk: int, lo: int, hi: int, block: tuple[int, int], device: torch.device | str
) -> torch.Tensor:
    """The classes of the band ``lo <= kv − q <= hi`` as :func:`~flashlite.masking.create.
    create_block_mask` makes them (rows past ``nq`` ignored, a tile crossing ``nk``
    never full), in closed form: a tile's pairs take every offset from its first key minus its
    last row to its last key minus its first row, so one comparison per tile edge decides it,
    with no pass over the pairs. ``(1, 1, nQ, nK)`` int8."""
    bm, bn = block
    r0 = torch.arange(0, nq, bm, device=device)[:, None]
    c0 = torch.arange(0, nk, bn, device=device)[None, :]
    r1, c1 = (r0 + bm).clamp(max=nq), (c0 + bn).clamp(max=nk)
    low, high = c0 - (r1 - 1), (c1 - 1) - r0  # the tile's smallest and largest offsets
    some = (high >= lo) & (low <= hi)
    every = (low >= lo) & (high <= hi) & (c1 - c0 == bn)
    classes = torch.where(every, BM.FULL, torch.where(some, BM.PARTIAL, BM.EMPTY))
    return classes.to(torch.int8)[None, None]
