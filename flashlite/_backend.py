"""Where a kernel runs: compiled Triton for CUDA tensors, Triton's interpreter for CPU tensors.

This is the only module that knows about ``TRITON_INTERPRET`` and the interpreter's quirks.

* On a machine without a CUDA device we switch the interpreter on *before* ``triton`` is first
  imported, so every ``@triton.jit`` function (kernels and the ``stats`` helpers they call) is
  created as an interpreted function. That is the supported way to interpret kernels that call
  other jitted helpers.
* On a CUDA machine, CPU tensors still work: :func:`launcher` builds an interpreted twin of the
  kernel whose globals point at interpreted twins of every jitted helper it calls (wrapping only
  the kernel fails as soon as it calls a helper).
* The interpreter computes ``tl.dot`` on bf16 operands wrongly (seen with Triton 3.9), so
  :func:`dot_upcast` tells kernels to feed fp32 operands to ``tl.dot`` there.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (must follow the environment switch above)
from triton.runtime.jit import JITFunction  # noqa: E402

try:  # the interpreter's function type moved between Triton releases only in name
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    InterpretedFunction = ()  # type: ignore[assignment,misc]

_twins: dict[Any, Any] = {}


def _interpreted_twin(fn: Any) -> Any:
    """An interpreted copy of a jitted function whose jitted globals are interpreted too."""
    if isinstance(fn, InterpretedFunction) or fn in _twins:
        return _twins.get(fn, fn)
    py = fn.fn
    glb = dict(py.__globals__)
    copy = types.FunctionType(py.__code__, glb, py.__name__, py.__defaults__, py.__closure__)
    copy.__qualname__, copy.__module__ = py.__qualname__, py.__module__
    twin = InterpretedFunction(copy)
    _twins[fn] = twin  # before recursing: helpers may refer back to each other
    for name, value in glb.items():
        if isinstance(value, JITFunction):
            glb[name] = _interpreted_twin(value)
    return twin


def is_interpreted(device: torch.device) -> bool:
    """True when kernels for tensors on ``device`` run in Triton's interpreter."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


def check_device(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for tensors on devices flashlite cannot run on."""
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{name} is on device {t.device}; flashlite runs on 'cuda' (compiled Triton) "
            "and 'cpu' (Triton interpreter) tensors"
        )


def launcher(kernel: Any, device: torch.device) -> Any:
    """The kernel object to index with a grid for tensors on ``device``."""
    if device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return kernel
    # An autotuned kernel wraps the JITFunction; on the interpreter we run its first config.
    return _interpreted_twin(kernel)


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 (bf16 in the interpreter is wrong)."""
    return dtype == torch.bfloat16 and is_interpreted(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a nominal 4 for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def set_descriptor_allocator(device: torch.device) -> None:
    """Device-side tensor descriptors need scratch memory from a Triton allocator."""
    if device.type != "cuda" or getattr(set_descriptor_allocator, "_done", False):
        return

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc)
    set_descriptor_allocator._done = True  # type: ignore[attr-defined]
