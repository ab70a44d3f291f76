"""The merge of two partial attention results over disjoint keys, ``(out, lse)`` each: the torch
twin (:func:`merge_torch`, :func:`flashlite.stats.merge_attention`) and the Triton kernel in one
launch (:func:`merge_kernel`, :mod:`flashlite.kernels.attention.shared_prefix`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashlite import _backend, _launch, stats
from flashlite.kernels import configs as C
from flashlite.kernels.attention import shared_prefix as KSP
from flashlite.ops.common import on_compute_device

#: an ``(out, lse)`` pair
Pair = tuple[torch.Tensor, torch.Tensor]


def merge_torch(parts: list[Pair]) -> Pair:
    """:func:`merge_kernel`'s torch twin: partials ``(B, Hq, Nq, D)`` / ``(B, Hq, Nq)`` over
    disjoint keys folded by :func:`flashlite.stats.merge_attention`; the output in the last
    partial's dtype."""
    o, lse = parts[-1]
    for o_a, lse_a in parts[:-1]:
        o, lse = stats.merge_attention(o, lse, o_a, lse_a)
    return o, lse


@on_compute_device
def merge_kernel(a: Pair, b: Pair, out: torch.Tensor) -> Pair:
    """Merge partials ``a`` and ``b`` (outputs ``(B, Hq, Nq, D)``, LSEs ``(B, Hq, Nq)``, any
    strides) into ``out`` ``(B, Nq, Hq, D)`` in one launch: ``(out, lse)``, the LSE fp32
    ``(B, Hq, Nq)``."""
    return bound_merge(a, b, out)(a, b, out)


def bound_merge(a: Pair, b: Pair, out: torch.Tensor) -> Callable[[Pair, Pair, torch.Tensor], Pair]:
    """:func:`merge_kernel` for partials and outputs strided as these are, its launch bound
    once (the caller keeps it for tensors of this kind)."""
    bsz, nq, hq, d = out.shape
    o_strides = (out.stride(0), out.stride(2), out.stride(1), out.stride(3))
    rest = (*a[0].stride(), *a[1].stride(), *b[0].stride(), *b[1].stride(), *o_strides, hq, nq)
    options = {
        "HEAD_DIM": d,
        "BLOCK_D": C.block_d(d),
        "ROUND_BF16": _backend.round_bf16(out.dtype),
        "num_warps": 4,
        "num_stages": 1,
    }
    grid = (bsz * hq, nq, 1)  # (B·Hq first: the grid's first axis has no 65535 limit)
    lse = torch.empty(bsz, hq, nq, dtype=torch.float32, device=out.device)
    bound = _launch.launcher(KSP._shared_prefix_merge_kernel).bind(
        (a[0], a[1], b[0], b[1], out, lse, *rest), options
    )

    def run(a: Pair, b: Pair, out: torch.Tensor) -> Pair:
        lse = torch.empty(bsz, hq, nq, dtype=torch.float32, device=out.device)
        if lse.numel():
            bound(grid, a[0], a[1], b[0], b[1], out, lse, *rest)
        return out, lse

    return run
