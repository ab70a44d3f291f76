"""Cross-entropy's custom ops (``flashlite::cross_entropy_fwd``, ``_fwd_inplace``, ``_bwd``) and
its autograd: :class:`_CrossEntropy` hands the gradient the forward wrote to the logits."""

from __future__ import annotations

import torch

from flashlite.ops.common import skip_dispatcher
from flashlite.ops.cross_entropy.fwd import _bwd_here, cross_entropy_bwd, cross_entropy_fwd
from flashlite.ops.cross_entropy.plan import _reduced


@torch.library.custom_op("flashlite::cross_entropy_fwd", mutates_args=("grad",))
def _ce_fwd_op(
    logits: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(logits, target, weight, grad_scale, grad, ignore_index,
                             label_smoothing, z_loss, softcap)  # fmt: skip


def _row_stats_fake(logits: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Both forward ops' fake: fp32 per-row losses and LSE."""
    return tuple(logits.new_empty((logits.shape[0],), dtype=torch.float32) for _ in range(2))  # type: ignore[return-value]


_ce_fwd_op.register_fake(_row_stats_fake)


@torch.library.custom_op("flashlite::cross_entropy_fwd_inplace", mutates_args=("logits",))
def _ce_fwd_inplace_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(logits, target, weight, grad_scale, logits, ignore_index,
                             label_smoothing, z_loss, softcap)  # fmt: skip


_ce_fwd_inplace_op.register_fake(_row_stats_fake)


@torch.library.custom_op("flashlite::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    return cross_entropy_bwd(grad, torch.empty_like(grad), dloss)


@_ce_bwd_op.register_fake
def _(grad, dloss):  # type: ignore[no-untyped-def]
    return torch.empty_like(grad)


class _CrossEntropy(torch.autograd.Function):
    """The forward writes the gradient of the returned (reduced) loss into a buffer of its own
    or, with ``inplace``, over the logits; the backward scales it there by the incoming
    gradient, if that is not 1, and hands it over as the logits' gradient. The reduction
    happens inside, so ``loss.backward()`` meets one node, not three. The ops that write the
    gradient declare the mutation, and a mutating custom op cannot carry an autograd formula,
    so the autograd side lives here. The in-place write goes through a detached alias, which
    shares the logits' version counter: a node that saved the logits for its own backward
    raises torch's "modified by an inplace operation" error instead of reading gradients."""

    @staticmethod
    def forward(ctx, logits, target, weight, grad_scale, opts):  # type: ignore[no-untyped-def, override]
        # (the options in one tuple: autograd's per-argument handling costs host time)
        ignore_index, label_smoothing, z_loss, softcap, inplace, reduction, grad, done = opts
        if done is not None:  # a plain eager call: the front-end launched the ops' bodies
            losses, lse, total = done
            if inplace:  # what the op's declared mutation would do
                torch.autograd.graph.increment_version(grad)
        else:
            kernel_opts = (ignore_index, label_smoothing, z_loss, softcap)
            grad = _grad_buffer(logits, inplace)
            if inplace:
                losses, lse = torch.ops.flashlite.cross_entropy_fwd_inplace.default(
                    grad, target, weight, grad_scale, *kernel_opts)  # fmt: skip
            else:
                losses, lse = torch.ops.flashlite.cross_entropy_fwd.default(
                    logits, grad, target, weight, grad_scale, *kernel_opts)  # fmt: skip
            total = _reduced(losses, grad_scale, reduction)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(grad)
        ctx.used = False
        return (losses if reduction == "none" else total), lse

    @staticmethod
    def backward(ctx, dloss, _dlse):  # type: ignore[no-untyped-def, override]
        if ctx.used:
            raise RuntimeError(
                "flashlite.cross_entropy's backward runs once: its gradient buffer is handed to "
                "the logits' gradient; run the forward again to differentiate again"
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        if skip_dispatcher(grad, dloss):  # eager: scaled where it is, and only if needed
            _bwd_here(grad, grad, dloss)  # (on the compute device: the front-end moved the call)
        else:  # traced (compile, AOT, fake tensors): the functional op, a new buffer
            grad = torch.ops.flashlite.cross_entropy_bwd.default(grad, dloss)
        return grad, None, None, None, None


def _grad_buffer(logits: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where the forward writes the gradient: a buffer of its own, or with ``inplace`` the
    logits through a detached alias (it shares their version counter)."""
    return logits.detach() if inplace else torch.empty_like(logits)
