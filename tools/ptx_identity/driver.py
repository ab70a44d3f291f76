"""The offline target: a stand-in CUDA driver so ``JITFunction.warmup`` compiles for sm_90 on a
machine without a GPU, and the PTX normal form the comparison uses."""

from __future__ import annotations

import hashlib
import os
from typing import Any

#: what the stand-in driver reports: Hopper (sm_90), warp size 32
ARCH = 90


class OfflineDriver:
    """Just enough of Triton's active driver for a compile: a device, a stream and a target.
    Anything else (a launch, a memory query) raises, so nothing runs by accident."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        import torch

        return torch.cuda

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"OfflineDriver.{name}: the offline target only compiles")


def use_offline_target() -> None:
    """Make every later compile target sm_90. Call before flashlite is imported: with
    ``TRITON_INTERPRET=1`` its kernels would be interpreter stand-ins with nothing to compile."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the offline target needs compiled kernels: unset TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # flashlite would turn the interpreter on without CUDA
    from triton.runtime import driver

    driver.set_active(OfflineDriver())


def normalise(ptx: str) -> str:
    """The PTX without what moves when only source positions move: ``.loc``/``.file`` lines,
    comments, ``$L__tmp`` debug labels, blank lines and the trailing debug sections."""
    out = []
    for line in ptx.splitlines():
        text = line.strip()
        if not text or text.startswith((".loc", ".file", "//", "$L__tmp")):
            continue
        if text.startswith(".section") and ".debug" in text:
            break  # the DWARF sections hold line tables and names only
        out.append(text)
    return "\n".join(out)


def digest(text: str) -> str:
    """A short stable name for a normalised PTX text."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def compile_ptx(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The normalised PTX of ``fn`` (a ``@triton.jit`` function) compiled for these arguments
    (tensors, scalars, constexprs as a launch would pass them), without launching."""
    compiled = fn.warmup(*args, grid=(1,), **kwargs)
    return normalise(compiled.asm["ptx"])
