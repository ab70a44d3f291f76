"""The backward :func:`attention_bwd`: the planner's choice carried out. The preprocess (delta,
Qs) first, then the fused Gluon kernel where it builds or the Triton pair (dK/dV, dQ), a plain
call planned once per kind of tensors (:class:`BwdPlan`); the window's tables backend; and the body
of the custom op ``flashlite::attention_bwd``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.ops.attention import planner
from flashlite.ops.attention.backends import hopper
from flashlite.ops.attention.backends.common import (
    HOPPER_ENV,
    bwd_preprocess,
    empty_output,
    hopper_bwd_applies,
    plan_preprocess,
    prescales_q,
)
from flashlite.ops.attention.backends.tables.bwd import window_bwd
from flashlite.ops.attention.backends.triton.bwd import bwd_dkdv, bwd_dq, plan_pair
from flashlite.ops.attention.backends.triton.config import bwd_config
from flashlite.ops.attention.checks import check_bwd_grads
from flashlite.ops.attention.request import Request, tensor_meta
from flashlite.ops.common import on_compute_device


@on_compute_device
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
    *,
    config: C.BwdConfig | None = None,
    dsinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output; q, o alike; k, v ``(B, Hkv, Nk, D)``.
        lse: the forward's fp32 ``(B, Hq, Nq)`` LSE; dlse: its gradient, or None.
        request: the forward's (:class:`~flashlite.ops.attention.request.Request`), without
            ``num_splits``. Its fp32 ``(Hq,)`` sinks need ``dsinks``, fp32 ``(Hq,)``, that
            receives their gradient (:func:`sink_grad`). The LSE the forward saved holds the
            sink, so the kernels themselves need nothing more.
        config: pin the kernels' tiles (the traffic tools count the GPU's on a CPU; benchmarks).

    Returns:
        ``(dq, dk, dv)``, each strided like its input. Extra memory: delta, fp32 ``(B, Hq, Nq)``;
        on the fused Hopper path (:func:`hopper_bwd_applies`) also dQ's fp32 accumulator,
        ``(B, Hq, Nq, D)``. A plain call (no window, soft cap, lengths, packing or pinned
        config) is planned once per kind of tensors (:class:`BwdPlan`).
    """
    request.refuse("the attention backward", BWD_FIELDS)
    sinks = request.sinks
    # (sinks take the plain kernels: their gradient is computed beside them)
    plain = request.only("sinks") and config is None
    if plain:
        key = _bwd_key(do, q, k, v, o, lse, dlse, request._replace(sinks=None))
        plan = _bwd_plans.get(key)
        if plan is not None:
            return plan(do, q, k, v, o, lse, dlse, sinks, dsinks)
    choice = planner.backward(q, k, v, do, request, pinned=config is not None)
    if choice.backend == "empty":
        if sinks is not None:  # no key: every row's probability is all the sink's
            delta = (do.float() * o.float()).sum(-1)
            sink_grad(sinks, lse, delta if dlse is None else delta - dlse, dsinks)
        return empty_output(q).zero_(), empty_output(k).zero_(), empty_output(v).zero_()
    if choice.backend == "plain":  # planned at its first call: fused Gluon or the Triton pair
        plan = BwdPlan(q, k, request.causal, request.scale)
        out = plan(do, q, k, v, o, lse, dlse, sinks, dsinks)
        _bwd_plans.put(key, plan)
        return out
    km = request.mask.kernel(q.shape[2], k.shape[2])
    if choice.backend == "tables":
        return window_bwd(do, q, k, v, o, lse, dlse, km, request.scale, choice.tile)
    return _attention_bwd_masked(do, q, k, v, o, lse, dlse, request, config, dsinks)


#: The request fields the backward takes (the split is the forward's alone).
BWD_FIELDS = (
    "causal",
    "scale",
    "window_left",
    "window_right",
    "softcap",
    "seqlens_k",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "sinks",
)


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


def _bwd_key(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple:
    """What a :class:`BwdPlan` depends on: the shapes it reads (q's and k's; v, o, do and the
    LSE are read as k, q and q's rows are), every tensor's strides and dtype (do's are o's, which
    :func:`check_bwd_grads` checks), q's device, each tensor's 16-byte alignment (one flag when
    all are aligned, the usual case), and the switches that choose the kernels."""
    ptrs = (do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5]) & 15
    return (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        o.stride(),
        do.stride(),
        lse.stride(),
        tensor_meta(dlse),
        q.dtype,
        k.dtype,
        v.dtype,
        o.dtype,
        lse.dtype,
        q.device,
        True if aligned else tuple(p % 16 for p in ptrs),
        request.key,
        torch.are_deterministic_algorithms_enabled(),
        _backend.getenv(HOPPER_ENV),
    )


