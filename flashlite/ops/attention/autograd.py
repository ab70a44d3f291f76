"""Attention's two ops, stated once (:class:`~flashlite.ops._dispatch.Op`): the forward with its
autograd formula, and the backward, which has no derivative of its own."""

from __future__ import annotations

import torch

from flashlite.ops._dispatch import Op
from flashlite.ops.attention.bwd import _attention_bwd_body, _attention_bwd_fake
from flashlite.ops.attention.fwd import _attention_fwd_body, _attention_fwd_fake


def _no_second_derivative(ctx, *grads):  # type: ignore[no-untyped-def]
    raise NotImplementedError(
        "flashlite.attention has no second derivative: its backward is a kernel without an "
        "autograd formula of its own (torch.autograd.grad(..., create_graph=True) through it "
        "cannot be differentiated again)"
    )


#: ``flashlite::attention_bwd``: dq, dk, dv and the sinks' gradient. Its registered formula
#: refuses (clearer than torch's "no autograd formula" for op authors).
ATTENTION_BWD = Op("attention_bwd", _attention_bwd_body, fake=_attention_bwd_fake, inputs=7,
                   setup_context=lambda ctx, inputs, output: None,
                   backward=_no_second_derivative, moves=False)  # fmt: skip

#: where ``sinks`` sits among the forward op's arguments (after num_splits)
_SINKS = 14


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, causal, scale, *extras = inputs
    o, lse = output
    sinks = inputs[_SINKS] if len(inputs) > _SINKS else None
    ctx.save_for_backward(q, k, v, o, lse, sinks)  # O(N) beyond the tensors: nothing N×N
    ctx.n_extras = len(extras)
    ctx.causal, ctx.scale, ctx.extras = causal, scale, extras[:8]  # (num_splits: forward only)


def _backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def]
    """The gradients of q, k, v and the sinks (and None for every other argument)."""
    q, k, v, o, lse, sinks = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    if sinks is None:
        dq, dk, dv, _ = ATTENTION_BWD(grad_o, q, k, v, o, lse, grad_lse, ctx.causal, ctx.scale,
                                      *ctx.extras)  # fmt: skip
        return dq, dk, dv, None, None, *(None for _ in range(ctx.n_extras))
    extras = (*ctx.extras, *(None for _ in range(8 - len(ctx.extras))))
    dq, dk, dv, dsinks = ATTENTION_BWD(grad_o, q, k, v, o, lse, grad_lse, ctx.causal, ctx.scale,
                                       *extras, sinks)  # fmt: skip
    tail = [None] * ctx.n_extras
    tail[_SINKS - 5] = dsinks.to(sinks.dtype)
    return dq, dk, dv, None, None, *tail


#: ``flashlite::attention_fwd``: ``(out, lse)`` on ``(B, H, N, D)`` views, differentiable in
#: q, k, v, the sinks and through the LSE (an unused LSE's gradient stays None).
ATTENTION_FWD = Op("attention_fwd", _attention_fwd_body, fake=_attention_fwd_fake, inputs=3,
                   setup_context=_setup_context, backward=_backward, materialize_grads=False,
                   moves=False, grad_inputs=(_SINKS,))  # fmt: skip
