"""The traffic report: one JSON row per (method, shape), the table, and the log-log plot.

Rows gather every figure :mod:`flashlite.traffic` has for a shape: the model (always), the count
(``count=True``, interpreter) and the measurement (``measure=True``, ncu on a GPU), next to the
compulsory bytes. The ``flashlite traffic`` and ``flashlite demo`` commands print these.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashlite.traffic.count import count_attention, count_attention_bwd, count_softmax
from flashlite.traffic.measure import Measurement, measure_attention, measure_softmax
from flashlite.traffic.model import (
    GPUS,
    compulsory_attention,
    compulsory_attention_bwd,
    compulsory_softmax,
    dram_attention,
    dram_flashlite_attention_bwd,
    dram_softmax,
    flashlite_config,
    l2_note,
    model_attention,
    model_flashlite_attention_bwd,
    model_softmax,
    parse_config,
)
from flashlite.traffic.shapes import (
    SOFTMAX_GPU_ALGORITHMS,
    AttentionShape,
    Traffic,
    byte_fields,
)

_MB = 1e6


def progress_bar(done: int, total: int, label: str = "") -> None:
    """A one-line progress bar on stderr (redrawn in place)."""
    width = 24
    filled = int(width * done / max(total, 1))
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}{end}")
    sys.stderr.flush()


def format_mb(x: int | float | None) -> str:
    """Bytes as MB with three decimals (``-`` for a missing value)."""
    return "-" if x is None else f"{x / _MB:.3f}"


def traffic_rows(
    shapes: Sequence[AttentionShape],
    methods: Sequence[str],
    *,
    count: bool = False,
    measure: bool = False,
    device: str = "cpu",
    show_progress: bool = True,
    gpu: str = "h200",
    config: str | None = None,
    l2_bytes: int | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (method, shape): issued (model, counted), DRAM (estimate, measured) and
    compulsory bytes, plus notes.

    flashlite is counted and modelled with the tile config the ``gpu`` table runs for each
    shape, or with ``config`` (``"BMxBN[xWARPSxSTAGES]"``); each row names it. The DRAM
    estimate uses ``l2_bytes`` (default: the ``gpu`` table's L2).
    """
    if l2_bytes is not None and l2_bytes <= 0:
        raise ValueError(f"l2_bytes={l2_bytes}: the L2 size must be positive")
    pinned = {}  # head dim -> the --config, checked against each head dim before any work
    if config:
        pinned = {s.head_dim: parse_config(config, s.head_dim, s.dtype) for s in shapes}
    notes: list[str] = []
    measured = _measure_methods(methods, shapes, notes, show_progress) if measure else {}
    rows: list[dict[str, Any]] = []
    total = len(methods) * len(shapes)
    for i, method in enumerate(methods):
        for j, shape in enumerate(shapes):
            counted = None
            if count:
                if show_progress:
                    progress_bar(i * len(shapes) + j, total, f"counting {method} N={shape.seq_q}")
                counted = count_attention(method, shape, gpu=gpu, config=pinned.get(shape.head_dim))
            config: dict[str, Any] = {}
            if method == "flashlite":
                m = measured.get(method)
                if m is not None and j in m.configs:
                    config = m.configs[j]
                elif device.startswith("cuda") and torch.cuda.is_available():
                    config = flashlite_config(shape, device)
                else:
                    config = flashlite_config(shape, gpu=gpu, config=pinned.get(shape.head_dim))
            model = model_attention(method, shape, **config)
            tiles = {k: v for k, v in config.items() if k not in ("gpu", "config")}
            dram = dram_attention(method, shape, gpu=gpu, l2_bytes=l2_bytes, **tiles)
            meas = measured[method].traffic[j] if method in measured else None
            comp = compulsory_attention(shape)
            best = next((t for t in (meas, counted, model) if t is not None), None)
            rows.append(
                {
                    "method": method,
                    "seq_len": shape.seq_q,
                    **byte_fields(model=model, counted=counted, dram=dram, measured=meas),
                    "compulsory_bytes": comp.total,
                    "vs_compulsory": best.total / comp.total if best else None,
                    "block_m": config.get("BLOCK_M"),
                    "block_n": config.get("BLOCK_N"),
                    "config": config.get("config"),
                    "gpu": config.get("gpu"),
                    # the L2 the DRAM estimate assumes, and whose GPU table it is
                    "l2_bytes": l2_bytes if l2_bytes is not None else GPUS[gpu].l2_bytes,
                    "l2_gpu": gpu if l2_bytes is None else "--l2-mib",
                    "shape": shape.to_json(),
                }
            )
    if count and show_progress:
        progress_bar(total, total, "counted")
    if measure:
        for shape in shapes:
            note = l2_note(shape)
            if note:
                notes.append(f"N={shape.seq_q}: {note}")
    return rows, notes


def format_ratio(x: float | None) -> str:
    """A ratio as ``1.23x`` (``-`` for a missing value)."""
    return "-" if x is None else f"{x:.2f}x"


