"""Jit helpers every kernel shares that are not statistics or masks: the store-side cast and
``tanh`` (soft caps of attention scores and of logits).

Kernels compute in fp32 and round once to the tensor's dtype. On a GPU ``x.to(tl.bfloat16)`` rounds
to nearest even; Triton's interpreter (3.9) truncates instead, which biased every CPU bf16 result
low. With ``ROUND_BF16`` (set by the front-end from ``_backend.round_bf16``) :func:`cast` rounds
the fp32 bits itself first, so the interpreter's truncation is exact and both machines agree bit
for bit (the interpreter still flushes bf16 subnormals to zero).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite._backend import INTERPRETED
from flashlite.stats import LOG2E


@triton.jit
def cast(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x`` (fp32) converted to ``dtype``, rounded to nearest even."""
    if ROUND_BF16:
        # bf16 keeps the top 16 bits of an fp32. Adding 0x7FFF plus the lowest kept bit rounds
        # half-way cases to the even neighbour; NaN stays NaN (its low bits could carry into inf).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


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
