"""Jit helpers every kernel shares that are not statistics or masks: the store-side cast, and
``tanh`` (soft caps of attention scores and of logits) as :mod:`flashlite.masking.softcap` has it.

Kernels compute in fp32 and round once to the tensor's dtype. On a GPU ``x.to(tl.bfloat16)`` rounds
to nearest even; Triton's interpreter (3.9) truncates instead, which biased every CPU bf16 result
low. With ``ROUND_BF16`` (set by the front-end from ``_backend.round_bf16``) :func:`cast` rounds
the fp32 bits itself first, so the interpreter's truncation is exact and both machines agree bit
for bit (the interpreter still flushes bf16 subnormals to zero). Its conversion to e4m3 (FP8
attention's probabilities) loses the carry when rounding up crosses a power of two (0.49 became
0.25), so the same flag rounds to e4m3's grid first there too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.masking.softcap import tanh

__all__ = ["cast", "tanh", "to_e4m3"]  # (tanh: the kernels' import of it, kept)


@triton.jit
def cast(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x`` (fp32) converted to ``dtype``, rounded to nearest even."""
    if ROUND_BF16 and dtype == tl.bfloat16:
        # bf16 keeps the top 16 bits of an fp32. Adding 0x7FFF plus the lowest kept bit rounds
        # half-way cases to the even neighbour; NaN stays NaN (its low bits could carry into inf).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    if ROUND_BF16 and dtype == tl.float8e4nv:
        x = _round_e4m3(x)
    return x.to(dtype)


@triton.jit
def _round_e4m3(x):
    """``x`` (fp32, 0 <= x <= 448: probabilities) rounded to nearest even on e4m3's grid, still
    fp32: 3 mantissa bits for normal values (the fp32 bits, as for bf16), steps of 2^-9 below
    2^-6 (subnormals: adding and taking away 2^14, whose fp32 ulp is 2^-9, rounds to that step).
    (The interpreter converts negative e4m3 subnormals wrongly even when exact.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    tiny = (x + 16384.0) - 16384.0
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """``x`` (fp32) quantised to e4m3: clamped to ±448 (e4m3 has no infinity), rounded to
    nearest even. ``EXACT``: the interpreter's own conversion rounds wrongly (above) and turns
    negative subnormals wrong even when exact, so the magnitude is rounded here and the sign
    set in the bits."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        mag = _round_e4m3(tl.abs(x)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        sign = tl.where(x < 0.0, 128, 0).to(tl.uint8)
        y = (mag | sign).to(tl.float8e4nv, bitcast=True)
    else:
        y = x.to(tl.float8e4nv)
    return y