#: A column: header, width (negative: left-aligned) and the cell's text for a row.
Column = tuple[str, int, Callable[[dict[str, Any]], str]]


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A fixed-width text table with a rule under the header."""

    def line(cells: Sequence[str]) -> str:
        pairs = zip(cells, (w for _, w, _ in columns), strict=True)
        return "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in pairs)

    head = line([h for h, _, _ in columns])
    return "\n".join([head, "-" * len(head)] + [line([f(r) for _, _, f in columns]) for r in rows])


def _measure_methods(
    methods: Sequence[str], shapes: Sequence[AttentionShape], notes: list[str], show_progress: bool
) -> dict[str, Measurement]:
    """:func:`traffic_rows`'s measurements, one ncu run per method; their messages go to
    ``notes``."""
    measured: dict[str, Measurement] = {}
    for i, method in enumerate(methods):
        if show_progress:
            progress_bar(i, len(methods), f"measuring {method}")
        measured[method] = measure_attention(method, shapes)
        if measured[method].message:
            notes.append(measured[method].message)
    if show_progress:
        progress_bar(len(methods), len(methods), "measured")
    return measured


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The traffic table: one line per (method, sequence length)."""
    return text_table(
        rows,
        [
            ("method", -18, lambda r: r["method"]),
            ("config", -20, lambda r: r.get("config") or "-"),
            ("seq", 7, lambda r: str(r["seq_len"])),
            ("model MB", 12, lambda r: format_mb(r["model_bytes"])),
            ("counted MB", 13, lambda r: format_mb(r["counted_bytes"])),
            ("DRAM est MB", 14, lambda r: format_mb(r.get("dram_bytes"))),
            ("measured MB", 14, lambda r: format_mb(r["measured_bytes"])),
            ("vs compulsory", 15, lambda r: format_ratio(r["vs_compulsory"])),
        ],
    )


