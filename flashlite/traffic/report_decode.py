"""Decoding's traffic rows: the decode kernel (:func:`decode_rows`) and the shared-prefix step
(:func:`shared_prefix_rows`), each against what users would run otherwise, in the table format
of :mod:`flashlite.traffic.report`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flashlite.traffic.measure import Measurement, measure_attention
from flashlite.traffic.model import GPUS, compulsory_attention
from flashlite.traffic.report import format_mb, format_ratio, progress_bar, text_table
from flashlite.traffic.shapes import AttentionShape, Traffic, byte_fields


def decode_rows(
    shapes: Sequence[AttentionShape],
    *,
    count: bool = False,
    measure: bool = False,
    splits: int | None = None,
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (method, shape) for decoding: flashlite's decode kernel (model; counted on
    CPU with the GPU's tile and split count, or ``splits``; measured with ncu) against the
    materialising reference (counted; measured), and the compulsory bytes (Q, K and V read
    once, O and the LSE written once). Returns the rows and notes on what was not measured."""
    from flashlite.ops.attention import decode_tiles
    from flashlite.traffic.count import count_decode
    from flashlite.traffic.model import decode_rows_per_head, decode_splits, model_flashlite_decode

    measured: dict[str, Measurement] = {}
    notes: list[str] = []
    if measure:
        for method in ("flashlite", "naive"):
            measured[method] = measure_attention(method, shapes, decode=True)
            if measured[method].message:
                notes.append(measured[method].message)
    rows: list[dict[str, Any]] = []
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"decode Nk={shape.nk}")
        config = decode_tiles(
            decode_rows_per_head(shape), shape.batch * shape.hkv, shape.head_dim, shape.out_itemsize
        )
        bm, bn = config.block_m, config.block_n
        n_splits = splits or decode_splits(shape, bm)
        model = model_flashlite_decode(shape, bm, bn, n_splits)
        flash = naive = None
        if count:
            flash, naive = count_decode(shape, config, n_splits)
        comp = compulsory_attention(shape)
        for method, m, c in (("flashlite", model, flash), ("naive", None, naive)):
            meas = measured[method].traffic[j] if method in measured else None
            best = next((t for t in (meas, c, m) if t is not None), None)
            rows.append(
                {
                    "method": f"{method}-decode",
                    "seq_len": shape.nk,
                    **byte_fields(model=m, counted=c, dram=None, measured=meas),
                    "compulsory_bytes": comp.total,
                    "vs_compulsory": best.total / comp.total if best else None,
                    "config": (
                        f"{bm}x{bn}, {model.info['splits']} splits"
                        if method == "flashlite"
                        else None
                    ),
                    "shape": shape.to_json(),
                }
            )
    if show_progress:
        progress_bar(len(shapes), len(shapes), "decode")
    return rows, notes


