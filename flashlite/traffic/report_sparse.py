"""Block-sparse attention's traffic rows: :func:`flashlite.flex_attention` with a gallery mask,
against the same kernel over every tile (dense) and the materialising reference, in the table
format of :mod:`flashlite.traffic.report`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flashlite.traffic.report import format_mb, format_ratio, progress_bar, text_table
from flashlite.traffic.shapes import AttentionShape, Traffic, byte_fields

#: the masks ``flashlite traffic --mask`` knows, as gallery makers of (N, B, docs)
MASKS = ("causal", "sliding_window", "prefix_lm", "document", "document_causal")


def gallery_mask(name: str, n: int, batch: int, docs: int) -> Any:
    """A gallery mask for sequences of ``n``: window ``n/8``, prefix ``n/4``, ``docs`` random
    documents per sequence (seed 0)."""
    from flashlite import gallery

    if name == "causal":
        return gallery.causal()
    if name == "sliding_window":
        return gallery.sliding_window(max(1, n // 8))
    if name == "prefix_lm":
        return gallery.prefix_lm(n // 4)
    if name in ("document", "document_causal"):
        ids = gallery.random_documents(batch, n, min(docs, n))
        return (gallery.document if name == "document" else gallery.document_causal)(ids)
    raise ValueError(f"mask {name!r} is not one of {', '.join(MASKS)}")


def block_sparse_rows(
    shapes: Sequence[AttentionShape],
    mask: str,
    *,
    docs: int = 8,
    count: bool = False,
    block: tuple[int, int] = (128, 128),
    kernel_block: tuple[int, int] = (128, 64),
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Three rows per shape: flex_attention with the ``mask`` tables, the same kernel over
    dense tables, and the naive reference (model), with the bytes the mask saves. The model
    uses ``block`` tables and the GPU kernel's ``kernel_block``; with ``count`` both flex rows
    are also counted on CPU, and the model is evaluated with the interpreter's tiles (the
    table's own), like for like. Returns the rows and notes."""
    import torch

    import flashlite
    from flashlite.ops.attention import dense_block_mask
    from flashlite.traffic.count_sparse import count_flex_attention
    from flashlite.traffic.model import (
        dram_flex_attention,
        dram_naive_attention,
        model_flex_attention,
        model_naive_attention,
    )

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    tiles = block if count else kernel_block
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"{mask} N={shape.seq_q}")
        if shape.seq_q != shape.nk:
            raise ValueError(f"--mask needs Nq = Nk, got {shape.seq_q} and {shape.nk}")
        mm = gallery_mask(mask, shape.seq_q, shape.batch, docs)
        per_batch = mask.startswith("document")
        bm = flashlite.create_block_mask(mm, shape.batch if per_batch else None, None,
                                         shape.seq_q, shape.nk, device="cpu",
                                         BLOCK_SIZE=block)  # fmt: skip
        dense_bm = dense_block_mask(shape.seq_q, shape.nk, block, torch.device("cpu"))
        flex = model_flex_attention(shape, bm, kernel_block=tiles)
        dense = model_flex_attention(shape, dense_bm, kernel_block=tiles)
        naive_shape = replace(shape, causal=mask != "document")
        naive = model_naive_attention(naive_shape)
        drams = (dram_flex_attention(shape, bm), dram_flex_attention(shape, dense_bm),
                 dram_naive_attention(naive_shape))  # fmt: skip
        counted: tuple[Traffic | None, Traffic | None] = (None, None)
        if count:
            counted = (count_flex_attention(shape, bm), count_flex_attention(shape, dense_bm))
        info = flex.info
        methods = ("flex-" + mask, "flex-dense", "naive")
        for method, m, c, dram in zip(methods, (flex, dense, naive), (*counted, None), drams,
                                      strict=True):  # fmt: skip
            rows.append({
                "method": method, "seq_len": shape.seq_q,
                **byte_fields(model=m, counted=c, dram=dram),
                "vs_flex": m.total / flex.total,
                "tiles": _tiles(m) if method != "naive" else "-",
                "kernel_tiles": f"{tiles[0]}x{tiles[1]}", "shape": shape.to_json(),
            })  # fmt: skip
        saved = dense.parts["k"][0] + dense.parts["v"][0] - flex.parts["k"][0] - flex.parts["v"][0]
        notes.append(f"N={shape.seq_q}: empty tiles save {format_mb(saved)} MB of issued K/V reads "
                     f"({info['empty']} of {info['full'] + info['partial'] + info['empty']} "
                     f"tiles of {block[0]}x{block[1]})")  # fmt: skip
    if show_progress:
        progress_bar(len(shapes), len(shapes), mask)
    if count:
        notes.append("counted in Triton's interpreter with the table's tiles; the model is "
                     "evaluated with the same (without --count: the GPU kernel's)")  # fmt: skip
    return rows, notes


def _tiles(t: Traffic) -> str:
    return f"{t.info['full']}/{t.info['partial']}/{t.info['empty']}"


def format_block_sparse_table(rows: Sequence[dict[str, Any]]) -> str:
    """The block-sparse table: one line per (method, sequence length)."""
    return text_table(rows, [
        ("method", -24, lambda r: r["method"]),
        ("N", 7, lambda r: str(r["seq_len"])),
        ("full/partial/empty", 26, lambda r: r["tiles"]),
        ("model MB", 12, lambda r: format_mb(r["model_bytes"])),
        ("counted MB", 13, lambda r: format_mb(r["counted_bytes"])),
        ("DRAM est MB", 14, lambda r: format_mb(r["dram_bytes"])),
        ("vs flex", 9, lambda r: format_ratio(r["vs_flex"])),
    ])  # fmt: skip
