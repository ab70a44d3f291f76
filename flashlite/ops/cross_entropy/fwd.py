"""The cross-entropy launchers: the forward (per-row losses, LSE, the gradient written in the same
pass), the backward's scaling, and the gradient scale a unit loss sends each row (the mean's
divisor, counted on the device with the target check)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from flashlite import _backend, _launch
from flashlite.kernels import cross_entropy as K
from flashlite.ops.common import on_compute_device
from flashlite.ops.cross_entropy.checks import _bad_record, _host_flag, _report_bad_targets
from flashlite.ops.cross_entropy.plan import (
    _aligned,
    _gluon_applies,
    _plan_bwd,
    _plan_prefetch,
    _plan_triton_fwd,
    _plans,
    _reduced,
    _unit_scale,
)


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    grad: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on ``(N, V)`` logits (any strides), ``(N,)`` targets: returns
    the fp32 per-row losses and LSE ``(N,)`` and writes the per-row gradient, times the fp32
    1-element ``grad_scale``, into ``grad`` ``(N, V)`` (which may be ``logits``); a 2-element
    ``grad_scale`` also scales the z-loss by its second element (:func:`_z_scaled`). No checks.
    (:func:`cross_entropy_fwd_eager` with the scale given, nothing checked, nothing reduced.)"""
    losses, lse, _ = cross_entropy_fwd_eager(
        logits,
        target,
        weight,
        grad,
        grad_scale,
        None,
        "none",
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )
    return losses, lse


