"""The Gluon kernels' host side, shared by the ``hopper`` and ``tables`` backends: TMA descriptors
and the shared-memory layouts they fill, and the first build of a kernel variant, which falls back
to the Triton kernels (after one warning) where this Triton's Gluon differs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton

from flashlite._caches import Cache
from flashlite.kernels.attention import hopper as KH

try:  # Gluon's host descriptor (where Gluon is absent, nothing here runs)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # noqa: BLE001
    TensorDescriptor = None


_layouts = Cache("hopper.layouts", 64)


#: What a Gluon kernel that this Triton cannot build raises (its Gluon API differs).
BUILD_ERRORS = (triton.CompilationError, TypeError, ValueError, AttributeError)


def first_build(
    failed: set[Any], key: Any, what: str, build: Callable[[], Any], stacklevel: int = 3
) -> Any:
    """``build()`` (it builds and launches a Gluon kernel) unless it failed before for ``key``:
    on a build error, ``key`` joins ``failed``, one warning names ``what``, and None comes
    back: the caller runs its Triton kernel instead."""
    if key in failed:
        return None
    try:
        return build()
    except BUILD_ERRORS as err:
        failed.add(key)
        warnings.warn(
            f"flashlite: the Hopper {what} kernel failed to build ({err!r:.300}); "
            "the Triton kernel runs instead",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
        return None


def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> object:
    """The swizzled shared-memory layout TMA fills with ``block`` of ``dtype`` (made once)."""
    key = (block, dtype)
    found = _layouts.get(key)
    if found is None:
        gl = KH.gl
        gl_dtype = {
            torch.bfloat16: gl.bfloat16,
            torch.float16: gl.float16,
            torch.float32: gl.float32,
        }[dtype]
        found = _layouts.put(key, gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype))
    return found


def descriptor(t: torch.Tensor, rows: int, cols: int | None = None) -> Any:
    """A 4-D Gluon TMA descriptor of ``t`` ``(B, H, N, D)`` (any 16-byte aligned strides)
    reading ``[1, 1, rows, cols]`` blocks (``cols``: D when None)."""
    block = [1, 1, rows, t.shape[-1] if cols is None else cols]
    layout = shared_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


#: The kernels' block-table and mod arguments when they run without tables (never read).
NO_TABLES = (0,) * 18
