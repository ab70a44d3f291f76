"""Absorbed multi-head latent attention's bytes (:func:`flashlite.attention_mla_decode`): the MLA
kernel's issued bytes, exactly, and what per-head caches of the same model would hold.

A shape here is one decode step: ``B`` requests, ``Nq`` new queries of ``Hq`` heads, each
``D = head_dim`` wide (latent + rotary, 576 for DeepSeek), against ``Nk`` cached tokens of one
latent row each; ``head_dim_v`` of its columns (512) are the values.
"""

from __future__ import annotations

import triton

from flashlite.ops.attention.backends.split_kv.decode import key_chunks
from flashlite.traffic.shapes import AttentionShape, Traffic


def mla_lanes(shape: AttentionShape, block_h: int, block_n: int, splits: int) -> int:
    """``Σ lanes``: the latent rows the MLA kernel loads for one batch, over its blocks of
    ``block_h`` packed query rows and its key chunks (causal: a block reads up to the last key
    its last query sees; lanes past ``Nk`` masked)."""
    nq, nk, hq = shape.seq_q, shape.nk, shape.heads
    split_len, splits = key_chunks(nk, block_n, splits)
    lanes = 0
    for r0 in range(0, nq * hq, block_h):
        last = min((r0 + block_h - 1) // hq, nq - 1)
        for c in range(splits):
            lo, hi = c * split_len, min((c + 1) * split_len, nk, nk - nq + last + 1)
            lanes += sum(min(j + block_n, nk) - j for j in range(lo, hi, block_n))
    return lanes


def model_flashlite_mla(
    shape: AttentionShape, head_dim_v: int, block_h: int, block_n: int, splits: int
) -> Traffic:
    """Bytes the MLA kernel (and, split, the combine kernel) issues for one step against full
    contiguous caches of ``Nk`` tokens.

    Program ``(row block, batch, chunk)`` reads its batch's length (4 bytes), its ``block_h``
    query rows (``D`` columns each, rows past ``Nq·Hq`` masked) and the latent rows its chunk
    visits, ``D`` columns each: the values are the first ``head_dim_v`` of the same bytes, read
    once. It writes its rows' output (``head_dim_v`` columns) and LSE, as the decode kernel
    does (:func:`~flashlite.traffic.model.model_flashlite_decode`)::

        read  = programs·4 + S·B·Hq·Nq·D·b + B·D·b·Σ lanes  [+ B·Hq·Nq·S·(4·Dv + 4)]
        write = B·Hq·Nq·(Dv·b + 4)                          [or S·B·Hq·Nq·(4·Dv + 4) + that]
    """
    b, d, dv = shape.itemsize, shape.head_dim, head_dim_v
    bsz, hq, nq = shape.batch, shape.heads, shape.seq_q
    splits = key_chunks(shape.nk, block_n, splits)[1]
    programs = triton.cdiv(nq * hq, block_h) * bsz * splits
    t = Traffic()
    t.add("lengths", programs * 4, 0)
    t.add("q", splits * bsz * hq * nq * d * b, 0)
    t.add("latent", bsz * mla_lanes(shape, block_h, block_n, splits) * d * b, 0)
    if splits > 1:
        t.add("partials", 0, splits * bsz * hq * nq * (4 * dv + 4))
        t.add("combine", splits * bsz * hq * nq * (4 * dv + 4), 0)
    t.add("o", 0, bsz * hq * nq * dv * b)
    t.add("lse", 0, bsz * hq * nq * 4)
    t.info = {"config": f"{block_h}x{block_n}", "splits": splits}
    return t


def compulsory_mla(shape: AttentionShape, head_dim_v: int) -> Traffic:
    """The step's floor: Q and the latent cache read once, O written once."""
    b, d = shape.itemsize, shape.head_dim
    rows = shape.batch * shape.heads * shape.seq_q
    t = Traffic()
    t.add("q", rows * d * b, 0)
    t.add("latent", shape.batch * shape.nk * d * b, 0)
    t.add("o", 0, rows * head_dim_v * b)
    return t


def per_head_cache_bytes(shape: AttentionShape, head_dims: tuple[int, int]) -> int:
    """What one step reads of per-head K and V caches of the same model (``head_dims`` = K's and
    V's per-head widths, DeepSeek's ``(192, 128)``; one K/V head per query head): the bytes the
    absorbed form's one latent row per token replaces."""
    dk, dv = head_dims
    return shape.batch * shape.nk * shape.heads * (dk + dv) * shape.itemsize
