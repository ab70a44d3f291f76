"""Attention's two ops, stated once (:class:`~flashlite.ops._dispatch.Op`): the forward with its
autograd formula, and the backward, which has no derivative of its own. Both take q, k, v (and
the backward's tensors) and a :class:`~flashlite.ops.attention.request.Request`, whose fields are
the ops' named arguments."""

from __future__ import annotations

import torch

from flashlite.ops._dispatch import Op
from flashlite.ops.attention.bwd import BWD_FIELDS, attention_bwd_body, attention_bwd_fake
from flashlite.ops.attention.fwd import FWD_FIELDS, attention_fwd_body, attention_fwd_fake
from flashlite.ops.attention.request import Request


def _no_second_derivative(ctx, *grads):  # type: ignore[no-untyped-def]
    raise NotImplementedError(
        "flashlite.attention has no second derivative: its backward is a kernel without an "
        "autograd formula of its own (torch.autograd.grad(..., create_graph=True) through it "
        "cannot be differentiated again)"
    )


#: ``flashlite::attention_bwd``: dq, dk, dv and the sinks' gradient. Its registered formula
#: refuses (clearer than torch's "no autograd formula" for op authors).
ATTENTION_BWD = Op(
    "attention_bwd",
    attention_bwd_body,
    fake=attention_bwd_fake,
    inputs=7,
    request=Request,
    takes=BWD_FIELDS,
    setup_context=lambda ctx, inputs, request, output: None,
    backward=_no_second_derivative,
    moves=False,
)


def _setup_context(ctx, inputs, request: Request, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, request.sinks)  # O(N) beyond the tensors: nothing N×N
    # (the split is the forward's alone; the sinks travel as a saved tensor)
    plain = request.num_splits is None and request.sinks is None
    ctx.request = request if plain else request._replace(num_splits=None, sinks=None)


def _backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def]
    """The gradients of q, k, v and of the request's sinks."""
    q, k, v, o, lse, sinks = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    request = ctx.request if sinks is None else ctx.request._replace(sinks=sinks)
    dq, dk, dv, dsinks = ATTENTION_BWD(grad_o, q, k, v, o, lse, grad_lse, request)
    return (dq, dk, dv), {"sinks": None if sinks is None else dsinks.to(sinks.dtype)}


#: ``flashlite::attention_fwd``: ``(out, lse)`` on ``(B, H, N, D)`` views, differentiable in
#: q, k, v, the sinks and through the LSE (an unused LSE's gradient stays None).
ATTENTION_FWD = Op(
    "attention_fwd",
    attention_fwd_body,
    fake=attention_fwd_fake,
    inputs=3,
    request=Request,
    takes=FWD_FIELDS,
    grad_fields=("sinks",),
    setup_context=_setup_context,
    backward=_backward,
    materialize_grads=False,
    moves=False,
)
