"""Packed sequences' offsets checked on the device, with no host sync
(:func:`flashlite.attention_varlen`).

One program reads both offset tensors and records the first problem for the host:
``RECORD = (flag, which, kind, index, value, limit, 0)``, ``which`` 0 for ``cu_seqlens_q`` and 1
for ``cu_seqlens_k``; kind 1 a first offset that is not 0 (``value`` it), 2 a last offset that is
not the packed length ``limit``, 3 a sequence ``index`` of negative length ``value`` (the offsets
decrease), 4 one longer than its ``max_seqlen`` ``limit``. ``HOST_FLAG[0]`` is set to 1 as well
(pinned host memory on a GPU, which the host reads without waiting). The attention kernels clamp
every offset to the packed lengths, so bad offsets give wrong rows, never an access outside the
tensors: the check only reports them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _offsets_problem(CU, n_seq, total, max_len, BLOCK: tl.constexpr):
    """``(kind, index, value, limit)`` of one offset tensor's first problem (kind 0: none)."""
    first = tl.load(CU).to(tl.int64)
    last = tl.load(CU + n_seq).to(tl.int64)
    kind = tl.where(first != 0, 1, tl.where(last != total, 2, 0))
    index = tl.where(kind == 1, 0, n_seq)
    value = tl.where(kind == 1, first, last)
    limit = value * 0 + total
    worst = tl.zeros((), dtype=tl.int32) + n_seq  # the first sequence of a bad length
    for i0 in range(0, n_seq, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        inside = i < n_seq
        lo = tl.load(CU + i, mask=inside, other=0)
        hi = tl.load(CU + i + 1, mask=inside, other=0)
        wrong = inside & ((hi - lo < 0) | (hi - lo > max_len))
        worst = tl.minimum(worst, tl.min(tl.where(wrong, i, n_seq), axis=0))
    if (kind == 0) & (worst < n_seq):
        length = (tl.load(CU + worst + 1) - tl.load(CU + worst)).to(tl.int64)
        kind = tl.where(length < 0, 3, 4)
        index = worst
        value = length
        limit = value * 0 + tl.where(length < 0, 0, max_len)
    return kind, index, value, limit


@triton.jit
def _offsets_check_kernel(
    CU_Q, CU_K, RECORD, HOST_FLAG, n_seq, total_q, total_k, max_q, max_k, BLOCK: tl.constexpr
):
    kind, index, value, limit = _offsets_problem(CU_Q, n_seq, total_q, max_q, BLOCK)
    zero = value * 0  # (an int64 0: the record's type; sizes of value 1 arrive as constants)
    which = zero
    if kind == 0:
        kind, index, value, limit = _offsets_problem(CU_K, n_seq, total_k, max_k, BLOCK)
        which = zero + 1
    if kind != 0:  # noqa: SIM102  (Triton's `and` would not short-circuit)
        if tl.atomic_cas(RECORD, zero, zero + 1) == 0:  # the first report stands till read
            tl.store(RECORD + 1, which)
            tl.store(RECORD + 2, zero + kind)
            tl.store(RECORD + 3, zero + index)
            tl.store(RECORD + 4, value)
            tl.store(RECORD + 5, limit)
            tl.store(HOST_FLAG, 1)
