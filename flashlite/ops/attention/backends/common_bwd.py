"""The plain backward's frame, shared by the backends that run one (``hopper``'s fused kernel,
``triton``'s pair): the gradients and the scratch allocated, the preprocess (delta, Qs), the
sinks' gradient, then the backend's main launch (:class:`PlainBwd`); and the sinks' gradient
itself (:func:`sink_grad`), which every backward with sinks computes beside its kernels."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashlite.ops.attention.backends.common import empty_output, plan_preprocess, prescales_q
from flashlite.ops.attention.request import Request

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sink_grad(
    sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None
) -> None:
    """The sinks' gradient into ``out`` (fp32 ``(Hq,)``): ``dsink_h = −Σ p_sink·delta`` over
    the batch and rows of head h, where ``p_sink = e^(sink_h − lse)`` is the probability the
    softmax gave the sink and ``delta = rowsum(dO ∘ O) − dlse`` the preprocess's (``lse``,
    ``delta``: ``(B, Hq, Nq)``). A row whose LSE is −inf (a sink of −inf that saw no key)
    gives the sink nothing."""
    assert out is not None, "the sinks' gradient needs its output"
    safe = torch.where(lse == -math.inf, math.inf, lse)
    p_sink = torch.exp(sinks.view(1, -1, 1) - safe)
    torch.sum(p_sink * delta, dim=(0, 2), out=out)
    out.neg_()


#: ``first(qs, k, v, do, lse, delta, dq, dk, dv, acc)``: a backend's first launch of its main
#: kernels, returning the bound ``main`` (same arguments) for later calls, or None where its
#: kernel failed to build here (warned once)
First = Callable[..., Callable[..., None] | None]


class PlainBwd:
    """A plain backward (no window, soft cap, lengths or packing; sinks allowed) for one kind of
    tensors, as a plan's launch ``(do, q, k, v, o, lse, dlse, request, dsinks)`` returning
    ``(dq, dk, dv)``, or None where the backend's kernel failed to build (its first call only).

    ``fused``: the main kernel takes dQ's dense fp32 accumulator, ``(B, Hq, Nq, D)``, which
    the preprocess zeroes. ``first`` binds the main launch at the first call (:data:`First`).
    """

    def __init__(
        self, q: torch.Tensor, causal: bool, scale: float, fused: bool, first: First
    ) -> None:
        b, hq, nq, d = q.shape
        self.causal, self.scale = causal, scale  # (causal: as the caller normalised it)
        self.prescale = prescales_q(q)
        self.delta_shape = (b, hq, nq)
        self.acc_shape = (b, hq, nq, d) if fused else None
        self.first = first
        self.prep: Callable[..., None] | None = None
        self.main: Callable[..., None] | None = None

    def __call__(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        dlse: torch.Tensor | None,
        request: Request,
        dsinks: torch.Tensor | None = None,
    ) -> Grads | None:
        dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
        # 16-bit inputs: the preprocess writes Qs (Q·scale·log2 e, as the forward rounded it)
        # into dq's memory; the dQ kernel reads each block of it before overwriting it with dQ
        qs = dq if self.prescale else q
        # an expanded or strided dlse (autograd may hand one over) is made dense, O(N)
        dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
        delta = torch.empty(self.delta_shape, device=q.device, dtype=torch.float32)
        acc = None
        if self.acc_shape is not None:
            acc = torch.empty(self.acc_shape, device=q.device, dtype=torch.float32)
        if self.prep is None:
            self.prep = plan_preprocess(o, do, dlse, delta, q, qs, self.scale, acc)
        self.prep(o, do, dlse, delta, q, qs, acc)
        lse = lse.contiguous()  # the kernels index the (B, Hq, Nq) statistics densely
        if request.sinks is not None:
            sink_grad(request.sinks, lse, delta, dsinks)
        if self.main is not None:
            self.main(qs, k, v, do, lse, delta, dq, dk, dv, acc)
            return dq, dk, dv
        self.main = self.first(qs, k, v, do, lse, delta, dq, dk, dv, acc)
        return None if self.main is None else (dq, dk, dv)


def empty_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
    dsinks: torch.Tensor | None = None,
) -> Grads:
    """The backward with nothing to compute (no row, or no key): zero gradients; with sinks,
    every row's probability is all its sink's, which takes the whole gradient."""
    if request.sinks is not None:
        delta = (do.float() * o.float()).sum(-1)
        sink_grad(request.sinks, lse, delta if dlse is None else delta - dlse, dsinks)
    return empty_output(q).zero_(), empty_output(k).zero_(), empty_output(v).zero_()
