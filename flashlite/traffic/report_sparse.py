"""Block-sparse attention's traffic rows: :func:`flashlite.flex_attention` with a gallery mask,
against the same kernel over every tile (dense) and the materialising reference, in the table
format of :mod:`flashlite.traffic.report`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flashlite.traffic.report import format_mb, format_ratio, progress_bar, text_table
from flashlite.traffic.shapes import AttentionShape, Traffic, byte_fields
from flashlite.traffic.sparse_calls import (
    MASKS,
    document_lengths,
    gallery_mask,
    varlen_method,
    varlen_tables,
)

__all__ = ["MASKS", "block_sparse_rows", "format_block_sparse_table"]


def block_sparse_rows(
    shapes: Sequence[AttentionShape],
    mask: str,
    *,
    docs: int = 8,
    count: bool = False,
    block: tuple[int, int] = (128, 128),
    kernel_block: tuple[int, int] = (128, 64),
    measure: bool = False,
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Three rows per shape: flex_attention with the ``mask`` tables, the same kernel over
    dense tables, and the naive reference (model), with the bytes the mask saves; for the
    document masks a fourth, second: the same documents packed as sequences of their own
    (:func:`flashlite.attention_varlen` with the gallery's causal mask, or every tile). The model
    uses ``block`` tables and the GPU kernel's ``kernel_block``; with ``count`` both flex rows
    are also counted on CPU, and the model is evaluated with the interpreter's tiles (the
    table's own), like for like; with ``measure`` every row but naive's is measured with ncu
    on the GPU (one forward each, tables built before it). Returns the rows and notes."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"{mask} N={shape.seq_q}")
        if shape.seq_q != shape.nk:
            raise ValueError(f"--mask needs Nq = Nk, got {shape.seq_q} and {shape.nk}")
        shape_rows, note = _shape_rows(shape, mask, docs, count, block, kernel_block)
        rows += shape_rows
        notes.append(note)
    if show_progress:
        progress_bar(len(shapes), len(shapes), mask)
    if measure:
        _measure(rows, mask, docs, block, notes)
    if mask.startswith("document"):
        notes.append(
            "varlen: the documents as sequences of their own, attention_varlen with "
            + ("gallery.causal()" if mask == "document_causal" else "every tile")
            + " and the longest document's tables; its tiles are those inside each "
            "document"
        )
    if count:
        notes.append(
            "counted in Triton's interpreter with the table's tiles; the model is "
            "evaluated with the same (without --count: the GPU kernel's)"
        )
    return rows, notes


def _shape_rows(
    shape: AttentionShape,
    mask: str,
    docs: int,
    count: bool,
    block: tuple[int, int],
    kernel_block: tuple[int, int],
) -> tuple[list[dict[str, Any]], str]:
    """:func:`block_sparse_rows`'s rows of one shape and its note on the bytes the mask saves."""
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
    tiles = block if count else kernel_block
    mm = gallery_mask(mask, shape.seq_q, shape.batch, docs)
    per_batch = mask.startswith("document")
    bm = flashlite.create_block_mask(
        mm,
        shape.batch if per_batch else None,
        None,
        shape.seq_q,
        shape.nk,
        device="cpu",
        BLOCK_SIZE=block,
    )
    dense_bm = dense_block_mask(shape.seq_q, shape.nk, block, torch.device("cpu"))
    flex = model_flex_attention(shape, bm, kernel_block=tiles)
    dense = model_flex_attention(shape, dense_bm, kernel_block=tiles)
    naive_shape = replace(shape, causal=mask != "document")
    naive = model_naive_attention(naive_shape)
    drams = (
        dram_flex_attention(shape, bm),
        dram_flex_attention(shape, dense_bm),
        dram_naive_attention(naive_shape),
    )
    counted: list[Traffic | None] = [None, None, None]
    if count:
        counted[:2] = count_flex_attention(shape, bm), count_flex_attention(shape, dense_bm)
    info = flex.info
    methods = ["flex-" + mask, "flex-dense", "naive"]
    figures, kernel_tiles = [flex, dense, naive], [tiles] * 3
    if per_batch:  # the same documents packed as sequences of their own
        v = _varlen(shape, mask, docs, block, count, None if count else kernel_block)
        methods.insert(1, v.method)
        figures.insert(1, v.model)
        counted.insert(1, v.counted)
        drams = (drams[0], v.dram, *drams[1:])
        kernel_tiles.insert(1, v.model.info["tiles"])
    for method, m, c, dram, kt in zip(methods, figures, counted, drams, kernel_tiles, strict=True):
        rows.append(
            {
                "method": method,
                "seq_len": shape.seq_q,
                **byte_fields(model=m, counted=c, dram=dram, measured=None),
                "vs_flex": m.total / flex.total,
                "tiles": _tiles(m) if method != "naive" else "-",
                "kernel_tiles": f"{kt[0]}x{kt[1]}",
                "shape": shape.to_json(),
            }
        )
    saved = dense.parts["k"][0] + dense.parts["v"][0] - flex.parts["k"][0] - flex.parts["v"][0]
    note = (
        f"N={shape.seq_q}: empty tiles save {format_mb(saved)} MB of issued K/V reads "
        f"({info['empty']} of {info['full'] + info['partial'] + info['empty']} "
        f"tiles of {block[0]}x{block[1]})"
    )
    return rows, note


