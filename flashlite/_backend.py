"""Where a kernel runs: compiled Triton for CUDA tensors, Triton's interpreter for CPU tensors.

This is the only module that knows about ``TRITON_INTERPRET`` and the interpreter's quirks.

* On a machine without a CUDA device we switch the interpreter on *before* ``triton`` is first
  imported, so every ``@triton.jit`` function (kernels and the ``stats`` helpers they call) is
  created as an interpreted function. That is the supported way to interpret kernels that call
  other jitted helpers.
* On a CUDA machine the interpreter is off for the whole process (Triton decides at import);
  CPU tensors given to the public functions are then computed on the GPU and copied back
  (:func:`cpu_tensors_use_gpu`). Set ``TRITON_INTERPRET=1`` before importing flashlite to run
  everything in the interpreter instead.
* The interpreter computes ``tl.dot`` on bf16 operands wrongly (seen with Triton 3.9), so
  :func:`dot_upcast` tells kernels to feed fp32 operands to ``tl.dot`` there.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def cpu_tensors_use_gpu() -> bool:
    """True when CPU tensors must be computed on the GPU and copied back.

    The interpreter is chosen for a whole process when ``triton`` is imported; on a CUDA machine
    (interpreter off) the kernels and the ``tl`` library they call are compiled functions that
    the interpreter cannot run, so CPU tensors go through the GPU instead.
    """
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


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
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "CPU tensors need Triton's interpreter, which is off in this process (a CUDA device "
            "is present); the public functions move CPU tensors to the GPU for you"
        )
    return kernel


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 (bf16 in the interpreter is wrong)."""
    return dtype == torch.bfloat16 and is_interpreted(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a nominal 4 for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


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
