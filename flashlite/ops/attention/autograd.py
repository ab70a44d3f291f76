"""Attention's autograd: the custom op's formula and :class:`AttentionFunction`, the same formula
for unobserved eager calls without the dispatcher's host cost."""

from __future__ import annotations

from typing import Any

import torch

from flashlite.ops.attention.bwd import _attention_bwd_body, _attention_bwd_op
from flashlite.ops.attention.fwd import _attention_fwd_body, _attention_fwd_op
from flashlite.ops.common import plain_eager


def _no_second_derivative(ctx, *grads):  # type: ignore[no-untyped-def]
    raise NotImplementedError(
        "flashlite.attention has no second derivative: its backward is a kernel without an "
        "autograd formula of its own (torch.autograd.grad(..., create_graph=True) through it "
        "cannot be differentiated again)"
    )


# (a registered formula that refuses: clearer than torch's "no autograd formula" for op authors)
_attention_bwd_op.register_autograd(_no_second_derivative,
                                    setup_context=lambda ctx, inputs, output: None)  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, causal, scale, *extras = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # O(N) beyond the tensors: nothing N×N
    ctx.n_extras = len(extras)
    ctx.causal, ctx.scale, ctx.extras = causal, scale, extras[:8]  # (num_splits: forward only)


def _backward(ctx, grad_o, grad_lse, bwd=None):  # type: ignore[no-untyped-def]
    """The gradients of q, k, v through ``bwd`` (default: the op)."""
    q, k, v, o, lse = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = (bwd or _ATTENTION_BWD)(grad_o, q, k, v, o, lse, grad_lse, ctx.causal,
                                         ctx.scale, *ctx.extras)  # fmt: skip
    return dq, dk, dv, None, None, *(None for _ in range(ctx.n_extras))


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_ATTENTION_BWD = torch.ops.flashlite.attention_bwd.default
_ATTENTION_FWD = torch.ops.flashlite.attention_fwd.default


class AttentionFunction(torch.autograd.Function):
    """Eager autograd of attention around the ops' bodies: the same forward, saved tensors and
    backward as the custom op's autograd (``_setup_context``, ``_backward``), without the
    dispatcher's autograd wrapper and redispatch, which cost host time on every training call
    (felt at small shapes). Traced and observed calls take the op (:func:`plain_eager`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, *extras):  # type: ignore[no-untyped-def, override]
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None, as in the op
        o, lse = _attention_fwd_body(q, k, v, causal, scale, *extras)
        _setup_context(ctx, (q, k, v, causal, scale, *extras), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def, override]
        # create_graph: the op, which refuses a second derivative; else its body
        bwd = _ATTENTION_BWD if torch.is_grad_enabled() else _attention_bwd_body
        return _backward(ctx, grad_o, grad_lse, bwd)


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, *extras: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``flashlite::attention_fwd`` with autograd: in an unobserved eager call
    (:func:`plain_eager`) through :class:`AttentionFunction`, else through the op."""
    if plain_eager(q, k, v):
        return AttentionFunction.apply(q, k, v, causal, scale, *extras)
    return _ATTENTION_FWD(q, k, v, causal, scale, *extras)
