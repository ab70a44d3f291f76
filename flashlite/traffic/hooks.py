"""The interpreter hooks the traffic counter uses (:func:`interpreter_memory_hooks`): the one
place flashlite reaches into Triton's interpreter.

Running kernels patches nothing in Triton. Counting bytes wraps the interpreter's memory entry
points, and its launch entry point, only inside a ``with`` block, always restores them, and
checks the Triton version it was written for (other versions are checked for the parameters
the wrappers rely on and refused, naming the version, when they differ).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from flashlite._backend import TRITON_VERSION, private_api_error

if TYPE_CHECKING:
    import numpy as np

#: Triton versions whose interpreter :func:`interpreter_memory_hooks` was written against:
#: ``interpreter_builder.create_masked_load(ptrs, mask, ...)``, ``create_masked_store(ptrs,
#: value, mask, ...)`` (every load and store path ends in one of them) and
#: ``GridExecutor.__call__(self, *args)`` (one kernel launch, ``self.fn`` the kernel).
_MEMORY_HOOKS_TESTED = ((3, 4), (3, 9))

#: ``hook(addresses, mask, itemsize)``: one interpreted load or store, as numpy arrays of int64
#: addresses and of the mask (broadcastable to the addresses), and the bytes of one element.
AccessHook = Callable[["np.ndarray", "np.ndarray", int], None]
#: ``hook(kernel_name)``: a context manager the whole launch runs inside (the interpreter's own
#: torch ops that move arguments to and from the host included).
LaunchHook = Callable[[str], AbstractContextManager[Any]]


def _memory_hook_points() -> tuple[Any, Any]:
    """The interpreter's builder instance and launch class, checked where Triton is untested."""
    try:  # private: the interpreter's module-level builder and its grid executor
        from triton.runtime import interpreter as interp

        builder, executor = interp.interpreter_builder, interp.GridExecutor
        load, store = builder.create_masked_load, builder.create_masked_store
        call = executor.__call__
        low, high = _MEMORY_HOOKS_TESTED
        if not low <= TRITON_VERSION <= high:
            # the wrappers pass ptrs/value/mask by position: an untested Triton must agree
            params = [list(inspect.signature(f).parameters) for f in (load, store, call)]
            if params[0][:2] != ["ptrs", "mask"] or params[1][:3] != ["ptrs", "value", "mask"]:
                raise TypeError(f"unexpected parameters {params[0]}, {params[1]}")
            if params[2][:1] != ["self"]:
                raise TypeError(f"unexpected GridExecutor.__call__ parameters {params[2]}")
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise private_api_error(
            "interpreter hook points (interpreter_builder.create_masked_load / "
            "create_masked_store, GridExecutor.__call__)",
            err,
        ) from err
    return builder, executor


def _itemsize(ptrs: Any) -> int:
    # int1 tensors live in memory as one byte per element
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


@contextlib.contextmanager
def interpreter_memory_hooks(
    on_load: AccessHook | None = None,
    on_store: AccessHook | None = None,
    on_launch: LaunchHook | None = None,
) -> Iterator[None]:
    """Inside the block, report every load and store Triton's interpreter executes, and run
    every interpreted kernel launch inside ``on_launch(kernel_name)``.

    The only place flashlite reaches into the interpreter (for the traffic counters): the
    builder's masked load/store and ``GridExecutor.__call__`` are wrapped for the duration of
    the block and always restored, also when it raises. Blocks may nest (the inner wrappers
    call the outer ones); they must not interleave. Only kernels that run interpreted are seen.

    Raises RuntimeError naming ``triton.__version__`` when this Triton's interpreter lacks the
    hook points (or, outside the tested versions, has them with other parameters).
    """
    builder, executor = _memory_hook_points()
    # what was there before: an instance attribute only if an outer block installed one
    saved = {n: vars(builder).get(n) for n in ("create_masked_load", "create_masked_store")}
    saved_call = vars(executor).get("__call__")
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def hooked_load(ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        on_load(ptrs.data, mask.data, _itemsize(ptrs))  # type: ignore[misc]
        return load(ptrs, mask, *args, **kwargs)

    def hooked_store(ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        on_store(ptrs.data, mask.data, _itemsize(ptrs))  # type: ignore[misc]
        return store(ptrs, value, mask, *args, **kwargs)

    def hooked_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with on_launch(self.fn.__name__):  # type: ignore[misc]
            return call(self, *args, **kwargs)

    try:
        if on_load is not None:
            builder.create_masked_load = hooked_load
        if on_store is not None:
            builder.create_masked_store = hooked_store
        if on_launch is not None:
            executor.__call__ = hooked_call
        yield
    finally:
        for name, before in saved.items():
            if before is not None:
                setattr(builder, name, before)
            elif name in vars(builder):
                delattr(builder, name)  # back to the class's method
        if saved_call is not None:
            executor.__call__ = saved_call
        elif "__call__" in vars(executor):
            del executor.__call__
