"""Figures as data: the one place that talks to matplotlib (CLI plots and benchmark PNGs).

A :class:`Figure` is a grid of :class:`Panel` s; a panel holds :class:`Line` s and/or grouped
:class:`Bars` and its axis settings. :func:`save` draws it and writes the file. matplotlib is
imported only inside :func:`save`, with the non-interactive ``Agg`` backend, so importing this
module costs nothing and works without matplotlib (``save`` then raises ``ImportError``).

    fig = Figure([[Panel([Line([1, 2, 4], [3, 5, 9], "flashlite", style={"marker": "o"})],
                         xlog=2, xlabel="N", ylabel="TFLOP/s")]], title="attention")
    save(fig, "out.png")

Colours: leave ``color`` out to follow matplotlib's cycle, or name a cycle entry (``"C0"``,
``"C1"``, ...) to give two lines of one series the same colour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Bars", "Figure", "Line", "Panel", "save"]


@dataclass(frozen=True)
class Line:
    """One plotted series.

    Args:
        x, y: the points (same length; they are drawn in the order given).
        label: legend entry (None: not in the legend).
        fmt: matplotlib format string such as ``"k--"`` or ``"-o"`` ("" for none).
        style: keyword arguments of ``Axes.plot`` (``ls``, ``marker``, ``color``, ``lw``, ``ms``).
    """

    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    fmt: str = ""
    style: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bars:
    """One series of a grouped bar chart: one bar per category of the panel.

    Args:
        values: one value per entry of the panel's ``categories``; NaN leaves a gap.
        label: legend entry.
        style: keyword arguments of ``Axes.bar`` (``color``, ``hatch``, ...).
    """

    values: Sequence[float]
    label: str | None = None
    style: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Panel:
    """One set of axes.

    Args:
        lines: line series, drawn first.
        bars: grouped bar series side by side per category (needs ``categories``).
        categories: x tick labels of the bar groups.
        hlines: ``(y, label)`` horizontal reference lines (dashed grey; label may be "").
        title, xlabel, ylabel: axis texts ("" leaves them out).
        xlog, ylog: log-scale base (2, 10) or None for a linear axis.
        grid: None (no grid), ``"major"`` or ``"both"`` (major and minor ticks).
        legend: legend font size, or None for no legend.
        notes: short texts written in the lower right corner (what a reader could misread).
    """

    lines: Sequence[Line] = ()
    bars: Sequence[Bars] = ()
    categories: Sequence[str] = ()
    hlines: Sequence[tuple[float, str]] = ()
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    xlog: float | None = None
    ylog: float | None = None
    grid: str | None = None
    legend: float | None = 7
    notes: Sequence[str] = ()


@dataclass(frozen=True)
class Figure:
    """A grid of panels with one title.

    Args:
        panels: rows of panels (``[[a, b, c]]`` is one row of three); all rows the same length.
        title: figure title (``suptitle``); "" for none.
        panel_size: (width, height) in inches of one panel; the figure is that times the grid.
        sharey: panels share the y axis.
        dpi: resolution of the written image.
    """

    panels: Sequence[Sequence[Panel]]
    title: str = ""
    panel_size: tuple[float, float] = (6.0, 4.0)
    sharey: bool = False
    dpi: int = 120


def save(figure: Figure, path: str | Path) -> Path:
    """Draw ``figure`` and write it to ``path`` (format from the suffix); returns the path.

    Raises:
        ImportError: matplotlib is not installed (``pip install "flashlite-attn[bench]"``).
        ValueError: the panel rows have different lengths, or bars without matching categories.
    """
    nrows = len(figure.panels)
    ncols = len(figure.panels[0]) if nrows else 0
    if nrows == 0 or ncols == 0 or any(len(row) != ncols for row in figure.panels):
        lens = [len(row) for row in figure.panels]
        raise ValueError(f"figure.panels: rows of equal, non-zero length expected, got {lens}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, h = figure.panel_size
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(w * ncols, h * nrows), sharey=figure.sharey, squeeze=False
    )
    try:
        for i, row in enumerate(figure.panels):
            for j, panel in enumerate(row):
                _draw(axes[i][j], panel)
        if figure.title:
            fig.suptitle(figure.title)
        fig.tight_layout()
        fig.savefig(path, dpi=figure.dpi)
    finally:
        plt.close(fig)
    return Path(path)


def _draw(ax: Any, panel: Panel) -> None:
    for line in panel.lines:
        args = (line.x, line.y, line.fmt) if line.fmt else (line.x, line.y)
        ax.plot(*args, label=line.label, **line.style)
    if panel.bars:
        if any(len(b.values) != len(panel.categories) for b in panel.bars):
            raise ValueError(
                f"panel {panel.title!r}: every Bars needs one value per category "
                f"({len(panel.categories)}), got {[len(b.values) for b in panel.bars]}"
            )
        width = 0.8 / len(panel.bars)
        for k, bars in enumerate(panel.bars):
            shift = (k - (len(panel.bars) - 1) / 2) * width
            pts = [(c + shift, v) for c, v in enumerate(bars.values) if _finite(v)]
            xs, ys = ([p[0] for p in pts], [p[1] for p in pts])  # NaN/None: a gap, no bar
            ax.bar(xs, ys, width, label=bars.label, **bars.style)
        ax.set_xticks(range(len(panel.categories)), list(panel.categories), fontsize=8)
    for y, label in panel.hlines:
        ax.axhline(y, color="grey", ls="--", lw=1, label=label or None)
    if panel.xlog:
        ax.set_xscale("log", base=panel.xlog)
    if panel.ylog:
        ax.set_yscale("log", base=panel.ylog)
    if panel.title:
        ax.set_title(panel.title)
    if panel.xlabel:
        ax.set_xlabel(panel.xlabel)
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    if panel.grid:
        ax.grid(True, which=panel.grid, alpha=0.3)
    if panel.legend is not None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=panel.legend)
    if panel.notes:
        ax.text(
            0.99,
            0.02,
            "\n".join(panel.notes),
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
            color="dimgrey",
        )


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
