"""The committed benchmark results redraw without a GPU (``--replot``)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str) -> object:
    """``benchmarks/<name>.py`` as a module (its folder on the path for ``_common``)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.parametrize(
    "bench,results",
    [
        ("bench_cross_entropy", "cross-entropy-nvidia-h200.json"),
        ("bench_mods", "mods-nvidia-h200.json"),
    ],
)
def test_results_replot(bench: str, results: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = ROOT / "benchmarks" / "results" / results
    copy = tmp_path / src.name
    shutil.copy(src, copy)
    assert _bench(bench).main(["--replot", str(copy)]) == 0  # type: ignore[attr-defined]
    png = copy.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_mods_varlen_figure_draws_rows_of_its_shape(tmp_path: Path) -> None:
    """``bench_mods.py --only varlen``'s figure from rows shaped as the bench writes them (no
    GPU run has made its results file yet)."""
    pytest.importorskip("matplotlib")
    from flashlite import plotting

    bench = _bench("bench_mods")
    names = ["varlen, causal mod", "varlen, causal mod + ALiBi", "varlen causal=True",
             "flex, document-causal"]  # fmt: skip
    rows = [
        {"group": "varlen", "point": f"varlen N{n}k {kind}",
         "ms": {m: 0.1 * (i + 1) * n for i, m in enumerate(names)}}
        for n in (8, 32) for kind in ("fwd", "fwd+bwd")
    ]  # fmt: skip
    png = plotting.save(bench.varlen_figure(rows, "a device"), tmp_path / "v.png")  # type: ignore[attr-defined]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
