"""The dense Hopper (Gluon) backend: the forward's and the fused backward's plans (:func:`plan_fwd`,
:func:`plan_bwd`) over their bound launches (:func:`plan_fwd_hopper`, :func:`plan_bwd_hopper`),
each built at its first launch, falling back to the Triton kernels where this Triton cannot
build it. The kernels and their tables live in
:mod:`flashlite.kernels.attention.hopper` and :mod:`~flashlite.kernels.attention.hopper_bwd`;
nothing here runs unless their ``available()`` says Gluon is there."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from torch import Tensor

from flashlite import _launch
from flashlite._caches import register
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.backends.common import hopper_launch_config
from flashlite.ops.attention.backends.common_bwd import Grads, PlainBwd
from flashlite.ops.attention.backends.common_gluon import NO_TABLES, descriptor, first_build
from flashlite.ops.attention.plan import LaunchInfo, Plan, Workspace
from flashlite.ops.attention.request import Request


def plan_fwd_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float,
    config: KH.HopperConfig,
    sinks: bool = False,
) -> Callable[..., None]:
    """``run(q, k, v, o, lse, sinks=None)`` for tensors shaped, strided and aligned as ``q``,
    ``k`` are (and ``v`` as ``k``, ``o`` as ``q``): the grid, options and bound launch fixed
    here. Writes ``o`` ``(B, Hq, Nq, D)`` and the contiguous fp32 ``lse`` ``(B, Hq, Nq)``;
    with ``sinks`` every call passes the fp32 ``(Hq,)`` sink logits. No checks:
    the caller has validated the inputs and that TMA can read them (16-bit, a head dim with a
    :data:`~flashlite.kernels.attention.hopper.CONFIGS` entry, 16-byte aligned strides). The
    descriptors are the launcher's business (:meth:`~flashlite._launch.Launcher.bind_tensors`)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    half, bn = config.block_m // 2, config.block_n
    grid = (triton.cdiv(nq, config.block_m), b * hq, 1)
    rest = (hq, hq // hkv, nq, nk, scale, *NO_TABLES)
    options = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": bn,
        "STAGES": config.stages,
        "IS_CAUSAL": causal,
        "HAS_SINKS": sinks,
        "num_warps": 4,
    }
    kernel = _launch.launcher(KH._attention_fwd_hopper_kernel)
    bound: list[Callable[..., None]] = []

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> None:
        sink_src = lse if sinks is None else sinks  # (a placeholder without sinks: never read)
        if not bound:  # the first call binds (descriptors of these tensors as templates)
            templates = (
                descriptor(q, half),
                descriptor(k, bn),
                descriptor(v, bn),
                descriptor(o, half),
            )
            bound.append(kernel.bind_tensors((*templates, lse, sink_src, *rest), options))
        bound[0](grid, q, k, v, o, lse, sink_src, *rest)

    return run