def plot_traffic(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """Bytes vs sequence length (log-log) per method, with the compulsory bytes as a line."""
    from flashlite.plotting import Figure, Line, Panel, save

    l2 = next((r for r in rows if r.get("l2_bytes")), None)
    estimate = "DRAM estimate" + (
        f", L2 {l2['l2_bytes'] / 2**20:.0f} MiB ({l2['l2_gpu']})" if l2 is not None else ""
    )
    styles = {
        "model_bytes": ("-", "o", "issued, model"),
        "counted_bytes": (":", "s", "issued, counted"),
        "dram_bytes": ("-.", "D", estimate),
        "measured_bytes": ("--", "^", "DRAM measured"),
    }
    lines = []
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = [r for r in rows if r["method"] == method]
        for key, (ls, marker, label) in styles.items():
            pts = [(r["seq_len"], r[key]) for r in mine if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                style = {"ls": ls, "marker": marker, "color": f"C{i}"}
                lines.append(Line(xs, ys, f"{method} ({label})", style=style))
    comp = sorted({(r["seq_len"], r["compulsory_bytes"]) for r in rows})
    if comp:
        xs, ys = zip(*comp, strict=True)
        style = {"color": "black", "lw": 2}
        lines.append(Line(xs, ys, "compulsory (Q, K, V, O once)", style=style))
    notes = []
    if any(
        r.get("dram_bytes") is not None and r["dram_bytes"] < r["compulsory_bytes"] for r in rows
    ):
        notes.append(
            "DRAM estimate below compulsory: the output's writes still in L2 when\n"
            "the call ends are not counted (they reach DRAM later, as ncu counts)"
        )
    panel = Panel(
        lines,
        title=title or "attention HBM traffic",
        xlabel="sequence length N",
        ylabel="bytes per call: issued (loads + stores) or DRAM",
        notes=notes,
        xlog=2,
        ylog=10,
        grid="both",
    )
    save(Figure([[panel]], panel_size=(7, 4.5)), path)
    return path


#: What ``flashlite traffic --softmax`` shows by default: the lesson of the softmax seeds in bytes
#: (three passes read x three times, the online form twice, single-read once; team and prefetch
#: are the GPU's one-read kernels for long rows).
SOFTMAX_SHOWN = ("three_pass", "online", "single_read", "team", "prefetch")


def softmax_rows(
    rows: int,
    n: int,
    dtype: torch.dtype,
    algorithms: Sequence[str] = SOFTMAX_SHOWN,
    *,
    count: bool = False,
    measure: bool = False,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per softmax algorithm (and ``torch`` when measuring): issued bytes (model,
    counted on CPU; team and prefetch are GPU-only and modelled), the DRAM estimate, measured
    DRAM bytes and the compulsory ``x`` read + ``y`` write."""
    notes: list[str] = []
    measured: dict[str, Traffic | None] = {}
    if measure:
        measured, message = measure_softmax(rows, n, dtype, [*algorithms, "torch"])
        if message:
            notes.append(message)
    comp = compulsory_softmax(rows, n, dtype)
    out: list[dict[str, Any]] = []
    for algorithm in [*algorithms, *(["torch"] if measure else [])]:
        model = dram = counted = None
        if algorithm != "torch":
            model = model_softmax(rows, n, dtype, algorithm)
            dram = dram_softmax(rows, n, dtype, algorithm, gpu=gpu, l2_bytes=l2_bytes)
            if count and algorithm not in SOFTMAX_GPU_ALGORITHMS:
                counted = count_softmax(rows, n, dtype, algorithm)
        meas = measured.get(algorithm)
        best = next((t for t in (meas, model) if t is not None), None)
        out.append(
            {
                "method": "torch.softmax" if algorithm == "torch" else f"flashlite-{algorithm}",
                "rows": rows,
                "n": n,
                "dtype": str(dtype).removeprefix("torch."),
                **byte_fields(model=model, counted=counted, dram=dram, measured=meas),
                "compulsory_bytes": comp.total,
                "vs_compulsory": best.total / comp.total if best else None,
            }
        )
    return out, notes


def format_softmax_table(rows: Sequence[dict[str, Any]]) -> str:
    """The softmax traffic table: one line per algorithm."""
    return text_table(
        rows,
        [
            ("method", -24, lambda r: r["method"]),
            ("issued MB", 11, lambda r: format_mb(r["model_bytes"])),
            ("counted MB", 12, lambda r: format_mb(r["counted_bytes"])),
            ("DRAM est MB", 13, lambda r: format_mb(r["dram_bytes"])),
            ("measured MB", 13, lambda r: format_mb(r["measured_bytes"])),
            ("vs compulsory", 15, lambda r: format_ratio(r["vs_compulsory"])),
        ],
    )


def backward_rows(
    shapes: Sequence[AttentionShape],
    *,
    count: bool = False,
    measure: bool = False,
    show_progress: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (method, shape) for the attention backward, plus notes: flashlite's issued
    bytes (model; counted on CPU with the GPU's config), naive autograd's counted torch-op bytes,
    flashlite's DRAM estimate (:func:`flashlite.traffic.model.dram_flashlite_attention_bwd`),
    DRAM bytes measured with ncu (``measure``; the backward alone), and the compulsory ones."""
    measured: dict[str, Measurement] = {}
    notes: list[str] = []
    if measure:
        for method in ("flashlite", "naive"):
            measured[method] = measure_attention(method, shapes, backward=True)
            if measured[method].message:
                notes.append(measured[method].message)
    rows: list[dict[str, Any]] = []
    for j, shape in enumerate(shapes):
        if show_progress:
            progress_bar(j, len(shapes), f"backward N={shape.seq_q}")
        model = model_flashlite_attention_bwd(shape)
        dram = dram_flashlite_attention_bwd(shape)
        flash = naive = None
        if count:
            flash, naive = count_attention_bwd(shape)
        comp = compulsory_attention_bwd(shape)
        config = model.info["config"]
        for method, m, c in (("flashlite", model, flash), ("naive", None, naive)):
            meas = measured[method].traffic[j] if method in measured else None
            best = next((t for t in (meas, c, m) if t is not None), None)
            rows.append(
                {
                    "method": f"{method}-bwd",
                    "seq_len": shape.seq_q,
                    **byte_fields(model=m, counted=c, dram=dram if m else None, measured=meas),
                    "compulsory_bytes": comp.total,
                    "vs_compulsory": best.total / comp.total if best else None,
                    "config": config if method == "flashlite" else None,
                    "shape": shape.to_json(),
                }
            )
    if show_progress:
        progress_bar(len(shapes), len(shapes), "backward")
    return rows, notes


def cross_entropy_rows(
    rows: int, n: int, dtype: torch.dtype, *, count: bool = False, weight: bool = False
) -> list[dict[str, Any]]:
    """Cross-entropy forward + backward on ``(rows, n)`` logits: flashlite's fused kernels
    (model; counted on CPU) against torch's ``cross_entropy`` (counted), and the compulsory bytes
    (logits read once, gradient written once, targets and losses)."""
    from flashlite.traffic.count import count_cross_entropy
    from flashlite.traffic.model import compulsory_cross_entropy, model_cross_entropy

    model = model_cross_entropy(rows, n, dtype, weight_bytes=4 if weight else 0)
    flash = naive = None
    if count:
        flash, naive = count_cross_entropy(rows, n, dtype, weight=weight)
    comp = compulsory_cross_entropy(rows, n, dtype)
    out = []
    for method, m, c in (("flashlite-ce", model, flash), ("torch-ce", None, naive)):
        best = next((t for t in (c, m) if t is not None), None)
        out.append(
            {
                "method": method,
                "rows": rows,
                "n": n,
                "dtype": str(dtype).removeprefix("torch."),
                **byte_fields(model=m, counted=c, dram=None, measured=None),
                "compulsory_bytes": comp.total,
                "vs_compulsory": best.total / comp.total if best else None,
            }
        )
    return out
