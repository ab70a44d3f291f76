"""Tiny kernels for tests/test_ptx_identity_tool.py (Triton needs them in a real file): a
row-scale kernel, a twin with a helper extracted (same operations in the same order) and a
twin with one operation changed."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_rows(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = x * alpha + 1.0
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _affine(x, alpha):
    return x * alpha + 1.0


@triton.jit
def scale_rows_helper(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = _affine(x, alpha)  # (inside the store's arguments it would come after y_ptr + offs)
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def scale_rows_changed(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = (x + 1.0) * alpha  # another operation order: other code
    tl.store(y_ptr + offs, y, mask=mask)
