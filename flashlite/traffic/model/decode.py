"""Decoding's bytes: GQA packing and split-KV, as the decode kernel reads the cache."""

from __future__ import annotations

import triton

from flashlite.masking import masks
from flashlite.ops.attention.backends.split_kv.decode import key_chunks
from flashlite.traffic.shapes import (
    DESCALE_BYTES,
    AttentionShape,
    Traffic,
)


def decode_rows_per_head(shape: AttentionShape) -> int:
    """Packed query rows per KV head in the decode kernel: ``Nq·Hq/Hkv``."""
    return shape.seq_q * (shape.heads // shape.hkv)


def decode_splits(shape: AttentionShape, block_m: int, sms: int = 132) -> int:
    """The key chunks :func:`flashlite.ops.attention.attention_decode_fwd` picks on a GPU of
    ``sms`` SMs (the H200 has 132) for ``shape``."""
    from flashlite.ops.attention import splits_for

    rows = decode_rows_per_head(shape)
    return splits_for(shape.batch * shape.hkv, rows, shape.nk, sms, block_m)


def decode_lanes(
    shape: AttentionShape,
    block_m: int,
    block_n: int,
    splits: int,
    mask: masks.Mask = masks.CAUSAL,
    keys: tuple[int, int] | None = None,
) -> int:
    """``Σ lanes`` of :func:`model_flashlite_decode`: the key lanes the decode kernel loads for
    one KV head of one batch, over its row blocks and chunks, counting only keys in ``keys``
    ``[k0, k1)`` (None: all ``Nk``; a slice of the cache, such as a prefix copied into it)."""
    Nq, Nk = shape.seq_q, shape.nk
    group, rows = shape.heads // shape.hkv, decode_rows_per_head(shape)
    k0, k1 = (0, Nk) if keys is None else keys
    split_len, splits = key_chunks(Nk, block_n, splits)  # the decode plan's own split
    lanes = 0
    for r0 in range(0, rows, block_m):
        # (the kernel visits [lo, hi): a window's left-edge tiles, the full ones, the last ones)
        lo, _, _, hi = masks.torch_key_range(r0 // group, block_m, block_n, Nq, Nk, mask)
        for c in range(splits):
            c0, c1 = c * split_len, (c + 1) * split_len
            start, end = min(max(lo, c0), c1), min(max(hi, c0), c1)
            lanes += sum(
                max(0, min(j + block_n, Nk, k1) - max(j, k0)) for j in range(start, end, block_n)
            )
    return lanes


def model_flashlite_decode(
    shape: AttentionShape,
    block_m: int,
    block_n: int,
    splits: int,
    *,
    mask: masks.Mask = masks.CAUSAL,
    lengths: bool = True,
) -> Traffic:
    """Bytes the decode kernel issues (:func:`flashlite.attention_kvcache` without new tokens: a
    full contiguous cache of ``Nk`` keys per batch).

    The ``G = Hq/Hkv`` query heads of a KV head are packed into one tile of ``R = Nq·G`` rows,
    so every K/V tile is read once per KV head, not once per query head. Program ``(row block,
    batch·KV head, chunk)`` loads its batch's length (4 bytes), its Q rows and the K and V
    lanes of the key tiles its chunk of ``key_range`` visits (lanes past ``Nk`` masked), then
    stores its rows' output and LSE: in the inputs' dtype without a split, else fp32 partials
    that the combine kernel reads back (``S`` partials a row) before writing O and LSE::

        read  = programs·4 + S·B·Hq·Nq·D·b + 2·B·Hkv·D·b·Σ lanes  [+ B·Hq·Nq·S·(4·D + 4)]
        write = B·Hq·Nq·(D·b + 4)                                  [or S·B·Hq·Nq·(4·D + 4) + that]

    ``Σ lanes`` (:func:`decode_lanes`) runs over row blocks and chunks; a row block's key range
    is that of the query positions its rows may hold (``BLOCK_M`` of them from its first row's
    position) under ``mask`` (causal, as :func:`~flashlite.attention_kvcache` decodes by
    default; a window's too). ``lengths=False``: a call without ``seqlens_k``, whose programs
    read no length. FP8 (``shape.fp8``): the cache is e4m3 (``b`` = 1), the queries and the
    output bf16, and each program reads its three descale factors (12 bytes).
    """
    b, bq = shape.itemsize, shape.out_itemsize  # (FP8: an e4m3 cache, bf16 queries)
    B, Hq, Hkv = shape.batch, shape.heads, shape.hkv
    Nq, Nk, D = shape.seq_q, shape.nk, shape.head_dim
    lanes = decode_lanes(shape, block_m, block_n, splits, mask)
    splits = key_chunks(Nk, block_n, splits)[1]  # the decode plan's own split
    programs = triton.cdiv(decode_rows_per_head(shape), block_m) * B * Hkv * splits
    t = Traffic()
    if lengths:
        t.add("lengths", programs * 4, 0)
    t.add("q", splits * B * Hq * Nq * D * bq, 0)
    t.add("k", B * Hkv * lanes * D * b, 0)
    t.add("v", B * Hkv * lanes * D * b, 0)
    if shape.fp8:
        t.add("descales", programs * DESCALE_BYTES, 0)
    if splits > 1:
        t.add("partials", 0, splits * B * Hq * Nq * (4 * D + 4))
        t.add("combine", splits * B * Hq * Nq * (4 * D + 4), 0)
    t.add("o", 0, B * Hq * Nq * D * bq)
    t.add("lse", 0, B * Hq * Nq * 4)
    t.info = {"config": f"{block_m}x{block_n}", "splits": splits}
    return t
