"""Split-KV combine (flash-decoding): the exact merge of partial attention results.

With few query rows against a long KV cache, one program per query block leaves most SMs idle.
The forward kernel then runs with ``SPLIT``: program ``(m, bh, s)`` attends its query block to
the ``s``-th chunk of the keys only and writes that chunk's normalised output ``o_s`` and its
LSE ``lse_s`` (fp32). The chunks are disjoint, so the statistics module's associative merge
puts them back together exactly: each partial is the online pair ``(m, s) = (lse_s, 1)`` with
``o_s`` as its accumulator, and

    m = max_s lse_s,   S = Σ_s e^(lse_s − m),   o = Σ_s e^(lse_s − m)·o_s / S,   lse = m + ln S

A chunk that saw no key has ``lse_s = −inf``: weight 0, the merge's identity. This kernel folds
the chunks one after the other with :func:`flashlite.stats.merge_pair` and
:func:`flashlite.stats.rescale`, the helpers the attention and softmax kernels fold tiles with.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import head_ptr, store_tile
from flashlite.kernels.common import cast
from flashlite.stats import LOG2E, finalize_lse, merge_pair, rescale


@triton.jit
def _split_kv_combine_kernel(
    OP, LSEP, O, LSE,
    stride_ps, stride_pb, stride_ph, stride_pm, stride_pd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, seq_q, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``: merge the ``n_splits`` partials ``OP`` (fp32
    ``(S, B, Hq, Nq, D)``) and ``LSEP`` (fp32 ``(S, B·Hq, Nq)``) into ``O`` ``(B, Hq, Nq, D)``
    and the LSE (fp32 ``(B·Hq, Nq)``)."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keep = (rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_bh = tl.num_programs(1)
    for split in range(0, n_splits):
        lse_s = tl.load(LSEP + (pid_bh + n_bh * split).to(tl.int64) * seq_q + rows,
                        mask=rows < seq_q, other=float("-inf"))  # fmt: skip
        src = head_ptr(OP + stride_ps.to(tl.int64) * split, b, h, stride_pb, stride_ph)
        o_s = tl.load(src + rows.to(tl.int64)[:, None] * stride_pm + offs_d[None, :] * stride_pd,
                      mask=keep, other=0.0)  # fmt: skip
        # the partial is the pair (lse_s, 1) in natural units: SCALE = log2 e gives e^(·)
        m_new, s = merge_pair(m, s, lse_s, tl.full([BLOCK_M], 1.0, tl.float32), LOG2E)
        acc = acc * rescale(m, m_new, LOG2E)[:, None] + o_s * rescale(lse_s, m_new, LOG2E)[:, None]
        m = m_new
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)  # rows no chunk saw: 0, LSE −inf
    tl.store(LSE + pid_bh.to(tl.int64) * seq_q + rows, finalize_lse(m, s, LOG2E),
             mask=rows < seq_q)  # fmt: skip
    o = cast(acc * inv_s[:, None], O.dtype.element_ty, ROUND_BF16)
    store_tile(head_ptr(O, b, h, stride_ob, stride_oh), o, rows, seq_q, stride_om, stride_od,
               offs_d, HEAD_DIM)  # fmt: skip