def shared_prefix_rows(
    shapes: Sequence[AttentionShape],
    n_prefix: int,
    *,
    count: bool = False,
    splits: int | None = None,
    gpu: str = "h200",
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Two rows per shape for shared-prefix decoding (``shape``: B requests of Nq queries, a
    full suffix cache of ``L = shape.nk`` keys each, causal, no window): one
    :func:`flashlite.attention_shared_prefix` step over a prefix of ``n_prefix`` keys and
    :func:`flashlite.attention_kvcache` over per-request copies of it (``Np + L`` keys each),
    with the bytes of the prefix's K and V that each reads and the ratios to the shared step.

    The model uses the ``gpu`` table's decode tiles and the split counts each pass picks on
    its SMs (or ``splits`` for every pass). With ``count`` both run on the CPU
    (:func:`~flashlite.traffic.count.count_shared_prefix`) with the interpreter's tiles, as
    the op takes no tile config, and ``num_splits = splits or 1``; the model is then evaluated
    with those same tiles and splits, so the two columns compare like for like. Returns the
    rows and notes."""
    from flashlite.traffic.count import count_shared_prefix

    sms = GPUS[gpu].sms
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"shared prefix L={shape.nk}")
        shared, copies, s_splits = _prefix_models(shape, n_prefix, count, splits, sms)
        counted: tuple[Traffic | None, Traffic | None] = (None, None)
        if count:
            counted = count_shared_prefix(shape, n_prefix, s_splits)
        info = shared.info
        configs = (
            f"suffix {info['suffix_config']} S={info['suffix_splits']}; "
            f"prefix {info['prefix_config']} S={info['prefix_splits']}",
            f"{copies.info['config']} S={copies.info['splits']}",
        )
        shared_prefix = shared.parts["prefix k"][0] + shared.parts["prefix v"][0]
        for method, m, c, config in zip(
            ("flashlite-shared-prefix", "kvcache-prefix-copies"),
            (shared, copies),
            counted,
            configs,
            strict=True,
        ):
            prefix_bytes = m.parts["prefix k"][0] + m.parts["prefix v"][0]
            rows.append(
                {
                    "method": method,
                    "prefix_len": n_prefix,
                    "seq_len": shape.nk,
                    **byte_fields(model=m, counted=c),
                    "prefix_bytes": prefix_bytes,
                    "prefix_vs_shared": prefix_bytes / shared_prefix,
                    "vs_shared": m.total / shared.total,
                    "config": config,
                    "tiles": "interpreter" if count else gpu,
                    "shape": shape.to_json(),
                }
            )
        if info["prefix_row_blocks"] > 1:
            prefix_rows = shape.batch * shape.heads * shape.seq_q // shape.hkv
            notes.append(
                f"L={shape.nk}: the prefix pass's {prefix_rows} rows per KV head take "
                f"{info['prefix_row_blocks']} row blocks, each reading the prefix (issued "
                "bytes; L2 may serve the repeats)"
            )
    if show_progress:
        progress_bar(len(shapes), len(shapes), "shared prefix")
    if count:
        notes.append(
            "counted in Triton's interpreter with its decode tiles and num_splits="
            f"{splits or 1} for every pass; the model is evaluated with the same (without "
            f"--count: the {gpu} table's tiles and split counts)"
        )
    return rows, notes


def _prefix_models(
    shape: AttentionShape, n_prefix: int, count: bool, splits: int | None, sms: int
) -> tuple[Traffic, Traffic, int]:
    """:func:`shared_prefix_rows`'s models of one shape, the shared step's and the copies', and
    the suffix pass's split count: the interpreter's tiles with ``count`` (else the table's),
    ``splits or 1`` for every pass with ``count`` or ``splits`` (else each pass's own)."""
    from flashlite.traffic.model import (
        decode_splits,
        model_flashlite_shared_prefix,
        model_kvcache_prefix_copies,
        shared_prefix_splits,
        shared_prefix_tiles,
    )

    suffix_cfg, prefix_cfg = shared_prefix_tiles(shape, interpreted=count)
    bm, bn = suffix_cfg.block_m, suffix_cfg.block_n
    if count or splits:
        s_splits = p_splits = c_splits = splits or 1
    else:
        s_splits, p_splits = shared_prefix_splits(shape, n_prefix, bm, sms)
        c_splits = decode_splits(replace(shape, seq_k=n_prefix + shape.nk), bm, sms)
    prefix_tiles = (prefix_cfg.block_m, prefix_cfg.block_n)
    shared = model_flashlite_shared_prefix(
        shape,
        n_prefix,
        suffix_tiles=(bm, bn),
        prefix_tiles=prefix_tiles,
        suffix_splits=s_splits,
        prefix_splits=p_splits,
    )
    copies = model_kvcache_prefix_copies(shape, n_prefix, bm, bn, c_splits)
    return shared, copies, s_splits


def format_shared_prefix_table(rows: Sequence[dict[str, Any]]) -> str:
    """The shared-prefix table: one line per (method, suffix length)."""
    return text_table(
        rows,
        [
            ("method", -24, lambda r: r["method"]),
            ("config", -36, lambda r: r["config"]),
            ("Np", 8, lambda r: str(r["prefix_len"])),
            ("L", 7, lambda r: str(r["seq_len"])),
            ("model MB", 12, lambda r: format_mb(r["model_bytes"])),
            ("counted MB", 13, lambda r: format_mb(r["counted_bytes"])),
            ("prefix MB", 12, lambda r: format_mb(r["prefix_bytes"])),
            ("prefix ratio", 14, lambda r: format_ratio(r["prefix_vs_shared"])),
            ("total ratio", 13, lambda r: format_ratio(r["vs_shared"])),
        ],
    )


def mla_rows(
    shapes: Sequence[AttentionShape],
    head_dim_v: int = 512,
    *,
    per_head: tuple[int, int] = (192, 128),
    count: bool = False,
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per shape for absorbed MLA decoding (``shape.head_dim`` = the latent row, 576;
    ``head_dim_v`` of it the values): the MLA kernel's bytes (model; counted on CPU with the
    GPU's tile and split count), the step's compulsory bytes, and what per-head K and V caches
    of ``per_head`` widths would read instead (the bytes the latent cache saves)."""
    from flashlite.ops.attention.backends.split_kv.mla import mla_tiles
    from flashlite.traffic.count import count_mla
    from flashlite.traffic.model import (
        compulsory_mla,
        decode_splits,
        model_flashlite_mla,
        per_head_cache_bytes,
    )

    rows: list[dict[str, Any]] = []
    tiles = mla_tiles(False)
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"mla Nk={shape.nk}")
        splits = decode_splits(replace(shape, kv_heads=1), tiles[0])
        model = model_flashlite_mla(shape, head_dim_v, tiles[0], tiles[1], splits)
        counted = count_mla(shape, head_dim_v, tiles, splits) if count else None
        comp = compulsory_mla(shape, head_dim_v)
        per_head_bytes = per_head_cache_bytes(shape, per_head)
        best = counted or model
        rows.append(
            {
                "method": "flashlite-mla",
                "seq_len": shape.nk,
                **byte_fields(model=model, counted=counted, dram=None, measured=None),
                "compulsory_bytes": comp.total,
                "vs_compulsory": best.total / comp.total,
                "per_head_cache_bytes": per_head_bytes,
                "cache_saving": per_head_bytes / comp.parts["latent"][0],
                "config": f"{model.info['config']}, {model.info['splits']} splits",
                "shape": shape.to_json(),
            }
        )
    if show_progress:
        progress_bar(len(shapes), len(shapes), "mla")
    return rows, []


def format_mla_table(rows: Sequence[dict[str, Any]]) -> str:
    """The MLA table: bytes per step, and what per-head caches would read beside the latent's."""
    return text_table(
        rows,
        [
            ("method", -16, lambda r: r["method"]),
            ("config", -20, lambda r: r["config"]),
            ("Nk", 8, lambda r: str(r["seq_len"])),
            ("model MB", 12, lambda r: format_mb(r["model_bytes"])),
            ("counted MB", 13, lambda r: format_mb(r["counted_bytes"])),
            ("vs compulsory", 15, lambda r: format_ratio(r["vs_compulsory"])),
            ("per-head caches MB", 20, lambda r: format_mb(r["per_head_cache_bytes"])),
            ("latent saves", 14, lambda r: format_ratio(r["cache_saving"])),
        ],
    )
