"""Where a kernel runs: compiled Triton for CUDA tensors; CPU tensors in Triton's interpreter on
a machine without a GPU, and through the GPU (copied there and back) on a CUDA machine.

This is the only module that knows about ``TRITON_INTERPRET`` and the interpreter's quirks.

* On a machine without a CUDA device we switch the interpreter on *before* ``triton`` is first
  imported, so every ``@triton.jit`` function (kernels and the ``stats`` helpers they call) is
  created as an interpreted function. That is the supported way to interpret kernels that call
  other jitted helpers.
* On a CUDA machine the jitted functions are compiled ones (Triton decides at import). CPU
  tensors given to a kernel there go to the GPU and back: :func:`launcher` copies the storages
  they view (same strides and offsets), runs the compiled kernel and copies the storages back.
  (Interpreting kernels in a compiling process leaves Triton 3.6's language module patched for
  the interpreter, which then breaks every later compile: seen on the H200.)
* Where ``triton`` was imported before flashlite on a machine without a GPU, the jitted
  functions are compiled ones too, and nothing can run them: :func:`launcher` wraps the kernel
  in an interpreted function, and while it runs, a call of any compiled ``@triton.jit`` function
  (our helpers and Triton's own library: ``tl.cdiv``, ``tl.max``, …) is redirected to an
  interpreted copy of it. Wrapping only the kernel is not enough: its first helper call would
  fail ("Cannot call @triton.jit'd outside of the scope of a kernel").
* The interpreter computes ``tl.dot`` on bf16 operands wrongly (seen with Triton 3.9), so
  :func:`dot_upcast` tells kernels to feed fp32 operands to ``tl.dot`` there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_interpreted: dict[Any, Any] = {}


def _interpreted_copy(fn: JITFunction) -> Any:
    # keyed by id: hashing a JITFunction parses its source, which fails mid-interpretation
    key = id(fn)
    if key not in _interpreted:
        _interpreted[key] = InterpretedFunction(fn.fn)
    return _interpreted[key]


@contextlib.contextmanager
def _jit_calls_interpreted() -> Iterator[None]:
    """Route calls of compiled ``@triton.jit`` functions to interpreted copies (one thread)."""
    original = JITFunction.__call__

    def call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
        return _interpreted_copy(self)(*args, **kwargs)

    JITFunction.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.__call__ = original  # type: ignore[method-assign]


class _InterpretedLaunch:
    """``kernel[grid](...)`` for CPU tensors when the process compiles its kernels."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = _interpreted_copy(kernel)

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _jit_calls_interpreted():
                return self.kernel[grid](*args, **kwargs)

        return run


class _GpuRoundTrip:
    """``kernel[grid](...)`` for CPU tensors in a process that compiles for its CUDA device."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            # one GPU copy per CPU storage (views of one buffer stay views of one buffer)
            copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def to_gpu(a: Any) -> Any:
                if not (isinstance(a, torch.Tensor) and a.device.type == "cpu"):
                    return a
                storage = a.untyped_storage()
                if storage.data_ptr() not in copies:
                    whole = torch.empty(0, dtype=a.dtype).set_(storage)
                    copies[storage.data_ptr()] = (whole, whole.to("cuda"))
                gpu = copies[storage.data_ptr()][1]
                return gpu.as_strided(a.shape, a.stride(), a.storage_offset())

            out = self.kernel[grid](*map(to_gpu, args), **{k: to_gpu(v) for k, v in kwargs.items()})
            for whole, gpu in copies.values():  # outputs (inputs come back unchanged)
                whole.copy_(gpu)
            return out

        return run


def kernels_interpreted() -> bool:
    """Whether kernels on CPU tensors run in Triton's interpreter in this process (not so on a
    CUDA machine unless ``TRITON_INTERPRET=1`` was set before flashlite was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def is_interpreted(device: torch.device) -> bool:
    """True when kernels for tensors on ``device`` run in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1" or (
        device.type == "cpu" and kernels_interpreted()
    )


def check_device(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for tensors on devices flashlite cannot run on."""
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{name} is on device {t.device}; flashlite runs on 'cuda' (compiled Triton) "
            "and 'cpu' (Triton interpreter) tensors"
        )


def launcher(kernel: Any, device: torch.device) -> Any:
    """The kernel object to index with a grid for tensors on ``device``."""
    if device.type == "cpu" and isinstance(kernel, JITFunction):
        return _GpuRoundTrip(kernel) if torch.cuda.is_available() else _InterpretedLaunch(kernel)
    return kernel


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 (bf16 in the interpreter is wrong)."""
    return dtype == torch.bfloat16 and is_interpreted(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a cooperative grid (all programs resident at once)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def resident_programs(compiled: Any, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on ``device`` at once."""
    if not hasattr(compiled, "n_regs"):  # loaded lazily by Triton 3.x
        compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = 32 * compiled.metadata.num_warps
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # allocated per warp, by 256
    per_sm = min(
        getattr(props, "max_threads_per_multi_processor", 2048) // threads,
        getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * threads // 32),
        32,
    )
    shared = compiled.metadata.shared
    if shared:
        per_sm = min(per_sm, getattr(props, "shared_memory_per_multiprocessor", 233472) // shared)
    return per_sm * props.multi_processor_count
