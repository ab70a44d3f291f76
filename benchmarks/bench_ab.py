"""Two source trees side by side: the same benchmarks, run from each in turn on one GPU.

A change to the host path or the front-end must not slow anything down, and absolute times drift
between machines and even between runs on one machine. So this runs each benchmark from the old
tree and from the new one, alternating (old first in even rounds, new first in odd ones), reads
the JSON each wrote, and reports for every flashlite point the median time of each tree and their
ratio ``new / old`` (below 1: faster), and the ratio of each tree's fastest round (noise on a
host-bound loop only adds time). Benchmarks and the metric read from each row:

    overhead       bench_overhead.py --no-compile --cases <words>: ``loop_us`` of flashlite's rows
                   (the host-bound loop: what a small call costs)
    loops          this folder's bench_overhead.py --metrics loop --providers flashlite on each
                   tree: the loop column of every case, flashlite's rows alone
    attention      bench_attention.py --no-flex --seqs 4096 16384: ``ms`` of flashlite's
                   forward points
    attention-bwd  the same with --backward: ``ms`` of flashlite's points
    decode         bench_decode.py: ``ms`` of flashlite's rows
    mods           bench_mods.py --quick: ``ms["flashlite"]`` per point
    probe          bench_ab_probe.py: a minute's probe of a few small calls' host-bound loop
                   and a few large calls' kernel time (the quick check between the others)
    pairs          the loops job's cases with both trees alive at once (one bench_ab_worker.py
                   per tree): each round asks the two trees for one loop round of a case, one
                   after the other, case by case, so a drifting host drifts for both alike
                   (``--rounds``: 7 or more; the loop column's 1000 calls a round)

Writes ``benchmarks/results/ab-<device slug>.{json,png}`` and prints the table last.

    python benchmarks/bench_ab.py --old /tmp/old-tree --new . --jobs overhead attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import device_name, device_slug, metadata, write_results

from flashlite.plotting import Bars, Figure, Panel

Row = dict[str, Any]
HERE = Path(__file__).resolve().parent
#: job → (script and arguments, results stem, the flashlite rows' key, their metric)
JOBS: dict[str, tuple[list[str], str, Callable[[Row], Any], Callable[[Row], float | None]]] = {
    "overhead": (
        ["bench_overhead.py", "--no-compile", "--cases", "attn", "decode", "window"],
        "overhead",
        lambda r: (r["case"], r["provider"]) if r["provider"].startswith("flashlite") else None,
        lambda r: r.get("loop_us"),
    ),
    "loops": (
        ["bench_overhead.py", "--metrics", "loop", "--providers", "flashlite"],
        "overhead",
        lambda r: (r["case"],) if r["provider"] == "flashlite" else None,
        lambda r: r.get("loop_us"),
    ),
    "attention": (
        ["bench_attention.py", "--no-flex", "--rounds", "3", "--seqs", "4096", "16384"],
        "attention",
        lambda r: _point(r) if r["provider"] == "flashlite" else None,
        lambda r: r.get("ms"),
    ),
    "attention-bwd": (
        ["bench_attention.py", "--backward", "--no-flex", "--seqs", "4096", "16384"],
        "attention-bwd",
        lambda r: (r["D"], r["N"], r["causal"]) if r["provider"] == "flashlite" else None,
        lambda r: r.get("fwd_bwd_ms"),
    ),
    "decode": (
        ["bench_decode.py"],
        "decode",
        lambda r: (r["case"], r["provider"]) if r["provider"].startswith("flashlite") else None,
        lambda r: r.get("ms"),
    ),
    "probe": (
        ["bench_ab_probe.py"],
        "ab-probe",
        lambda r: (r["point"],),
        lambda r: r.get("value"),
    ),
    "pairs": ([], "", lambda r: None, lambda r: None),  # (run by run_pairs, not as a script)
    "mods": (
        ["bench_mods.py", "--quick"],
        "mods",
        lambda r: (r["point"],),
        lambda r: (r.get("ms") or {}).get("flashlite"),
    ),
}


def _point(r: Row) -> tuple:
    """An attention row's point: kind, head dim, length and mask (rows name it either way)."""
    return tuple(r.get(f) for f in ("kind", "d", "n", "causal", "mask"))


#: Jobs whose script is this folder's for both trees (run on each tree's flashlite), so that
#: both run the same measurement.
FROM_HERE = ("probe", "loops")