#: :class:`BwdPlan` per kind of plain backward (every tensor's shape, strides, dtype, device and
#: alignment, causal, scale, the deterministic-algorithms switch, ``FLASHLITE_HOPPER_KERNEL``).
_bwd_plans = Cache("attention.bwd", 1024)


class BwdPlan:
    """A plain backward (no window, soft cap, lengths or packing) for one kind of tensors: the
    preprocess, then the fused Hopper kernel or the Triton pair, each launch bound at the first
    call, whose tensors set the kind (the caller keys plans by them)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> None:
        b, hq, nq, d = q.shape
        self.causal, self.scale = causal, scale  # (causal: as the caller normalised it)
        self.prescale = prescales_q(q)
        self.delta_shape = (b, hq, nq)
        self.cfg = bwd_config(q.device, q.dtype, d, causal)
        self.prep: Callable[..., None] | None = None
        #: ``main(qs, k, v, do, lse, delta, dq, dk, dv)``: the fused kernel or the Triton pair
        self.main: Callable[..., None] | None = None
        #: the fused kernel's dQ accumulator, fp32 ``(B, Hq, Nq, D)`` (zeroed by the
        #: preprocess), or None: decided at the first call
        self.acc_shape: tuple[int, ...] | None = None

    def __call__(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        dlse: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        dsinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
        # 16-bit inputs: the preprocess writes Qs (Q·scale·log2 e, as the forward rounded it)
        # into dq's memory; the dQ kernel reads each block of it before overwriting it with dQ
        qs = dq if self.prescale else q
        # an expanded or strided dlse (autograd may hand one over) is made dense, O(N)
        dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
        delta = torch.empty(self.delta_shape, device=q.device, dtype=torch.float32)
        if self.main is None and hopper_bwd_applies(qs, k, v, do, dk, dv):  # (first call)
            self.acc_shape = (*self.delta_shape, q.shape[-1])
        acc = None
        if self.acc_shape is not None:
            acc = torch.empty(self.acc_shape, device=q.device, dtype=torch.float32)
        if self.prep is None:
            self.prep = plan_preprocess(o, do, dlse, delta, q, qs, self.scale, acc)
        self.prep(o, do, dlse, delta, q, qs, acc)
        lse = lse.contiguous()  # the kernels index the (B, Hq, Nq) statistics densely
        if sinks is not None:
            sink_grad(sinks, lse, delta, dsinks)
        grads = (qs, k, v, do, lse, delta, dq, dk, dv)
        if self.main is None:
            if acc is not None:  # planned and run once, if it builds
                ran = hopper.run_bwd(*grads, acc, self.causal, self.scale)
                if ran:
                    self.main = ran
                    return dq, dk, dv
                # the Triton pair needs no accumulator (nor, from the next call, its zeros)
                self.acc_shape, self.prep, acc = None, None, None
            self.main = plan_pair(*grads, self.causal, self.scale, self.cfg)
        if acc is None:
            self.main(*grads)
        else:
            self.main(*grads, acc)
        return dq, dk, dv


def _attention_bwd_masked(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
    config: C.BwdConfig | None,
    dsinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A backward with a window, soft cap, lengths, packing or a pinned config: the preprocess
    and the Triton pair, launched per call."""
    mask, scale, sinks = request.mask, request.scale, request.sinks
    lengths = {"seqlens_k": request.seqlens_k, "varlen": request.varlen}
    dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
    cfg = config or bwd_config(q.device, q.dtype, q.shape[-1], mask.is_causal)
    qs = dq if prescales_q(q) else q
    delta = bwd_preprocess(o, do, lse, dlse, q, qs, scale)
    lse = lse.contiguous()
    if sinks is not None:
        sink_grad(sinks, lse, delta, dsinks)
    bwd_dkdv(qs, k, v, do, lse, delta, dk, dv, mask, scale, cfg, **lengths)
    bwd_dq(qs, k, v, do, lse, delta, dq, mask, scale, cfg, **lengths)
    return dq, dk, dv


def attention_bwd_body(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # (returns dq, dk, dv and the sinks' fp32 gradient: (Hq,), or (0,) without sinks)
    check_bwd_grads(do, o, lse, dlse)
    dsinks = lse.new_empty((0,) if request.sinks is None else request.sinks.shape)
    if request.plain:  # a plain backward of a kind planned before: straight to its plan
        plan = _bwd_plans.get(_bwd_key(do, q, k, v, o, lse, dlse, request))
        if plan is not None:
            return (*plan(do, q, k, v, o, lse, dlse), dsinks)
    grads = attention_bwd(do, q, k, v, o, lse, dlse, request, dsinks=dsinks)
    return (*grads, dsinks)


def attention_bwd_fake(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_bwd_grads(do, o, lse, dlse)
    dsinks = lse.new_empty((0,) if request.sinks is None else request.sinks.shape)
    return empty_output(q), empty_output(k), empty_output(v), dsinks