def plan_bwd_hopper(
    qs: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
) -> Callable[..., None]:
    """``run(qs, k, v, do, lse, delta, dq, dk, dv, acc)`` for tensors shaped, strided and aligned
    as these are (``v`` as ``k``, ``dq`` as ``qs``): dQ, dK, dV into ``dq``, ``dk``, ``dv``.
    ``qs``: the preprocess's ``Q·scale·log2 e`` ``(B, Hq, Nq, D)`` (it may be ``dq``'s memory:
    the kernel reads it before dQ is written); ``lse`` and ``delta``: dense fp32 ``(B, Hq, Nq)``.
    ``acc``: dQ's dense fp32 accumulator ``(B, Hq, Nq, D)``, zeros (the preprocess wrote them),
    the extra memory this kernel needs. The grid, options, descriptor
    blocks and bound launch are fixed here. No checks: the caller has validated the inputs and
    that TMA can read them (16-bit, D in the kernel's ``HEAD_DIMS``, 16-byte aligned strides,
    unit last strides)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(nk, KHB.BLOCK_N) * b * hkv, 1, 1)
    rest = (*dk.stride()[:3], *dv.stride()[:3], hq, hkv, hq // hkv, nq, nk, scale, *NO_TABLES)
    options = {
        "STAGES": KHB.STAGES,
        "GROUP_H": KHB.CAUSAL_GROUP_H if causal else 1,
        "IS_CAUSAL": causal,
        "num_warps": 4,
    }
    kernel = _launch.launcher(KHB._attention_bwd_hopper_kernel)
    bound: list[Callable[..., None]] = []

    def run(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        acc: torch.Tensor,
    ) -> None:
        if not bound:  # the first call binds (descriptors of these tensors as templates)
            templates = (
                descriptor(qs, KHB.BLOCK_M, d),
                descriptor(do, KHB.BLOCK_M, d),
                descriptor(k, KHB.BLOCK_N, d),
                descriptor(v, KHB.BLOCK_N, d),
                descriptor(acc, KHB.BLOCK_M, d // 2),
            )
            bound.append(kernel.bind_tensors((*templates, lse, delta, dk, dv, *rest), options))
        bound[0](grid, qs, do, k, v, acc, lse, delta, dk, dv, *rest)
        dq.copy_(acc)  # the kernel added scale·dS·K: only the rounding is left

    return run


#: Kernel variants whose first launch failed (a Triton whose Gluon differs): the Triton kernel
#: runs them instead, after one warning.
fwd_failed: set[tuple] = register("attention.hopper_failed", set())


def plan_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    request: Request,
    config: KH.HopperConfig,
    fallback: Callable[[], Plan],
) -> Plan:
    """The dense Gluon forward's plan for ``(B, H, N, D)`` views of these kinds (a plain or
    causal request, sinks allowed; TMA can read the tensors). Its first launch builds the
    kernel; where this Triton cannot (warned once), the plan becomes ``fallback()``."""
    causal, sinks = request.mask.is_causal, request.sinks is not None
    key = (q.dtype, causal, config, sinks)
    grid = (triton.cdiv(q.shape[2], config.block_m), q.shape[0] * q.shape[1], 1)
    info = LaunchInfo(hopper_launch_config(config), q.shape[-1], True)

    def first(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
        def build() -> Callable[..., None]:
            run = plan_fwd_hopper(q, k, causal, r.scale, config, sinks)
            run(q, k, v, o, lse, r.sinks)
            return run

        run = first_build(fwd_failed, key, "attention", build, stacklevel=5)
        if run is None:
            plan.become(fallback())
            plan.launch(q, k, v, o, lse, r)
            return

        def steady(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
            run(q, k, v, o, lse, r.sinks)

        plan.launch, plan.fallback = steady, None

    plan = Plan("hopper", first, config, True, grid, info=info, fallback=fallback)
    return plan


#: Fused-backward variants whose first launch failed to build: the Triton kernels run them.
bwd_failed: set[tuple] = register("attention.hopper_bwd_failed", set())


def plan_bwd(
    q: torch.Tensor, k: torch.Tensor, request: Request, fallback: Callable[[], Plan]
) -> Plan:
    """The fused Gluon backward's plan for a plain request (sinks allowed) on tensors where it
    applies (:func:`~flashlite.ops.attention.backends.common.hopper_bwd_applies`): the
    preprocess, then one kernel for dQ, dK and dV. Its first launch builds the kernel; where
    this Triton cannot (warned once), the plan becomes ``fallback()``."""
    b, hq, nq, d = q.shape
    causal, scale = request.causal, request.scale
    key = (q.dtype, d, causal)

    def first(
        qs: Tensor,
        k: Tensor,
        v: Tensor,
        do: Tensor,
        lse: Tensor,
        delta: Tensor,
        dq: Tensor,
        dk: Tensor,
        dv: Tensor,
        acc: Tensor,
    ) -> Callable[..., None] | None:
        def build() -> Callable[..., None]:
            run = plan_bwd_hopper(qs, k, do, dk, dv, causal, scale)
            run(qs, k, v, do, lse, delta, dq, dk, dv, acc)
            return run

        return first_build(bwd_failed, key, "fused attention backward", build, stacklevel=6)

    frame = PlainBwd(q, causal, scale, True, first)

    def launch(*args: object) -> Grads:
        grads = frame(*args)  # type: ignore[arg-type]
        if grads is not None:
            plan.launch, plan.fallback = frame, None
            return grads
        plan.become(fallback())
        return plan.launch(*args)

    grid = (triton.cdiv(k.shape[2], KHB.BLOCK_N) * b * k.shape[1], 1, 1)
    scratch = (
        Workspace("delta", frame.delta_shape, torch.float32),
        Workspace("dq_accumulator", (b, hq, nq, d), torch.float32),
    )
    plan = Plan(
        "hopper", launch, (KHB.BLOCK_M, KHB.BLOCK_N), True, grid, 1, scratch, None, fallback
    )
    return plan