def run_job(tree: Path, job: str, cases: list[str] | None = None) -> dict[Any, float]:
    """One run of ``job`` from ``tree``: its flashlite points' metric by key (``cases``: the
    loops job's case words)."""
    args, stem, key, metric = JOBS[job]
    if job == "loops" and cases:
        args = [*args, "--cases", *cases]
    # each tree's own benchmark scripts; probe and loops are this folder's, on the tree's flashlite
    scripts = HERE if job in FROM_HERE else tree / "benchmarks"
    out = scripts / "results" / f"{stem}-{device_slug()}.json"
    out.unlink(missing_ok=True)  # (a merging bench would otherwise keep older rows)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(scripts / args[0]), *args[1:]]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not out.exists():
        raise RuntimeError(
            f"{job} from {tree} wrote no results:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    rows = json.loads(out.read_text())["rows"]
    found = {}
    for r in rows:
        k, m = key(r), metric(r)
        if k is not None and m is not None:
            found[k] = m
    return found


def run_pairs(
    trees: dict[str, Path], words: list[str] | None, rounds: int, command: list[str] | None = None
) -> dict[tuple[str, Any], dict[str, list[float]]]:
    """The ``pairs`` job: one worker per tree (``command``, default bench_ab_worker.py, run with
    that tree on ``PYTHONPATH``), asked in turn for one round of each case both have, the order
    of the two trees swapped every round. Returns the µs per call of every round, by case."""
    command = command or [sys.executable, str(HERE / "bench_ab_worker.py")]
    workers = {}
    for side, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": str(tree)}
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        workers[side] = subprocess.Popen([*command, *(words or [])], cwd=tree, env=env, **pipes)
    try:
        names = {side: _ask(w, None)["cases"] for side, w in workers.items()}
        cases = [n for n in names["old"] if n in names["new"]]
        times: dict[tuple[str, Any], dict[str, list[float]]] = {}
        dropped: set[str] = set()
        for r in range(rounds):
            for name in cases:
                for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    reply = _ask(workers[side], name) if name not in dropped else {}
                    if "error" in reply:  # (a case one tree cannot run is left out of both)
                        print(f"pairs: {side} on {name}: {reply['error']}", file=sys.stderr)
                        dropped.add(name)
                    elif "us" in reply:
                        times.setdefault(("pairs", (name,)), {"old": [], "new": []})
                        times[("pairs", (name,))][side].append(reply["us"])
            print(f"pairs: round {r + 1} done", flush=True)
        return {k: t for k, t in times.items() if k[1][0] not in dropped}
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.communicate("quit\n", timeout=60)


def _ask(worker: subprocess.Popen, name: str | None) -> dict[str, Any]:
    """One request to a worker (None: its opening line) and its reply."""
    assert worker.stdin is not None and worker.stdout is not None
    if name is not None:
        worker.stdin.write(name + "\n")
        worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise RuntimeError(f"a bench_ab worker stopped (exit {worker.wait()}); see its stderr")
    return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the baseline tree")
    ap.add_argument("--new", type=Path, default=Path("."), help="the changed tree")
    ap.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=["probe"])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each job from each tree")
    ap.add_argument("--name", default="ab", help="results file stem (before the device slug)")
    ap.add_argument(
        "--cases", nargs="+", metavar="WORD", default=None, help="loops, pairs: only these cases"
    )
    args = ap.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    times: dict[tuple[str, Any], dict[str, list[float]]] = {}
    for job in args.jobs:
        if job == "pairs":  # (its own rounds, both trees alive at once)
            times.update(run_pairs(trees, args.cases, args.rounds))
            table = report(times, trees, args)
            continue
        for r in range(args.rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                for k, m in run_job(trees[side], job, args.cases).items():
                    times.setdefault((job, k), {"old": [], "new": []})[side].append(m)
            print(f"{job}: round {r + 1} done", flush=True)
            # (written after every round: a run cut short by a time limit keeps what it measured)
            table = report(times, trees, args)
    print(table)
    return 0


def report(
    times: dict[tuple[str, Any], dict[str, list[float]]],
    trees: dict[str, Path],
    args: argparse.Namespace,
) -> str:
    """Writes the results file of the points measured so far from both trees; the table."""
    rows = []
    for (job, k), t in times.items():
        if not (t["old"] and t["new"]):
            continue
        old, new = statistics.median(t["old"]), statistics.median(t["new"])
        rows.append(
            {
                "job": job,
                "point": " ".join(map(str, k)),
                "old": old,
                "new": new,
                "ratio": new / old,
                # a host-bound loop's noise only adds time: the fastest rounds compared too
                "min_ratio": min(t["new"]) / min(t["old"]),
                "old_rounds": t["old"],
                "new_rounds": t["new"],
            }
        )
    meta = metadata(
        what="new/old per flashlite point, both trees run alternately in one session",
        trees={s: str(p) for s, p in trees.items()},
        rounds=args.rounds,
        jobs=args.jobs,
    )
    labels = [f"{r['job']}: {r['point']}" for r in rows]
    panel = Panel(
        bars=[Bars([r["ratio"] for r in rows], "new / old")],
        categories=labels,
        hlines=[(1.0, "equal")],
        title="time new / old (below 1: faster)",
    )
    figure = Figure(
        [[panel]],
        title=f"side by side, {device_name()}",
        panel_size=(max(8.0, 0.22 * len(rows)), 4.5),
    )
    write_results(f"{args.name}-{device_slug()}", rows, meta, figure=figure)
    width = max((len(s) for s in labels), default=10)
    lines = [f"{'point':<{width}}  {'old':>10}  {'new':>10}  new/old  of mins"]
    for label, r in zip(labels, rows, strict=True):
        lines.append(
            f"{label:<{width}}  {r['old']:>10.4g}  {r['new']:>10.4g}  {r['ratio']:.3f}"
            f"    {r['min_ratio']:.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
