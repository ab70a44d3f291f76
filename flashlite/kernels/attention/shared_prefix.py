"""The merge step of shared-prefix (cascade) decoding
(:mod:`flashlite.ops.attention.shared_prefix`): two partial attention results over disjoint keys,
the shared prefix's and a request's own (a sink already in the latter), folded into the exact
result in one launch.

Each partial ``(o_x, lse_x)`` is the online pair ``(m, s) = (lse_x, 1)`` with ``o_x`` as its
normalised accumulator. The statistics module's merge gives the union's pair, and each output
moves onto it with its own weight::

    (m, s) = merge((lse_a, 1), (lse_b, 1))
    o = (e^(lse_a − m)·o_a + e^(lse_b − m)·o_b) / s,      lse = m + ln s

Its torch twin is :func:`flashlite.ops.attention.backends.split_kv.merge.merge_torch`
(:func:`flashlite.stats.merge_attention`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.common import cast
from flashlite.stats import LOG2E, finalize_lse, merge_pair, rescale


@triton.jit
def _row_pair(O, LSE, b, h, i, offs_d, o_strides, lse_strides, HEAD_DIM: tl.constexpr):
    """Row ``(b, h, i)`` of a partial: its output ``[BLOCK_D]`` (fp32) and LSE ``[1]``; the
    strides are O's ``(b, h, m, d)`` and the LSE's ``(b, h, m)``."""
    stride_b, stride_h, stride_m, stride_d = o_strides
    stride_lb, stride_lh, stride_lm = lse_strides
    lse = tl.load(
        LSE
        + b.to(tl.int64) * stride_lb
        + h.to(tl.int64) * stride_lh
        + i.to(tl.int64) * stride_lm
        + tl.arange(0, 1)
    )
    src = (
        O
        + b.to(tl.int64) * stride_b
        + h.to(tl.int64) * stride_h
        + i.to(tl.int64) * stride_m
        + offs_d * stride_d
    )
    return tl.load(src, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32), lse


@triton.jit
def _shared_prefix_merge_kernel(
    OA,
    LSEA,
    OB,
    LSEB,
    O,
    LSE,
    stride_ab,
    stride_ah,
    stride_am,
    stride_ad,
    stride_lab,
    stride_lah,
    stride_lam,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bd,
    stride_lbb,
    stride_lbh,
    stride_lbm,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    n_heads,
    seq_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Grid ``(B·Hq, Nq)``: row ``(b, h, i)`` of the partials A and B (any strides, outputs
    ``(B, Hq, Nq, D)``, LSEs ``(B, Hq, Nq)``) merged into ``O`` ``(B, Hq, Nq, D)`` (any strides)
    and the dense fp32 LSE ``(B, Hq, Nq)``."""
    pid_bh = tl.program_id(0)
    i = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    offs_d = tl.arange(0, BLOCK_D)
    a_out = (stride_ab, stride_ah, stride_am, stride_ad)
    a_lse = (stride_lab, stride_lah, stride_lam)
    o_a, lse_a = _row_pair(OA, LSEA, b, h, i, offs_d, a_out, a_lse, HEAD_DIM)
    b_out = (stride_bb, stride_bh, stride_bm, stride_bd)
    b_lse = (stride_lbb, stride_lbh, stride_lbm)
    o_b, lse_b = _row_pair(OB, LSEB, b, h, i, offs_d, b_out, b_lse, HEAD_DIM)
    one = tl.full([1], 1.0, tl.float32)
    m, s = merge_pair(lse_a, one, lse_b, one, LOG2E)
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)  # rows that saw nothing: 0 (and LSE −inf)
    o = (o_a * rescale(lse_a, m, LOG2E) + o_b * rescale(lse_b, m, LOG2E)) * inv_s
    tl.store(LSE + pid_bh.to(tl.int64) * seq_q + i + tl.arange(0, 1), finalize_lse(m, s, LOG2E))
    dst = (
        O
        + b.to(tl.int64) * stride_ob
        + h.to(tl.int64) * stride_oh
        + i.to(tl.int64) * stride_om
        + offs_d * stride_od
    )
    tl.store(dst, cast(o, O.dtype.element_ty, ROUND_BF16), mask=offs_d < HEAD_DIM)
