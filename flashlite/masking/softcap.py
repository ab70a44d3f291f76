"""The soft cap's ``tanh``: scores (the built-in ``softcap``, the gallery's ``tanh_softcap``) and
logits (cross-entropy's ``softcap``) become ``cap·tanh(x / cap)``. A jit helper on floor 0, so
that the gallery's score functions and the kernels share one formula."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite._backend import INTERPRETED
from flashlite.stats import LOG2E

__all__ = ["tanh"]

#: Whether the GPU's ``tanh.approx.f32`` (one special-function instruction, about 2^-11
#: relative error) may stand in for :func:`tanh`'s formula; the interpreter runs no inline PTX.
HW_TANH: tl.constexpr = tl.constexpr(not INTERPRETED)


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """``tanh(x)``. ``FAST`` on a GPU: the hardware approximation, for scores of 16-bit inputs
    (their own rounding is coarser); otherwise from one ``exp2`` and one division, ±1 (not
    NaN) where ``exp2`` overflows or underflows."""
    if FAST and HW_TANH:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t