@on_compute_device
def cross_entropy_fwd_eager(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    bad: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An eager call's whole forward: :func:`cross_entropy_fwd` with the gradient scale
    worked out here unless given (``1/Σ`` of the kept targets' weights for a ``mean``, else 1;
    with the z-loss's scale too where :func:`_z_scaled`),
    bad targets recorded in ``bad`` (:func:`cross_entropy_scale`), and the loss reduced: returns
    the per-row losses, the LSE and the fp32 0-dim loss (None for ``"none"``). On the Gluon
    path all of it is one launch (the host time before the kernel starts is what a host-bound
    step waits for); otherwise the scale kernel, the forward kernel and a torch sum."""
    n, v = logits.shape
    mean = reduction == "mean"
    if n == 0:
        losses = logits.new_empty((0,), dtype=torch.float32)
        nothing = math.nan if mean else 0.0
        return (
            losses,
            torch.empty_like(losses),
            None if reduction == "none" else losses.new_full((), nothing),
        )
    opts = (ignore_index, float(label_smoothing), float(z_loss), float(softcap))
    key = (
        "eager",
        logits.device,
        logits.dtype,
        grad.dtype,
        target.dtype,
        n,
        v,
        logits.stride(),
        grad.stride(),
        None if weight is None else weight.dtype,
        reduction,
        None if grad_scale is None else grad_scale.numel(),
        bad is None,
        _aligned(logits, target, weight, grad_scale, grad, bad),
        *opts,
    )
    run = _plans.made(
        key, _plan_eager, logits, target, weight, grad, grad_scale, bad, reduction, opts
    )
    return run(logits, target, weight, grad, grad_scale, bad)


def _plan_eager(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    bad: torch.Tensor | None,
    reduction: str,
    opts: tuple[int, float, float, float],
) -> Callable[..., Any]:
    """``run(logits, target, weight, grad, grad_scale, bad)`` for :func:`cross_entropy_fwd_eager`
    calls like this one."""
    n, v = logits.shape
    mean, reduce = reduction == "mean", reduction != "none"
    device = logits.device
    if _gluon_applies(logits, weight, grad, opts[3]):
        count = mean and grad_scale is None
        # a mean's sum is scaled in the kernel whether it counted the divisor or was given it
        mode = (count, bad is not None, 2 if mean else int(reduce))
        launch = _plan_prefetch(logits, target, grad, opts, mode)

        def fused(logits, target, weight, grad, grad_scale, bad):  # noqa: ANN001, ANN202
            losses = logits.new_empty((n,), dtype=torch.float32)
            lse = logits.new_empty((n,), dtype=torch.float32)
            out = losses.new_empty(()) if reduce else None
            if grad_scale is None and not count:
                grad_scale = _unit_scale(device)
            launch(logits, target, grad_scale, grad, losses, lse, bad, out)
            return losses, lse, out

        return fused
    unit = _unit_scale(device)
    given = grad_scale is not None
    z_scale = grad_scale.numel() == 2 if given else _z_scaled(weight, mean, opts[2])
    fwd = _plan_triton_fwd(logits, target, weight, unit, grad, opts, z_scale)

    def apart(logits, target, weight, grad, grad_scale, bad):  # noqa: ANN001, ANN202
        if grad_scale is None:
            grad_scale = unit
            if mean or bad is not None:
                grad_scale = cross_entropy_scale(target, weight, v, opts[0], mean, bad, z_scale)
        losses = logits.new_empty((n,), dtype=torch.float32)
        lse = logits.new_empty((n,), dtype=torch.float32)
        fwd(logits, target, weight, grad_scale, grad, losses, lse)
        return losses, lse, _reduced(losses, grad_scale, reduction)

    return apart


@on_compute_device
def cross_entropy_bwd(grad: torch.Tensor, out: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """``out = grad·dloss``: the stored ``(N, V)`` gradient of a unit loss times the incoming
    gradient, one scalar (a mean or a sum) or one per row ``(N,)`` (any stride). With ``out`` =
    ``grad``, rows whose incoming gradient is exactly 1 are left as they are (no bytes moved).
    Returns ``out``."""
    n, v = grad.shape
    if n == 0:
        return out
    d = dloss if dloss.dim() <= 1 else dloss.reshape(-1)  # (a 0-dim one is read as a pointer)
    if d.dtype != torch.float32:
        d = d.float()
    stride_l = d.stride(0) if d.numel() > 1 else 0
    skip = out.data_ptr() == grad.data_ptr()
    key = (
        "bwd",
        grad.device,
        grad.dtype,
        out.dtype,
        n,
        v,
        grad.stride(),
        out.stride(),
        stride_l,
        skip,
        _aligned(grad, out, d),
    )
    _plans.made(key, _plan_bwd, grad, out, d, stride_l, skip)(grad, out, d)
    return out


@on_compute_device
def cross_entropy_scale(
    target: torch.Tensor,
    weight: torch.Tensor | None,
    n_classes: int,
    ignore_index: int,
    mean: bool,
    bad: torch.Tensor | None,
    z_scale: bool = False,
) -> torch.Tensor:
    """The fp32 0-dim gradient scale a unit loss sends each row (``1/Σ`` of the kept targets'
    weights for a mean, of either sign, inf for a zero sum; else 1), from the ``(N,)`` targets
    in one launch;
    with ``bad`` (int64 ``(3,)`` on the compute device), the first target outside
    ``[0, V)`` that is not ``ignore_index`` is recorded there as ``(1, class, V)``, unless one
    is recorded already (and, for a device's record, flagged in its host flag). With
    ``z_scale`` (a weighted mean with z-loss, :func:`_z_scaled`): ``(2,)``, that scale and the
    z-loss's, ``Σ w / count`` of the kept targets (0 when none is kept)."""
    scale = target.new_empty((2,) if z_scale else (), dtype=torch.float32)
    n = target.shape[0]
    if n == 0:  # (a mean of nothing is NaN; nothing to check)
        scale.fill_(math.nan if mean else 1.0)
        if z_scale:
            scale[1] = 0.0
        return scale
    weight = weight if weight is not None else scale  # (stand-ins: never read)
    seen = _host_flag(bad) if bad is not None else scale
    bad = bad if bad is not None else scale
    rest = (n, n_classes, ignore_index)
    key = (
        "scale",
        target.device,
        target.dtype,
        weight.dtype,
        *rest,
        mean,
        bad is not scale,
        weight is not scale,
        z_scale,
        _aligned(target, weight, bad),
    )

    def plan() -> Callable[..., None]:
        options = dict(
            MEAN=mean,
            HAS_WEIGHT=weight is not scale,
            CHECK=bad is not scale,
            BLOCK=K.SCALE_BLOCK,
            Z_SCALE=z_scale,
            num_warps=4,
        )
        bound = _launch.launcher(K._cross_entropy_scale_kernel).bind(
            (target, weight, scale, bad, bad, *rest), options
        )
        return lambda *a: bound((1, 1, 1), *a, *rest)

    _plans.made(key, plan)(target, weight, scale, seen, bad)
    return scale


def _scale_and_check(
    target: torch.Tensor,
    weight: torch.Tensor | None,
    n_classes: int,
    ignore_index: int,
    mean: bool,
    z_scale: bool = False,
) -> torch.Tensor:
    """The gradient scale (:func:`cross_entropy_scale`) with the targets checked in the same
    launch, waited for: a bad target raises here (``validate="sync"``, CPU tensors and linear
    cross-entropy). A bad target an earlier call recorded is reported first, as that call's."""
    device = _backend.compute_device(target.device)
    _report_bad_targets(device, True, ignore_index, earlier=True)
    scale = cross_entropy_scale(
        target, weight, n_classes, ignore_index, mean, _bad_record(device)[0], z_scale
    )
    _report_bad_targets(device, True, ignore_index, earlier=False)
    return scale


def _traced_scale(
    target: torch.Tensor,
    weight: torch.Tensor | None,
    n_classes: int,
    ignore_index: int,
    mean: bool,
    z_scale: bool = False,
) -> torch.Tensor:
    """:func:`cross_entropy_scale` without the check, in torch ops (what a trace can hold): the
    incoming gradient a unit loss sends each row, ``1/Σ`` of the kept targets' weights for a
    mean (torch's weighted mean), else 1; with ``z_scale``, and the z-loss's scale."""
    if not mean:
        return torch.ones((), dtype=torch.float32, device=target.device)
    denom = _mean_divisor(target, weight, n_classes, ignore_index)
    if not z_scale:
        return 1.0 / denom
    return torch.stack((1.0 / denom, _z_ratio(target, denom, ignore_index)))


def _z_scaled(weight: torch.Tensor | None, mean: bool, z_loss: float) -> bool:
    """Whether the z-loss needs a scale of its own: a mean divides the cross-entropy by the kept
    targets' class weights (torch's weighted mean) but the z-loss by their count (it bounds each
    row's LSE, whatever the target's class: Liger's convention, PaLM's definition); the kernel
    adds ``z·r·lse²`` to a row, ``r = Σ w / count`` (:func:`_z_ratio`), so that dividing the
    rows' sum by ``Σ w`` gives both. Without class weights the two divisors are one."""
    return weight is not None and mean and z_loss > 0


def _z_ratio(target: torch.Tensor, denom: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``r = Σ w / count`` of the kept targets from the mean's divisor ``denom = Σ w``, in torch
    ops; 0 when none is kept (their rows' gradients stay 0, not 0/0)."""
    count = (target != ignore_index).sum(dtype=torch.float32)
    return torch.where(count > 0, denom / count.clamp(min=1.0), 0.0)


def _mean_divisor(
    target: torch.Tensor, weight: torch.Tensor | None, n_classes: int, ignore_index: int
) -> torch.Tensor:
    """torch's divisor of a mean, in torch ops: the kept targets' count, or the sum of their
    class weights (a bad target's weight read at a clamped class: its row is NaN anyway)."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum(dtype=torch.float32)
    return torch.where(kept, weight.float()[target.clamp(0, n_classes - 1)], 0.0).sum()
