"""The calls ``flashlite traffic --mask`` talks about, built the same way wherever they are
modelled, counted or measured: a gallery mask's tables for sequences of ``N``, the documents of
the document masks as packed sequences of their own, and one forward call of each method."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from flashlite.traffic.shapes import AttentionShape, make_inputs

#: where the calls' tensors go
Device = str | torch.device

#: the masks ``flashlite traffic --mask`` knows, as gallery makers of (N, B, docs)
MASKS = ("causal", "sliding_window", "prefix_lm", "document", "document_causal")


def gallery_mask(name: str, n: int, batch: int, docs: int, device: Device = "cpu") -> Any:
    """A gallery mask for sequences of ``n``: window ``n/8``, prefix ``n/4``, ``docs`` random
    documents per sequence (seed 0; the ids on ``device``)."""
    from flashlite.masking import gallery

    if name == "causal":
        return gallery.causal()
    if name == "sliding_window":
        return gallery.sliding_window(max(1, n // 8))
    if name == "prefix_lm":
        return gallery.prefix_lm(n // 4)
    if name in ("document", "document_causal"):
        ids = _document_ids(n, batch, docs).to(device)
        return (gallery.document if name == "document" else gallery.document_causal)(ids)
    raise ValueError(f"mask {name!r} is not one of {', '.join(MASKS)}")


def _document_ids(n: int, batch: int, docs: int) -> torch.Tensor:
    from flashlite.masking import gallery

    return gallery.random_documents(batch, n, min(docs, n))


def document_lengths(n: int, batch: int, docs: int) -> list[int]:
    """The lengths of :func:`gallery_mask`'s documents, batch by batch, in order."""
    ids = _document_ids(n, batch, docs)
    return [int(c) for row in ids for c in torch.unique_consecutive(row, return_counts=True)[1]]


def varlen_method(mask: str) -> str:
    """The name of the document masks' varlen row."""
    return "varlen-causal" if mask == "document_causal" else "varlen"


def varlen_tables(mask: str, longest: int, block: tuple[int, int], device: Device = "cpu") -> Any:
    """The varlen row's tables: the gallery's causal mask (``document_causal``) or every tile
    (``document``) over the longest document."""
    import flashlite
    from flashlite.masking import gallery
    from flashlite.ops.attention import dense_block_mask

    if mask == "document_causal":
        return flashlite.create_block_mask(
            gallery.causal(), None, None, longest, longest, device=device, BLOCK_SIZE=block
        )
    return dense_block_mask(longest, longest, block, torch.device(device))


def packed_inputs(
    shape: AttentionShape,
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    device: Device = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Random packed ``q (Σ lengths_q, H, D)``, ``k, v (Σ lengths_k, Hkv, D)`` of ``shape``'s
    heads, head dim and dtype, and their int32 offsets ``cu_q``, ``cu_k``: ``(q, k, v, cu_q,
    cu_k)``, seeded."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = shape.heads, shape.hkv, shape.head_dim
    q = torch.randn(sum(lengths_q), H, D, generator=g)
    k, v = (torch.randn(sum(lengths_k), Hkv, D, generator=g) for _ in "kv")
    cu_q, cu_k = (
        torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
        for n in (lengths_q, lengths_k)
    )
    return (*(t.to(device=device, dtype=shape.dtype) for t in (q, k, v)), cu_q, cu_k)


def sparse_call(
    method: str, shape: AttentionShape, mask: str, docs: int, block: tuple[int, int], device: Device
) -> Callable[[], Any]:
    """One forward of ``method`` (``flex-<mask>``, ``flex-dense`` or the varlen row) on random
    inputs of ``shape`` on ``device``, its tables built here, before the call."""
    import flashlite
    from flashlite.ops.attention import dense_block_mask

    if method == varlen_method(mask) and mask.startswith("document"):
        lengths = document_lengths(shape.seq_q, shape.batch, docs)
        longest = max(lengths)
        q, k, v, cu, _ = packed_inputs(replace(shape, batch=len(lengths)), lengths, lengths, device)
        bm = varlen_tables(mask, longest, block, device)
        return lambda: flashlite.attention_varlen(
            q, k, v, cu, cu, longest, longest, validate=False, block_mask=bm
        )
    q, k, v = make_inputs(shape, device)
    if method == f"flex-{mask}":
        mm = gallery_mask(mask, shape.seq_q, shape.batch, docs, device)
        batch = shape.batch if mask.startswith("document") else None
        bm = flashlite.create_block_mask(
            mm, batch, None, shape.seq_q, shape.nk, device=device, BLOCK_SIZE=block
        )
    elif method == "flex-dense":
        bm = dense_block_mask(shape.seq_q, shape.nk, block, torch.device(device))
    else:
        raise ValueError(f"method {method!r} is not flex-{mask}, flex-dense or the varlen row")
    return lambda: flashlite.flex_attention(q, k, v, block_mask=bm)
