"""The built-in sliding window, folded into :func:`~flashlite.ops.attention.flex.flex_attention`'s
Hopper kernels where they apply.

A window is a band of the score matrix: query i sees key j iff ``lo <= j − i <= hi``. Its block
tables list, per query block, the few key tiles the band crosses (full inside it, partial on
its edges): the flex kernels walk the band as the Triton window kernel does, tile by tile. On the
H200 they ran the band faster (forward 0.90×, forward + backward 0.945× the Triton window
kernels' time at N 16k, window 1024, D 128, bf16; ``benchmarks/results/mods-*.json``), so a
plain window call (no soft cap, lengths, packing, sinks, split or pinned config) runs them:

* forward, where the Gluon forward applies (:func:`fwd_config`), over tables of its tiles;
* backward, where the fused Gluon backward applies, over tables of its tiles.

Everywhere else (CPU, fp32, other head dims, deterministic algorithms) the Triton window
kernels run as before. Because both paths are the flex kernels over the same tables, a window
written as a mask function (:func:`flashlite.gallery.sliding_window`) gives the built-in's
bits. The tables are built once per shape and band (:func:`band_tables`, on the device, in
closed form: :func:`band_classes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (the jit mask below runs with it in scope)

from flashlite import block_mask as BM
from flashlite import masks
from flashlite import mods as M
from flashlite._caches import Cache
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.flex import _bwd_body, _fwd_body, op_tables
from flashlite.ops.attention.flex_plan import Grads
from flashlite.ops.attention.plan import (
    DESC_MIN_WORK,
    _descriptor_ok,
    hopper_bwd_applies,
    hopper_config,
)

__all__ = ["band_tables", "fwd_config", "bwd_block", "window_fwd", "window_bwd"]


@triton.jit
def _band(b, h, q_idx, kv_idx, lo, hi):
    rel = kv_idx - q_idx  # (as masks.visible: the key's offset from the query)
    return (rel >= lo) & (rel <= hi)


def _band_t(b, h, q_idx, kv_idx, lo, hi):  # type: ignore[no-untyped-def]
    rel = kv_idx - q_idx
    return (rel >= lo) & (rel <= hi)


_bands: Cache = Cache("attention.window_bands", 32)


def band_tables(km: masks.KernelMask, nq: int, nk: int, block: tuple[int, int],
                device: torch.device) -> BM.BlockMask:  # fmt: skip
    """The band of a window mask ``km`` (``WINDOW`` set: :meth:`flashlite.masks.Mask.kernel`,
    unlimited sides already far) as tables of ``block`` tiles on ``device``, its mask function
    with them; built once per (lengths, band, tile, device)."""
    lo, hi = (nk - nq) - km.left, (nk - nq) + km.right
    return _bands.made((nq, nk, lo, hi, block, device), _make_band, nq, nk, lo, hi, block, device)


def _make_band(nq: int, nk: int, lo: int, hi: int, block: tuple[int, int],
               device: torch.device) -> BM.BlockMask:  # fmt: skip
    mod = M.mask_mod(_band, lo, hi, torch_fn=_band_t, name="flashlite.window.band",
                     tile_reads=lambda bm, bn: 0)  # fmt: skip
    return BM.BlockMask.from_classes(band_classes(nq, nk, lo, hi, block, device), (nq, nk),
                                     block, mod)  # fmt: skip


def band_classes(nq: int, nk: int, lo: int, hi: int, block: tuple[int, int],
                 device: torch.device | str) -> torch.Tensor:  # fmt: skip
    """The classes of the band ``lo <= kv − q <= hi`` as :func:`~flashlite.ops.attention.
    block_mask.create_block_mask` makes them (rows past ``nq`` ignored, a tile crossing ``nk``
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


def fwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> KH.HopperConfig | None:
    """The Gluon forward's config where a window forward of these ``(B, H, N, D)`` views runs
    the flex Hopper kernel, else None: the dense forward's rule (enough work for TMA to pay,
    tensors TMA can read, :func:`~flashlite.ops.attention.plan.hopper_config`)."""
    b, h, nq, d = q.shape
    if b * h * nq * k.shape[2] * d < DESC_MIN_WORK or not _descriptor_ok(q, k, v):
        return None
    return hopper_config(q, k.shape[2])


def bwd_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              do: torch.Tensor) -> tuple[int, int] | None:  # fmt: skip
    """The tables' tile where a window backward of these views runs the fused flex backward
    (:func:`~flashlite.ops.attention.plan.hopper_bwd_applies`; its gradients are allocated
    like ``q``, ``k`` and ``v``), else None."""
    return (2 * KHB.BLOCK_M, KHB.BLOCK_N) if hopper_bwd_applies(q, k, v, do, k, v) else None


def window_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, km: masks.KernelMask,
               scale: float, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``(o, lse)`` of a window forward on ``(B, H, N, D)`` views: flex's forward over the band's
    tables of ``block`` tiles."""
    band = band_tables(km, q.shape[2], k.shape[2], block, q.device)
    return _fwd_body(q, k, v, *op_tables(band), scale)


def window_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               o: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
               km: masks.KernelMask, scale: float, block: tuple[int, int]) -> Grads:  # fmt: skip
    """``(dq, dk, dv)`` of a window backward: flex's backward over the band's tables."""
    band = band_tables(km, q.shape[2], k.shape[2], block, q.device)
    return _bwd_body(do, q, k, v, o, lse, dlse, *op_tables(band), scale)
