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
        sys.modules[name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.parametrize(
    "bench,results",
    [
        ("bench_cross_entropy", "cross-entropy-nvidia-h200.json"),
        ("bench_ce_memory", "ce-memory-nvidia-h100-80gb-hbm3.json"),
        ("bench_mods", "mods-nvidia-h200.json"),
        ("bench_mods", "mods-varlen-nvidia-h200.json"),
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


def test_overhead_subset_run_merges_into_the_saved_file() -> None:
    """``bench_overhead.py --cases ...`` replaces only those cases' rows, where they stood."""
    bench = _bench("bench_overhead")
    meta = {"device": "H200", "torch": "2.11", "triton": "3.6", "failures": []}
    saved = {
        "meta": dict(meta, date="d0", command="all"),
        "rows": [{"case": c, "provider": p, "t": 0} for c in ("a", "flex", "b")
                 for p in ("ours", "torch")],
    }  # fmt: skip
    new = [{"case": "flex", "provider": p, "t": 1} for p in ("ours", "torch")]
    rows, out = bench.merge(saved, new, dict(meta, date="d1", command="flex"), ["flex"])  # type: ignore[attr-defined]
    assert [(r["case"], r["t"]) for r in rows] == [
        ("a", 0), ("a", 0), ("flex", 1), ("flex", 1), ("b", 0), ("b", 0)
    ]  # fmt: skip
    assert out["date"] == "d0" and out["merged"]["flex cases"]["date"] == "d1"
    with pytest.raises(ValueError, match="not merged"):
        bench.merge(saved, new, dict(meta, torch="2.12", date="d1", command="x"), ["flex"])  # type: ignore[attr-defined]
