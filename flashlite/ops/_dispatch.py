"""One statement per op: its body, its fake and its autograd, from which the dispatcher op and the
eager fast path are both derived.

A front-end states an op once with :class:`Op`::

    SOFTMAX_FWD = Op("softmax_fwd", body, fake=..., inputs=1,
                     setup_context=..., backward=...)

and calls ``SOFTMAX_FWD(*args)``. Three paths run the same body:

* **the body itself**, when the call runs eagerly, nothing observes it (:func:`plain_eager`) and
  it records no autograd graph: the dispatcher's custom-op machinery costs more host time than a
  small kernel takes on the GPU, and buys nothing there;
* **an** ``autograd.Function`` **made from the same** ``setup_context`` **and** ``backward``, when
  such a call records autograd: the dispatcher's autograd wrapper and redispatch, skipped;
* **the** ``torch.ops.flashlite.<name>`` **custom op** otherwise: under ``torch.compile``, FX,
  export, fake tensors, dispatch modes, functorch transforms and tensor subclasses, and for
  tensors that must move first (CPU tensors in a process whose kernels run on a GPU: the op's
  body moves them, and the copies cost more than the dispatcher does).

The backward formula calls its backward op through the same object, so a second derivative goes
to the backward op's own autograd (registered, or refused with its message). An op that writes
into an argument (cross-entropy's gradient) cannot carry autograd; :func:`differentiable` makes
the Function around such ops, which still pick their own path. A front-end that has no gradient
at all (decoding) is wrapped by :func:`forward_only`: given tensors that require grad it still
computes, and a backward that reaches it raises.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from flashlite import _backend
from flashlite.ops._fields import Fields
from flashlite.ops.common import on_compute_device

_len_dispatch_stack = torch._C._len_torch_dispatch_stack
#: ``autograd.Function.apply`` below its Python wrapper, which binds default arguments for
#: Functions with a separate ``setup_context`` (not these) and unwraps dead functorch wrappers
#: (none on the path that calls it: :func:`plain_eager` holds); None where torch lacks it.
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")
_functorch_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
#: Whether CPU tensors run their kernels where they are (the interpreter, working): else a
#: call on them moves to the GPU, or raises why it cannot run (:func:`on_compute_device`).
_RUNS_IN_PLACE = _backend.INTERPRETED and _backend.INTERPRETER_PROBLEM is None
F = TypeVar("F", bound=Callable[..., Any])


def plain_eager(*tensors: torch.Tensor) -> bool:
    """Whether this call runs eagerly and unobserved: nothing traces (Dynamo, FX, export), no
    torch dispatch mode watches (FakeTensorMode, FlopCounterMode, …), no functorch transform
    (vmap, grad) is active and every tensor is a plain ``torch.Tensor`` (or None)."""
    if _is_compiling() or _len_dispatch_stack() or _functorch_active():
        return False
    for t in tensors:  # noqa: SIM110  (a loop: no generator per call)
        if t is not None and type(t) is not torch.Tensor:
            return False
    return True


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a call on ``tensors`` (grad mode on, one of them requires grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110
        if t is not None and t.requires_grad:
            return True
    return False


class Op:
    """An op stated once; calling it takes the cheapest path that is correct for the call.

    Args:
        name: the custom op's name, ``flashlite::<name>``.
        body: the implementation (its annotations give the op's schema). With ``moves`` (the
            default) the custom op runs it where kernels run
            (:func:`~flashlite.ops.common.on_compute_device`), and calls whose tensors must move
            take the custom op; the fast paths run it as it is, on tensors where kernels run.
        fake: the op's fake (meta) implementation.
        inputs: how many leading arguments are tensors the fast path looks at (never None).
        request: a ``NamedTuple`` type (attention's
            :class:`~flashlite.ops.attention.request.Request`) that the body takes as its last
            argument after ``inputs`` tensors: the op's schema is those tensors, then the
            request's fields by name (:class:`Fields`); calls pass the request whole.
        takes: the request's fields the op takes (None: all); the body refuses a request that
            sets another (:meth:`~flashlite.ops.attention.request.Request.refuse`).
        grad_fields: the request's tensor fields that may require grad (sinks).
        setup_context, backward: the autograd formula, as ``torch.library.register_autograd``
            takes it; ``backward`` returns one gradient per argument. Without a ``request``,
            ``setup_context(ctx, inputs, output)`` gets ``inputs`` as a ``NamedTuple`` named by
            the body's parameters (``inputs.dim``; :func:`_inputs_type`), on either path. With
            a ``request``: ``setup_context(ctx, inputs, request, output)`` (``inputs`` the
            leading tensors) and ``backward`` returns ``(input gradients, {field name:
            gradient})``.
        materialize_grads: whether ``backward`` receives zeros (True) or None for outputs that got
            no gradient (as the custom op's autograd does with False).
        mutates_args: arguments the body writes (an op that mutates has no autograd here).
    """

    def __init__(
        self,
        name: str,
        body: Callable[..., Any],
        *,
        fake: Callable[..., Any],
        inputs: int,
        setup_context: Callable[..., None] | None = None,
        backward: Callable[..., Any] | None = None,
        materialize_grads: bool = True,
        mutates_args: tuple[str, ...] = (),
        moves: bool = True,
        request: type[tuple] | None = None,
        takes: tuple[str, ...] | None = None,
        grad_fields: tuple[str, ...] = (),
    ) -> None:
        self.name, self.inputs = name, inputs
        #: the request type whose fields are the op's named arguments (:class:`Fields`), or None
        self.fields = Fields(request, grad_fields, takes) if request is not None else None
        #: the body as the fast paths run it: on tensors where kernels run (calls whose tensors
        #: must move, CPU tensors in a process that compiles its kernels, take the dispatcher,
        #: whose body moves them: rare, and a copy costs more than the dispatcher anyway)
        self.body = body
        self.moves = moves
        impl = on_compute_device(body) if moves else body
        if self.fields is not None:  # the schema: the leading tensors, then the request's fields
            impl = self.fields.named(impl, body, inputs)
            fake = self.fields.named(fake, body, inputs)
        op = torch.library.custom_op(f"flashlite::{name}", mutates_args=mutates_args)(impl)
        op.register_fake(fake)
        self.function: type[torch.autograd.Function] | None = None
        self.apply: Callable[..., Any] | None = None
        if backward is not None:
            assert setup_context is not None, "an autograd formula needs its setup_context"
            if self.fields is None:
                named = _inputs_type(name, body)
                op.register_autograd(backward, setup_context=_by_name(setup_context, named))
                self.function = _function(
                    name, body, setup_context, backward, materialize_grads, named
                )
            else:
                self.fields.register_autograd(op, inputs, setup_context, backward)
                pair = self.fields.autograd(
                    body, inputs, setup_context, backward, materialize_grads
                )
                doc = f"Eager autograd of ``flashlite::{name}`` (made by :class:`Op`)."
                self.function = _function_class(name, *pair, doc)
            self.apply = eager_apply(self.function)
        self.default = getattr(torch.ops.flashlite, name).default
        # the arguments the body writes: the dispatcher bumps their version counters (autograd's
        # check that a saved tensor was not modified), so the body path must too
        params = list(inspect.signature(body).parameters)
        self.mutated = tuple(params.index(a) for a in mutates_args)

    def __call__(self, *args: Any) -> Any:
        # (written out, not through plain_eager/records_grad: this runs on every call, and each
        # Python frame is host time a small kernel's caller pays)
        if _is_compiling() or _len_dispatch_stack() or _functorch_active():
            return self._dispatch(args)
        if self.moves and not (args[0].is_cuda or _RUNS_IN_PLACE):
            return self._dispatch(args)
        grad = self.apply is not None and _grad_enabled()
        record = False
        for t in args[: self.inputs]:
            if t is not None:
                if type(t) is not torch.Tensor:
                    return self._dispatch(args)
                if grad and t.requires_grad:
                    record = True
        if self.fields is not None:  # the request's tensors that may require grad (sinks)
            for name in self.fields.grad_fields:
                t = getattr(args[-1], name)
                if t is not None:
                    if type(t) is not torch.Tensor:
                        return self._dispatch(args)
                    record = record or (grad and t.requires_grad)
            if record:
                return self.apply(*args, *self.fields.grad_tensors(args[-1]))  # type: ignore[misc]
        if record:
            return self.apply(*args)  # type: ignore[misc]
        out = self.body(*args)
        for i in self.mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return out

    def _dispatch(self, args: tuple) -> Any:
        """The custom op: a request travels as its fields, by name."""
        if self.fields is None:
            return self.default(*args)
        tensors, named = self.fields.flat(args[-1])
        return self.default(*args[:-1], *tensors, **named)

    def __repr__(self) -> str:
        return f"Op(flashlite::{self.name})"


def _inputs_type(name: str, body: Callable[..., Any]) -> type[tuple]:
    """``<Name>Inputs``, a ``NamedTuple`` whose fields are ``body``'s parameters: what the
    ``setup_context`` of an op without a request receives as ``inputs``. Built with
    ``tuple.__new__`` (no length check), so the body takes no defaults: every call passes
    every argument."""
    params = inspect.signature(body).parameters.values()
    assert all(p.default is p.empty for p in params), f"{name}: setup_context needs no defaults"
    return collections.namedtuple(f"{_title(name)}Inputs", [p.name for p in params])


def _by_name(setup_context: Callable[..., None], named: type[tuple]) -> Callable[..., None]:
    """``setup_context`` as ``register_autograd`` calls it (by keyword, every argument given),
    handed the inputs as ``named``."""
    new = tuple.__new__

    def setup(ctx: Any, inputs: tuple, output: Any) -> None:
        setup_context(ctx, new(named, inputs), output)

    return setup


def _function(
    name: str,
    body: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
    materialize_grads: bool,
    named: type[tuple],
) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` with the op's own formula around its body (the fast path of a
    call that records autograd); ``setup_context`` gets the inputs as ``named``."""
    new = tuple.__new__  # (one C call per call: no _make, no Python frame)

    def forward(ctx: Any, *args: Any) -> Any:
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        out = body(*args)
        setup_context(ctx, new(named, args), out)
        return out

    doc = f"Eager autograd of ``flashlite::{name}`` (made by :class:`Op`)."
    return _function_class(name, forward, backward, doc)


def _function_class(
    name: str, forward: Callable[..., Any], backward: Callable[..., Any], doc: str
) -> type[torch.autograd.Function]:
    """``<Name>Function``, an ``autograd.Function`` with this forward and backward."""
    members = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": doc}
    return type(f"{_title(name)}Function", (torch.autograd.Function,), members)


def _title(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def differentiable(
    name: str, forward: Callable[..., Any], backward: Callable[..., Any]
) -> type[torch.autograd.Function]:
    """The ``autograd.Function`` of a call whose forward runs :class:`Op` s that write what the
    backward needs (cross-entropy's gradient, written in the forward pass). A custom op that
    mutates cannot carry an autograd formula, so the formula lives here, around the ops:
    ``forward(ctx, *args)`` and ``backward(ctx, *grads)`` as a Function's own, and each op
    inside still picks its path (body or dispatcher) for itself."""
    doc = f"Autograd of ``flashlite.{name}`` around its ops (made by :func:`differentiable`)."
    return _function_class(name, forward, backward, doc)


def eager_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` below its Python wrapper (as :class:`Op` calls its own), for calls
    where :func:`plain_eager` holds; the wrapper itself where torch lacks the C one."""
    return _C_APPLY.__get__(None, function) if _C_APPLY is not None else function.apply


def _no_gradient(
    like: torch.Tensor, message: str, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    raise RuntimeError(message)


#: ``flashlite::no_gradient``: what a forward-only call's backward returns for an input. Its
#: fake is a gradient of the input's shape, so that ``torch.compile`` traces the backward
#: graph; running it raises ``message``: the error comes when a backward reaches the call, not
#: when the graph is compiled.
_NO_GRADIENT = Op(
    "no_gradient",
    _no_gradient,
    fake=lambda like, message, shape, dtype: like.new_empty(shape, dtype=dtype),
    inputs=1,
    moves=False,
)


class ForwardOnlyFunction(torch.autograd.Function):
    """Outputs of a forward-only call hung from the inputs that require grad: the forward hands
    back copies of the outputs (a custom Function's outputs may not be its inputs); the
    backward raises (through :data:`_NO_GRADIENT`) naming the call and those inputs."""

    @staticmethod
    def forward(ctx: Any, message: str, n_out: int, *tensors: torch.Tensor) -> Any:
        ctx.message, ctx.n_out = message, n_out
        ctx.inputs = [(list(t.shape), t.dtype) for t in tensors[n_out:]]  # (not saved: a
        # cache written by later steps would fail autograd's version check before our error)
        return tuple(t.clone() for t in tensors[:n_out])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        like = next(g for g in grads if g is not None)
        no_grad = [_NO_GRADIENT(like, ctx.message, shape, dtype) for shape, dtype in ctx.inputs]
        return None, None, *([None] * ctx.n_out), *no_grad


def forward_only(fn: F) -> F:
    """A forward-only front-end (decoding) that may be given tensors that require grad: called
    so in grad mode, it runs on detached arguments under ``torch.no_grad()``, and its outputs
    hang from one autograd node whose backward raises, as a torch op without a derivative does.
    The call computes (a graph that never differentiates it is fine: flash-attn's tests, a
    generation step without ``no_grad``); a backward that reaches it says so instead of
    dropping gradients. Eager and ``torch.compile`` alike (the error is raised when the
    backward runs). Other calls go straight to the function, after one look at each argument
    in grad mode and none under ``no_grad``."""
    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _grad_enabled():
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    return _linked(fn, params, args, kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def _linked(fn: Callable[..., Any], params: list[str], args: tuple, kwargs: dict[str, Any]) -> Any:
    """:func:`forward_only`'s call given tensors that require grad."""
    named = [*zip(params, args, strict=False), *kwargs.items()]
    found = [(k, a) for k, a in named if isinstance(a, torch.Tensor) and a.requires_grad]
    with torch.no_grad():
        out = fn(*(_detached(a) for a in args), **{k: _detached(a) for k, a in kwargs.items()})
    which = " and ".join(name for name, _ in found)
    message = (
        f"flashlite.{fn.__name__} is forward-only (it has no gradient), but a backward reached "
        f"it through {which}, which required grad when it was called. Call it under "
        "torch.no_grad() (or pass detached tensors) where no gradient is wanted; for a "
        "differentiable call use flashlite.attention (seqlens_k= for per-batch lengths) or "
        "flashlite.attention_varlen"
    )
    outs = out if isinstance(out, tuple) else (out,)
    linked = ForwardOnlyFunction.apply(message, len(outs), *outs, *(t for _, t in found))
    return tuple(linked) if isinstance(out, tuple) else linked[0]


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x
