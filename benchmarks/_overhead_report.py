"""bench_overhead's reading of its rows: the bar (flashlite / baseline on the loop metric), the
printed table, the figure, and the merge of a ``--cases`` run into a saved results file."""

from __future__ import annotations

import math
from typing import Any

from _overhead_cases import CHECKED, Case

from flashlite.plotting import Bars, Figure, Panel

METRICS = ("do_bench", "loop", "graph", "compile")
TITLES = {
    "do_bench": "do_bench median (time per call)",
    "loop": "1000-call loop + sync (host-bound)",
    "graph": "CUDA graph of 20 calls, replayed",
    "compile": "torch.compile reduce-overhead",
}
MUST, AIM = 1.5, 1.1  # flashlite / baseline on the loop metric
DECODE_SLACK_US = 25.0  # a decode step with append: at most the cuDNN kernel's time + this


def judge(all_cases: list[Case], table: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Adds to flashlite's row of each case (in ``table``, by ``(case, provider)``) its ratios
    to the baseline per metric, the case's rule and whether the loop time meets the bar
    (``must``, ``aim``; None when not measured); ``floor``'s row gets its ratios, no bar."""
    for case in all_cases:
        ours, base = table.get((case.name, "flashlite")), table.get((case.name, case.baseline))
        if ours is None:
            continue
        ours["baseline"] = case.baseline
        for metric in METRICS:
            a, b = ours[f"{metric}_us"], base and base[f"{metric}_us"]
            ours[f"ratio_{metric}"] = a / b if a and b else None
        ours["rule"] = case.rule
        if case.rule == "slack":  # the step's loop time against the kernel's own time
            loop, kernel = ours["loop_us"], base and base["do_bench_us"]
            ours["must"] = None if not (loop and kernel) else loop <= kernel + DECODE_SLACK_US
            ours["aim"] = ours["must"]
        else:
            r = ours["ratio_loop"]
            ours["must"] = None if r is None else r <= MUST
            ours["aim"] = None if r is None else r <= AIM
        floor = table.get((case.name, "floor"))
        if floor is not None:  # (the bare Function's ratios, beside flashlite's; no bar)
            floor["baseline"], floor["must"], floor["aim"] = case.baseline, None, None
            for metric in METRICS:
                a, b = floor[f"{metric}_us"], base and base[f"{metric}_us"]
                floor[f"ratio_{metric}"] = a / b if a and b else None


def figure(rows: list[dict[str, Any]], title: str) -> Figure:
    """Two wide panels, one above the other: the loop time per call (the bar's metric) per
    provider, then flashlite / baseline for every metric that was measured."""
    names = list(dict.fromkeys(r["case"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    by = {(r["case"], r["provider"]): r for r in rows}

    def value(case: str, provider: str, key: str) -> float:
        v = by.get((case, provider), {}).get(key)
        return math.nan if v is None else v

    measured = [m for m in METRICS if any(r.get(f"{m}_us") is not None for r in rows)]
    labels = [n.replace(" ", "\n") for n in names]
    loop = Panel(
        bars=[Bars([value(n, p, "loop_us") for n in names], p) for p in providers],
        categories=labels,
        title=TITLES["loop"],
        ylabel="µs per call",
        ylog=10,
        grid="major",
    )
    ratios = Panel(
        bars=[Bars([value(n, "flashlite", f"ratio_{m}") for n in names], m) for m in measured],
        categories=labels,
        hlines=[(MUST, f"must {MUST}x"), (AIM, f"aim {AIM}x"), (1.0, "")],
        title="flashlite / baseline (decode append: the cuDNN kernel)",
        ylabel="ratio",
        grid="major",
    )
    width = max(8.0, 0.8 * len(names))
    return Figure([[loop], [ratios]], title=title, panel_size=(width, 4.2))


def format_table(rows: list[dict[str, Any]]) -> str:
    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [
        f"{'shape':<34}{'provider':<12}"
        + "".join(f"{m + ' µs':>12}" for m in METRICS)
        + f"{'max err':>10}"
    ]
    for r in rows:
        err = "-" if r.get("max_err") is None else f"{r['max_err']:.1e}"
        lines.append(
            f"{r['case']:<34}{r['provider']:<12}"
            + "".join(f"{us(r[f'{m}_us']):>12}" for m in METRICS)
            + f"{err:>10}"
        )
    lines.append(
        f"\nflashlite (and floor) / baseline per metric (must <= {MUST}x, aim <= {AIM}x on loop; "
        f"decode append: loop <= cuDNN's do_bench + {DECODE_SLACK_US:.0f} µs)"
    )
    lines.append(
        f"{'shape':<34}{'baseline':<12}"
        + "".join(f"{m:>12}" for m in METRICS)
        + f"{'must':>7}{'aim':>7}"
    )
    for r in rows:
        if r["provider"] not in CHECKED or "baseline" not in r:
            continue
        must = {True: "pass", False: "FAIL", None: "-"}[r["must"]]
        aim = {True: "pass", False: "miss", None: "-"}[r["aim"]]
        ratios = "".join(f"{ratio(r[f'ratio_{m}']):>12}" for m in METRICS)
        base = r["baseline"] if r["provider"] == "flashlite" else f"floor:{r['baseline']}"
        lines.append(f"{r['case']:<34}{base:<12}{ratios}{must:>7}{aim:>7}")
    notes = [f"{r['case']} / {r['provider']}: {n}" for r in rows for n in r["notes"]]
    if notes:
        lines += ["\nnotes:", *(f"  {n}" for n in notes)]
    return "\n".join(lines)


def merge(saved: dict[str, Any], rows: list[dict[str, Any]], meta: dict[str, Any],
          words: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """``saved`` (a whole results file) with the cases matching ``words`` replaced by ``rows``.

    Each case's providers come from one run, so every ratio stays within its own run. Returns
    ``(rows, meta)``: the saved meta, its ``merged`` entry recording this run. A file from
    another device or other versions is not merged into (``ValueError``).
    """
    keys = ("device", "torch", "triton")
    if any(saved["meta"].get(k) != meta.get(k) for k in keys):
        raise ValueError(f"saved results are from {[saved['meta'].get(k) for k in keys]}, this "
                         f"run from {[meta.get(k) for k in keys]}: not merged")  # fmt: skip
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    merged: list[dict[str, Any]] = []
    placed: set[str] = set()
    for r in saved["rows"]:  # the saved order, each replaced case where it stood
        case = r["case"]
        if case not in by_case:
            merged.append(r)
        elif case not in placed:
            merged += by_case[case]
            placed.add(case)
    saved_cases = {r["case"] for r in saved["rows"]}
    merged += [r for r in rows if r["case"] not in saved_cases]
    out = dict(saved["meta"])
    out["merged"] = {
        **out.get("merged", {}),
        " ".join(words) + " cases": {
            "date": meta["date"],
            "command": meta["command"],
            "note": "these rows come from this later run (same device and versions); each "
            "row's ratios are within its own run",
        },
    }
    out["failures"] = [*saved["meta"].get("failures", []), *meta["failures"]]
    return merged, out
