"""Attention's two ops, stated once (:class:`~flashlite.ops._dispatch.Op`): the forward with its
autograd formula, and the backward, which has no derivative of its own. Both take q, k, v (and
the backward's tensors) and a :class:`~flashlite.ops.attention.request.Request`, whose fields are
the ops' named arguments. Their bodies are the launchers (:func:`attention_fwd`,
:func:`attention_bwd`): a plan asked of the planner (kept per kind of call) and launched."""

from __future__ import annotations

import torch

from flashlite.kernels import configs as C
from flashlite.ops._dispatch import Op
from flashlite.ops.attention import planner
from flashlite.ops.attention.backends.common import empty_output
from flashlite.ops.attention.checks import check_bwd_grads
from flashlite.ops.attention.plan import LaunchInfo
from flashlite.ops.attention.planner import BWD_FIELDS, FWD_FIELDS
from flashlite.ops.attention.request import Request
from flashlite.ops.common import on_compute_device


# --------------------------------------------------------------------------- the launchers
@on_compute_device
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    request: Request,
    *,
    config: C.Config | None = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo | None]:
    """Launch the forward kernel on validated ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hkv, Nk, D)``; any strides, one dtype and device.
        request: the call (:class:`~flashlite.ops.attention.request.Request`): mask, scale,
            lengths, packed sequences, sinks. ``num_splits`` n >= 1 runs the split-KV decode
            kernel (GQA rows packed, the keys split across n programs per row block and
            merged; not with packed sequences). Sinks are fp32 ``(Hq,)``, contiguous: every row
            of head h starts from the state ``(sinks[h], 1)``.
        config: pin a :class:`~flashlite.kernels.configs.Config` (else the measured table or
            the autotuner chooses).
        use_desc: force descriptor (True) or pointer (False) loads.
        prescale_q: fold the scale into Q (default for 16-bit inputs).

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` strided like ``q``, the fp32 LSE ``(B, Hq, Nq)`` and what the
        launch used (None when nothing was launched). CPU tensors in a process that compiles its
        kernels run on the GPU: moved there once, results moved back.
    """
    o = empty_output(q, request.out_dtype, request.head_dim_v)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    plan = planner.forward(
        q, k, v, o, lse, request, config=config, use_desc=use_desc, prescale_q=prescale_q
    )
    plan.launch(q, k, v, o, lse, request)
    return o, lse, plan.info


def attention_fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    # a call of a kind planned before goes straight to its plan (plans exist only for tensors
    # where kernels run, so nothing needs moving)
    plan = planner.kept_forward(q, k, v, request)
    if plan is None:
        o, lse, _ = attention_fwd(q, k, v, request)
        return o, lse
    o = empty_output(q, request.out_dtype, request.head_dim_v)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    plan.launch(q, k, v, o, lse, request)
    return o, lse


def attention_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_output(q, request.out_dtype, request.head_dim_v), q.new_empty(
        q.shape[:3], dtype=torch.float32
    )


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
            receives their gradient (``backends.common_bwd.sink_grad``). The LSE the forward
            saved holds the sink, so the kernels themselves need nothing more.
        config: pin the kernels' tiles (the traffic tools count the GPU's on a CPU; benchmarks).

    Returns:
        ``(dq, dk, dv)``, each strided like its input. Extra memory: the plan's workspaces
        (delta, fp32 ``(B, Hq, Nq)``; on the fused Hopper kernel also dQ's fp32 accumulator,
        ``(B, Hq, Nq, D)``). A plain call (no window, soft cap, lengths, packing or pinned
        config) is planned once per kind of tensors.
    """
    plan = planner.backward(do, q, k, v, o, lse, dlse, request, config=config)
    return plan.launch(do, q, k, v, o, lse, dlse, request, dsinks)


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
        plan = planner.kept_backward(do, q, k, v, o, lse, dlse, request)
        if plan is not None:
            return (*plan.launch(do, q, k, v, o, lse, dlse, request, dsinks), dsinks)
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


# --------------------------------------------------------------------------- the ops
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
