"""Jit helpers every kernel shares that are not statistics or masks: the store-side cast
(re-exported from ``_backend``) and ``tanh`` (soft caps of attention scores and of logits).

Kernels compute in fp32 and round once to the tensor's dtype with :func:`cast`, which lives in
``_backend`` (the interpreter's rounding is a fact of where kernels run, and ``stats`` rounds
with it too) and is re-exported here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite._backend import INTERPRETED, cast  # noqa: F401  (kernels import it from here)
from flashlite.stats import LOG2E

#: Whether the GPU's ``tanh.approx.f32`` (one special-function instruction, about 2^-11
#: relative error) may stand in for :func:`tanh`'s formula; the interpreter runs no inline PTX.
HW_TANH: tl.constexpr = tl.constexpr(not INTERPRETED)


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """``tanh(x)``. ``FAST`` on a GPU: the hardware approximation, for scores of 16-bit inputs
    (their own rounding is coarser); otherwise from one ``exp2`` and one division, ±1 (not
    NaN) where ``exp2`` overflows or underflows."""
    if FAST and HW_TANH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)  # fmt: skip
    else:
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t
