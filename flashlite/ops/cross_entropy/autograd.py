"""Cross-entropy's ops, each stated once (:class:`~flashlite.ops._dispatch.Op`), and its autograd
(:func:`~flashlite.ops._dispatch.differentiable`): the forward writes the gradient of the
returned loss, the backward hands it over, scaled where it lies.

* ``flashlite::cross_entropy_fwd`` writes the gradient into a buffer of its own;
  ``flashlite::cross_entropy_fwd_inplace`` writes it over the logits. Both return the per-row
  losses, the LSE and the reduced loss (a 0-dim placeholder for ``"none"``), work out the
  gradient scale themselves unless given one (an eager call's fused path: one launch), and
  record a bad target in ``bad`` when given one (the device check).
* ``flashlite::cross_entropy_bwd_inplace`` scales the stored gradient by the incoming one where
  it lies (rows whose incoming gradient is exactly 1 are not touched), eager and traced alike:
  the buffer is the forward's own, nothing else reads it.
"""

from __future__ import annotations

import torch

from flashlite.ops._dispatch import Op, differentiable
from flashlite.ops.cross_entropy.fwd import cross_entropy_bwd, cross_entropy_fwd_eager


def _fwd(
    logits: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    bad: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    losses, lse, total = cross_entropy_fwd_eager(
        logits,
        target,
        weight,
        grad,
        grad_scale,
        bad,
        reduction,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )
    # (the reduced loss is 0-dim whatever the scale's shape; "none" has none: a placeholder)
    return losses, lse, total.reshape(()) if total is not None else losses.new_zeros(())


def _fwd_inplace(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    bad: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd(
        logits,
        logits,
        target,
        weight,
        grad_scale,
        bad,
        reduction,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )


def _row_stats_fake(logits: torch.Tensor, *_: object) -> tuple[torch.Tensor, ...]:
    """Both forward ops' fake: fp32 per-row losses and LSE, and the 0-dim reduced loss."""
    n = logits.shape[0]
    f32 = torch.float32
    return (
        logits.new_empty((n,), dtype=f32),
        logits.new_empty((n,), dtype=f32),
        logits.new_empty((), dtype=f32),
    )


CE_FWD = Op(
    "cross_entropy_fwd",
    _fwd,
    fake=_row_stats_fake,
    inputs=6,
    mutates_args=("grad", "bad"),
    moves=False,
)
CE_FWD_INPLACE = Op(
    "cross_entropy_fwd_inplace",
    _fwd_inplace,
    fake=_row_stats_fake,
    inputs=5,
    mutates_args=("logits", "bad"),
    moves=False,
)


def _bwd_inplace(grad: torch.Tensor, dloss: torch.Tensor) -> None:
    cross_entropy_bwd(grad, grad, dloss)


CE_BWD_INPLACE = Op(
    "cross_entropy_bwd_inplace",
    _bwd_inplace,
    fake=lambda grad, dloss: None,
    inputs=2,
    mutates_args=("grad",),
    moves=False,
)


def _forward(ctx, logits, target, weight, grad_scale, bad, opts):  # type: ignore[no-untyped-def]
    # (the options in one tuple: autograd's per-argument handling costs host time)
    ignore_index, label_smoothing, z_loss, softcap, inplace, reduction = opts
    kernel_opts = (reduction, ignore_index, label_smoothing, z_loss, softcap)
    if inplace:  # through a detached alias, which shares the logits' version counter
        grad = logits.detach()
        losses, lse, total = CE_FWD_INPLACE(grad, target, weight, grad_scale, bad, *kernel_opts)
    else:
        grad = torch.empty_like(logits)
        losses, lse, total = CE_FWD(logits, grad, target, weight, grad_scale, bad, *kernel_opts)
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(grad)
    ctx.used = False
    return (losses if reduction == "none" else total), lse


def _backward(ctx, dloss, _dlse):  # type: ignore[no-untyped-def]
    if ctx.used:
        raise RuntimeError(
            "flashlite.cross_entropy's backward runs once: its gradient buffer is handed to "
            "the logits' gradient; run the forward again to differentiate again"
        )
    ctx.used = True
    (grad,) = ctx.saved_tensors
    CE_BWD_INPLACE(grad, dloss)  # scaled where it lies
    return grad, None, None, None, None, None


#: The forward writes the gradient of the returned (reduced) loss into a buffer of its own or,
#: with ``inplace``, over the logits; the backward scales it there by the incoming gradient, if
#: that is not 1, and hands it over as the logits' gradient. The reduction happens inside, so
#: ``loss.backward()`` meets one node, not three. A node that saved the logits for its own
#: backward raises torch's "modified by an inplace operation" error instead of reading
#: gradients (the in-place write bumps the logits' version).
CrossEntropyFunction = differentiable("cross_entropy", _forward, _backward)
