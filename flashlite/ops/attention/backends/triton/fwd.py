"""The Triton forward kernel's launch: its config (pinned, the measured table or the autotuner), its
arguments (descriptors or pointers), bound once for a call of mask scalars only."""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import fwd as K
from flashlite.masking import masks
from flashlite.ops.attention.backends.common import LaunchInfo, small_problem
from flashlite.ops.attention.backends.triton.config import (
    fixed_reference,
    triton_plan,
    tuned_kernel,
)
from flashlite.ops.attention.request import Request


def run_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: Request,
    use_desc: bool,
    config: C.Config | None,
    prescale_q: bool | None,
    bind: bool,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo, Callable[..., None] | None]:
    """The Triton forward kernel, launched: its config (pinned, the measured table or the
    autotuner); with ``bind`` (a call of mask scalars only) also its bound
    ``run(q, k, v, o, lse)`` for later calls of this kind (else None)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    km = request.mask.kernel(nq, nk)
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    small = small_problem(q, k)
    config, launch = triton_plan(
        q.device,
        q.dtype,
        d,
        km.IS_CAUSAL,
        small and not use_desc,
        use_desc,
        prescale_q,
        config,
        km.WINDOW,
        km.SOFTCAP,
        seqlens_k is not None,
        varlen is not None,
        fixed_reference(q.dtype, request.softcap, sinks),
        sinks is not None,
    )
    block_d = launch["BLOCK_D"]
    if use_desc:  # block shapes are set per config (set_block_shapes), placeholders here
        bm, bn = (config.block_m, config.block_n) if config is not None else (16, 16)
        srcs = _descriptors(q, k, v, o, bm, bn, block_d)
        if varlen is not None:  # O is stored through pointers (blocks cross sequences)
            srcs[3] = o
    else:
        srcs = [q, k, v, o]
    args = _kernel_args(srcs, q, k, v, o, lse, km, request)
    # packed sequences: one program row per sequence, as many query blocks as the longest has
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    if config is None:  # no measured entry here: the autotuner, per length bucket
        tuned = tuned_kernel(rows, nk)
        tuned[lambda meta: (C.cdiv(rows, meta["BLOCK_M"]), seqs * hq)](*args, **launch)  # type: ignore[index]
        return o, lse, LaunchInfo(C.Config.of(tuned.best_config), block_d, use_desc), None  # type: ignore[attr-defined]
    grid = (C.cdiv(rows, config.block_m), seqs * hq, 1)
    launcher = _launch.launcher(K._attention_fwd_kernel)
    info = LaunchInfo(config, block_d, use_desc)
    if not bind:
        launcher.bind(args, launch)(grid, *args)
        return o, lse, info, None
    # the plan's launch takes q, k, v, o themselves where its descriptors read them
    bound = launcher.bind_tensors(args, launch)
    tail = args[5:-4]  # strides, sizes, scale, mask values (then four placeholders)

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
    ) -> None:
        bound(grid, q, k, v, o, lse, *tail, lse, lse, lse, lse)

    run(q, k, v, o, lse)
    return o, lse, info, run


def _kernel_args(
    srcs: list,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    km: masks.KernelMask,
    request: Request,
) -> tuple:
    """The forward kernel's arguments: q, k, v, o (or their descriptors ``srcs``), the LSE,
    strides, sizes, the scale, the mask's values, then lengths, offsets and sinks (the LSE
    stands in for an absent one: never read)."""
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    lengths = seqlens_k if seqlens_k is not None else lse
    offsets = varlen[:2] if varlen is not None else (lse, lse)
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    sizes = (hq, hq // k.shape[1], nq, nk)
    mask = (request.scale, km.left, km.right, km.softcap)
    return (
        *srcs,
        lse,
        *strides,
        *sizes,
        *mask,
        lengths,
        *offsets,
        sinks if sinks is not None else lse,
    )


def _descriptors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    bm: int,
    bn: int,
    block_d: int,
) -> list[TensorDescriptor]:
    """The forward kernel's 4-D TMA descriptors of q, k, v, o (``[1, 1, rows, BLOCK_D]``
    blocks: ``bm`` query rows, ``bn`` keys)."""
    return [
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
        for t, r in ((q, bm), (k, bn), (v, bn), (o, bm))
    ]
