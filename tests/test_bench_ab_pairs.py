"""``bench_ab.py --jobs pairs`` without a GPU: two stand-in workers speak bench_ab_worker's
protocol, and the driver asks them in turn, case by case, leaving out a case one tree cannot
run."""

from __future__ import annotations

import sys
from pathlib import Path

from test_bench_plots import ROOT, _bench

FAKE = """
import os, sys
sys.path.insert(0, {bench!r})
from bench_ab_worker import serve
new = os.environ["PYTHONPATH"].endswith("new")
words = sys.argv[1:]
def broken():
    raise RuntimeError("no such kernel here")
timers = {{"a": lambda: 11.0 if new else 10.0, "b": lambda: 5.0,
          "c": broken if new else (lambda: 1.0), "only-old": lambda: 2.0}}
if new:
    del timers["only-old"]
serve({{n: t for n, t in timers.items() if not words or any(w in n for w in words)}},
      sys.stdin, sys.stdout)
"""


def test_pairs_asks_both_trees_case_by_case(tmp_path: Path) -> None:
    bench = _bench("bench_ab")
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE.format(bench=str(ROOT / "benchmarks")))
    trees = {side: tmp_path / side for side in ("old", "new")}
    for tree in trees.values():
        tree.mkdir()
    times = bench.run_pairs(trees, None, 3, [sys.executable, str(fake)])  # type: ignore[attr-defined]
    # "c" fails on the new tree and "only-old" is not there: both left out
    assert sorted(times) == [("pairs", ("a",)), ("pairs", ("b",))]
    assert times[("pairs", ("a",))] == {"old": [10.0] * 3, "new": [11.0] * 3}
    assert times[("pairs", ("b",))] == {"old": [5.0] * 3, "new": [5.0] * 3}
    words = bench.run_pairs(trees, ["b"], 1, [sys.executable, str(fake)])  # type: ignore[attr-defined]
    assert list(words) == [("pairs", ("b",))]
