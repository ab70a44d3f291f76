"""A launch argument as a picklable spec and back: what the recorder stores and the replay
rebuilds. Only what decides the compiled code is kept (dtypes, 16-byte alignment, scalar values,
constexprs, TMA descriptor shapes); a replayed tensor is an empty stand-in on the CPU."""

from __future__ import annotations

import importlib
from typing import Any

Spec = tuple[Any, ...]


class UnrecordableError(Exception):
    """An argument the replay could not rebuild (a closure, an object of another library)."""


def spec(value: Any) -> Spec:
    """The spec of one launch argument; raises :class:`UnrecordableError` for what cannot replay."""
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):  # before int: a bool is an int
        return ("B", value)
    if isinstance(value, int):
        return ("I", value)
    if isinstance(value, float):
        return ("F", value)
    if value is None:
        return ("N",)
    if isinstance(value, str):
        return ("S", value)
    if isinstance(value, tl.dtype):
        return ("tl", value.name)
    if isinstance(value, tl.constexpr):
        return ("C", spec(value.value))
    if isinstance(value, tuple):
        return ("tuple", tuple(spec(x) for x in value))
    descriptor = _descriptor_spec(value)
    if descriptor is not None:
        return descriptor
    fn = getattr(value, "fn", None)  # a @triton.jit function passed in (a mask or score mod)
    if callable(fn) and fn.__module__.startswith("flashlite") and "<" not in fn.__qualname__:
        return ("J", fn.__module__, fn.__qualname__)
    raise UnrecordableError(type(value).__name__)


def _descriptor_spec(value: Any) -> Spec | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side TMA descriptors
        return None
    if not isinstance(value, TensorDescriptor):
        return None
    base = value.base
    return (
        "TD",
        str(base.dtype),
        tuple(base.shape),
        tuple(base.stride()),
        tuple(value.block_shape),
    )


def jit_function(obj: Any) -> Any:
    """The ``JITFunction`` under decorators (an autotuner, a heuristics wrapper)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def lookup(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` of the tree being compiled."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def build(s: Spec) -> Any:
    """A stand-in argument the compiler specialises exactly as it did the recorded one."""
    import torch
    import triton.language as tl

    kind = s[0]
    if kind == "T":
        tensor = torch.empty(64, dtype=getattr(torch, s[1].split(".")[1]))
        return tensor if s[2] else tensor[1:]  # one element in: no longer 16-byte aligned
    if kind == "TD":
        from triton.tools.tensor_descriptor import TensorDescriptor

        base = torch.empty_strided(s[2], s[3], dtype=getattr(torch, s[1].split(".")[1]))
        return TensorDescriptor(base, list(s[2]), list(s[3]), list(s[4]))
    if kind in ("B", "I", "F", "S"):
        return s[1]
    if kind == "N":
        return None
    if kind == "tl":
        return getattr(tl, s[1]) if hasattr(tl, s[1]) else tl.dtype(s[1])
    if kind == "C":
        return build(s[1])
    if kind == "tuple":
        return tuple(build(x) for x in s[1])
    if kind == "J":
        return jit_function(lookup(s[1], s[2]))
    raise ValueError(f"unknown spec {s!r}")
