"""A request type's fields as a custom op's named arguments (:class:`Fields`), for
:class:`~flashlite.ops._dispatch.Op`: the schema, the two call paths and the autograd."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import torch


class Fields:
    """A request type's fields as an op's named arguments: the schema, the calls and the autograd.

    The custom op's schema is the op's leading tensors, then the request's tensor fields (by
    name, but not keyword-only: the dispatcher takes no keyword-only tensors), then its other
    fields, keyword-only. A field that is a list of tensors comes first and is always passed:
    the dispatcher has no optional tensor lists, so an empty list stands for an absent one.
    Eager calls hand the request over whole; the dispatcher path spreads it into fields
    (:meth:`flat`) and the op's implementation builds it again (:meth:`named`), so
    ``setup_context`` and ``backward`` read fields by name on either path.
    """

    def __init__(
        self, request: type[tuple], grad_fields: tuple[str, ...], takes: tuple[str, ...] | None
    ) -> None:
        hints = typing.get_type_hints(request)
        names: tuple[str, ...] = request._fields  # type: ignore[attr-defined]
        if takes is not None:  # (the op's schema has no name for the others)
            names = tuple(n for n in names if n in takes)
        defaults: dict[str, Any] = request._field_defaults  # type: ignore[attr-defined]
        self.request, self.grad_fields = request, grad_fields
        self.lists = tuple(n for n in names if "list[torch.Tensor]" in str(hints[n]))
        singles = tuple(n for n in names if "Tensor" in str(hints[n]) and n not in self.lists)
        self.tensors = (*self.lists, *singles)
        self.others = tuple(n for n in names if n not in self.tensors)
        empty = inspect.Parameter.empty
        self.params = [
            *(inspect.Parameter(n, _POS, annotation=list[torch.Tensor]) for n in self.lists),
            *(inspect.Parameter(n, _POS, annotation=hints[n], default=None) for n in singles),
            *(
                inspect.Parameter(n, _KW, annotation=hints[n], default=defaults.get(n, empty))
                for n in self.others
            ),
        ]

    def flat(self, request: Any) -> tuple[tuple, dict[str, Any]]:
        """The request's tensor fields in order and its other fields by name."""
        lists = tuple(getattr(request, n) or [] for n in self.lists)
        singles = tuple(getattr(request, n) for n in self.tensors[len(lists) :])
        return (*lists, *singles), {n: getattr(request, n) for n in self.others}

    def grad_tensors(self, request: Any) -> tuple:
        return tuple(getattr(request, n) for n in self.grad_fields)

    def build(self, fields: tuple, named: dict[str, Any]) -> Any:
        """The request from :meth:`flat`'s two parts."""
        given = dict(zip(self.tensors, fields, strict=False))
        for n in self.lists:  # (an empty list: none)
            given[n] = list(given[n]) or None
        return self.request(**given, **named)

    def named(self, fn: Callable[..., Any], body: Callable[..., Any], n: int) -> Callable[..., Any]:
        """``fn(*leading, request)`` as a function of the leading tensors and the fields (the
        signature ``torch.library`` reads the schema from)."""

        def impl(*args: Any, **named: Any) -> Any:
            return fn(*args[:n], self.build(args[n:], named))

        leading = list(inspect.signature(body).parameters.values())[:n]
        hints = typing.get_type_hints(body)
        leading = [p.replace(annotation=hints[p.name]) for p in leading]
        impl.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [*leading, *self.params], return_annotation=hints["return"]
        )
        impl.__name__ = fn.__name__
        return impl

    def register_autograd(
        self, op: Any, n: int, setup_context: Callable[..., None], backward: Callable[..., Any]
    ) -> None:
        """The custom op's autograd, from the by-name formula."""

        def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
            setup_context(ctx, inputs[:n], self.build(inputs[n:], keyword_only_inputs), output)

        def grads(ctx: Any, *grads: Any) -> tuple:
            inputs, by_name = backward(ctx, *grads)
            # one gradient per argument the call passed (the dispatcher drops trailing ones
            # equal to their defaults), a list of Nones for a list of tensors: the structure
            # of needs_input_grad
            out = list(inputs)
            for name, needs in zip(self.tensors, ctx.needs_input_grad[n:], strict=False):
                out.append(
                    [None] * len(needs) if isinstance(needs, (list, tuple)) else by_name.get(name)
                )
            return tuple(out)

        op.register_autograd(grads, setup_context=setup)

    def autograd(
        self,
        body: Callable[..., Any],
        n: int,
        setup_context: Callable[..., None],
        backward: Callable[..., Any],
        materialize_grads: bool,
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The eager ``autograd.Function``'s forward and backward: it is called with
        ``(*leading, request, *grad tensors)`` (the request's tensors that require grad passed
        again, so autograd sees them)."""

        def forward(ctx: Any, *args: Any) -> Any:
            if not materialize_grads:
                ctx.set_materialize_grads(False)
            out = body(*args[: n + 1])
            setup_context(ctx, args[:n], args[n], out)
            return out

        def grads(ctx: Any, *grads: Any) -> tuple:
            inputs, by_name = backward(ctx, *grads)
            return (*inputs, None, *(by_name.get(f) for f in self.grad_fields))

        return forward, grads


_POS, _KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