def _measure(
    rows: list[dict[str, Any]], mask: str, docs: int, block: tuple[int, int], notes: list[str]
) -> None:
    """Fill the rows' ``measured_*`` fields from one ncu run over every kernel row."""
    from flashlite.traffic.measure import measure_flex

    shown = [r for r in rows if r["method"] != "naive"]
    calls = [(r["method"], AttentionShape.from_json(r["shape"])) for r in shown]
    measured, message = measure_flex(calls, mask, docs, block)
    for r, t in zip(shown, measured, strict=True):
        r.update(byte_fields(measured=t))
    if message:
        notes.append(message)


@dataclass
class _VarlenFigures:
    method: str
    model: Traffic
    counted: Traffic | None
    dram: Traffic


def _varlen(
    shape: AttentionShape,
    mask: str,
    docs: int,
    block: tuple[int, int],
    count: bool,
    kernel_block: tuple[int, int] | None,
) -> _VarlenFigures:
    """The documents of ``mask`` (``document`` or ``document_causal``, as
    :func:`gallery_mask` draws them) as packed sequences of their own:
    :func:`flashlite.attention_varlen` with the gallery's causal mask (``document_causal``) or
    every tile (``document``), its tables the longest document's. ``kernel_block`` None: the
    table's tiles (the interpreter's), else the GPU's Triton forward's."""
    from flashlite.ops.attention.backends.tables.args import triton_fwd_tiles
    from flashlite.traffic.count_sparse import count_flex_varlen
    from flashlite.traffic.model import dram_flex_varlen, model_flex_varlen

    lengths = document_lengths(shape.seq_q, shape.batch, docs)
    longest = max(lengths)
    vshape = replace(shape, batch=len(lengths), seq_q=longest, seq_k=None)
    vbm = varlen_tables(mask, longest, block)
    tiles = block if kernel_block is None else triton_fwd_tiles(shape.head_dim, block, True)
    return _VarlenFigures(
        varlen_method(mask),
        model_flex_varlen(vshape, lengths, lengths, vbm, kernel_block=tiles),
        count_flex_varlen(vshape, lengths, lengths, vbm) if count else None,
        dram_flex_varlen(vshape, lengths, lengths, vbm),
    )


def _tiles(t: Traffic) -> str:
    return f"{t.info['full']}/{t.info['partial']}/{t.info['empty']}"


def format_block_sparse_table(rows: Sequence[dict[str, Any]]) -> str:
    """The block-sparse table: one line per (method, sequence length)."""
    return text_table(
        rows,
        [
            ("method", -24, lambda r: r["method"]),
            ("N", 7, lambda r: str(r["seq_len"])),
            ("full/partial/empty", 26, lambda r: r["tiles"]),
            ("model MB", 12, lambda r: format_mb(r["model_bytes"])),
            ("counted MB", 13, lambda r: format_mb(r["counted_bytes"])),
            ("DRAM est MB", 14, lambda r: format_mb(r["dram_bytes"])),
            ("measured MB", 14, lambda r: format_mb(r["measured_bytes"])),
            ("vs flex", 9, lambda r: format_ratio(r["vs_flex"])),
        ],
    )
