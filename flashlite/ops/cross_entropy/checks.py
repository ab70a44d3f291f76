"""Cross-entropy's argument checks, and the bad-target record: where the kernels note a target
outside ``[0, V)`` (on the device, with a host flag in pinned memory) and how it is reported."""

from __future__ import annotations

from typing import Any

import torch

from flashlite import _backend
from flashlite.ops.common import check_softcap, host_flag, overlapping, take_record, value_record

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("none", "mean", "sum")


def _bad_record(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Where the kernels record a bad target on ``device``, ``(flag, class, V)``, with its host
    flag (:func:`flashlite.ops.common.value_record`)."""
    return value_record("cross_entropy", device, 3)


def _host_flag(bad: torch.Tensor) -> torch.Tensor:
    """What a kernel that records a bad target in ``bad`` sets to 1 as well."""
    return host_flag("cross_entropy", bad)


def _report_bad_targets(device: torch.device, wait: bool, ignore_index: int, earlier: bool) -> None:
    """Raise the ``ValueError`` for a bad target recorded on ``device``: with ``wait`` once the
    device has finished, else only what the host flag already shows (nothing is waited for
    unless there is one). ``earlier``: the record can only be an earlier call's (this call's
    check is not launched yet), and the message says so."""
    record = take_record("cross_entropy", device, wait)
    if record is None:
        return
    _, cls, v = record
    if not earlier:
        raise ValueError(
            f"target holds class {cls}, outside [0, {v}) and not ignore_index={ignore_index}"
        )
    raise ValueError(
        f"an earlier flashlite cross-entropy call (cross_entropy, linear_cross_entropy) on "
        f"{device} had a target of class {cls}, "
        f"outside [0, {v}) and not its ignore_index: that call's loss and gradient rows are "
        "NaN. Targets are checked on the device without waiting for it, and a bad one is "
        "reported by a later call; validate='sync' reports it at the call itself"
    )


def _check(
    logits: object,
    target: object,
    weight: object,
    ignore_index: object,
    reduction: object,
    label_smoothing: object,
    z_loss: object,
    softcap: object,
) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in DTYPES:
        raise TypeError(
            f"logits has dtype {logits.dtype}; flashlite.cross_entropy accepts "
            "torch.float16, torch.bfloat16 and torch.float32"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices (torch.int64 or torch.int32), got "
            f"{target.dtype} (class probabilities are not supported)"
        )
    if logits.dim() not in (2, 3) or target.shape != logits.shape[:-1]:
        raise ValueError(
            f"logits (N, V) or (B, T, V) need target (N,) or (B, T): got logits "
            f"{tuple(logits.shape)} and target {tuple(target.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits must have at least one class (V >= 1)")
    if target.device != logits.device:
        raise ValueError(f"target must be on logits' device {logits.device}, got {target.device}")
    _backend.check_device(logits, "logits")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a float tensor, got {type(weight).__name__}")
        if weight.shape != (logits.shape[-1],) or weight.device != logits.device:
            raise ValueError(
                f"weight must be ({logits.shape[-1]},) on {logits.device}, got "
                f"{tuple(weight.shape)} on {weight.device}"
            )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {value!r}")
    if not 0.0 <= label_smoothing <= 1.0:  # type: ignore[operator]
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:  # type: ignore[operator]
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    check_softcap(softcap)


def _check_inplace(logits: torch.Tensor) -> None:
    """Refuse logits that ``inplace_backward`` cannot overwrite: ``(B, T, V)`` rows that make no
    ``(B·T, V)`` view (the kernel would write a copy, not the caller's memory; read from sizes
    and strides, which a trace holds) and memory whose elements overlap (writing one row's
    gradient would clobber rows still to be read). A leaf that requires grad is accepted, as
    flash-attn and Liger accept it: the flag is the caller's consent that its values are
    consumed, and the write goes through a detached alias (torch's version counter still
    catches a node that saved the logits for its own backward)."""
    if overlapping(logits):
        raise ValueError(
            f"inplace_backward=True needs logits whose elements do not share memory, got "
            f"overlapping or interleaved strides {logits.stride()} for shape "
            f"{tuple(logits.shape)} (the gradient written over one row would clobber others "
            "still to be read); pass logits.contiguous() or use inplace_backward=False"
        )
    if logits.dim() == 3:
        b, t = logits.shape[0], logits.shape[1]
        if not (b == 1 or t == 1 or logits.stride(0) == logits.stride(1) * t):
            raise ValueError(
                "inplace_backward needs logits whose rows form a (N, V) view (no copy), got "
                f"strides {logits.stride()} for shape {tuple(logits.shape)}"
            )
