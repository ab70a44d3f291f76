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
kernels run as before. The band's tables and its mask function are
:mod:`flashlite.masking.band`'s.
"""

from __future__ import annotations

import torch

from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.masking import masks
from flashlite.masking.band import band_tables
from flashlite.ops.attention.flex import flex_bwd_body, flex_fwd_body, table_request
from flashlite.ops.attention.flex_plan import Grads
from flashlite.ops.attention.plan import (
    descriptor_ok,
    hopper_bwd_applies,
    hopper_config,
    small_problem,
)

__all__ = ["fwd_config", "bwd_block", "window_fwd", "window_bwd"]


def fwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> KH.HopperConfig | None:
    """The Gluon forward's config where a window forward of these ``(B, H, N, D)`` views runs
    the flex Hopper kernel, else None: the dense forward's rule (enough work for TMA to pay,
    tensors TMA can read, :func:`~flashlite.ops.attention.plan.hopper_config`)."""
    if small_problem(q, k) or not descriptor_ok(q, k, v):
        return None
    return hopper_config(q, k.shape[2])


def bwd_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
) -> tuple[int, int] | None:
    """The tables' tile where a window backward of these views runs the fused flex backward
    (:func:`~flashlite.ops.attention.plan.hopper_bwd_applies`; its gradients are allocated
    like ``q``, ``k`` and ``v``), else None."""
    return (2 * KHB.BLOCK_M, KHB.BLOCK_N) if hopper_bwd_applies(q, k, v, do, k, v) else None


def window_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    km: masks.KernelMask,
    scale: float,
    block: tuple[int, int],
) -> tuple[torch.Tensor, ...]:
    """``(o, lse)`` of a window forward on ``(B, H, N, D)`` views: flex's forward over the band's
    tables of ``block`` tiles."""
    band = band_tables(km, q.shape[2], k.shape[2], block, q.device)
    return flex_fwd_body(q, k, v, table_request(band, scale))


def window_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    km: masks.KernelMask,
    scale: float,
    block: tuple[int, int],
) -> Grads:
    """``(dq, dk, dv)`` of a window backward: flex's backward over the band's tables."""
    band = band_tables(km, q.shape[2], k.shape[2], block, q.device)
    return flex_bwd_body(do, q, k, v, o, lse, dlse, table_request(band, scale))
