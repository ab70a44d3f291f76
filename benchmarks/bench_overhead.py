"""Per-call cost at small shapes: flashlite against torch, SDPA (flash, cuDNN) and cuDNN (GPU).

At these shapes the kernels run for a few µs to a few tens of µs, so the time per call is mostly
host work (argument checks, plans, launches) and launch latency. Cases (bf16 unless noted):

    attention        B=1 H=8 N=128 D=64, non-causal and causal; forward, no grad
    attention grad   forward + backward (torch.autograd.grad of q, k, v), causal, at B=1 H=8
                     N=128 D=64 and B=16 H=6 N=512 D=64 (examples/train_gpt.py's shape)
    decode           B=8 Hq=32 Hkv=8 Nq=1 Nk=512 D=128 (GQA; SDPA gets enable_gqa=True)
    decode append    attention_kvcache with k_new/v_new (a generate loop's step), Hq 32 / Hkv 8,
                     D 128, at B=1 Nk=4k and 128k and B=8 Nk=8k, default and validate=False,
                     against the cuDNN kernel over the same keys
    softmax          4 x 1024, fp32 and bf16, forward
    softmax grad     softmax and log_softmax forward + backward at 4 x 1024, 2048 x 1024 and
                     32 x 65536 (2^21 elements), fp32 and bf16; beside flashlite, ``floor``:
                     the same kernels through a bare ``autograd.Function`` (no checks, plans
                     made beforehand), the least any Python autograd node costs here
    window           attention(window=(1024, 0)) at B=1 H=8 N=4k D=128, forward and forward +
                     backward, against the same call on the Triton window kernels
                     (FLASHLITE_HOPPER_KERNEL=0): what folding the window into the flex
                     kernels costs on the host path
    flex             flex_attention with a document-causal mask (4 documents) at B=1 H=8 N=1k
                     D=64, forward and forward + backward, against torch.compile'd
                     flex_attention over torch's block mask of the same mod
    cross-entropy    forward + backward at 512 x 32k and 8192 x 32k; linear cross-entropy at
                     512 x 1024 x 32k, against torch's (logits materialised)

Four numbers per provider and case, all in µs per call:

    do_bench  ``triton.testing.do_bench`` median (warmup=25 ms, rep=200 ms): the time per call
    loop      wall clock of 1000 back-to-back calls and one synchronize (median of 7 rounds,
              after 50 warm-up calls): what a host-bound caller pays
    graph     replay of a CUDA graph that captured 20 calls (do_bench median / 20)
    compile   ``torch.compile(mode="reduce-overhead", fullgraph=True)``, do_bench median

Every metric is the median of interleaved rounds (every round in the JSON): each round times
every provider of every case once, so a host whose speed drifts during the run (seen: up to 1.6x
between runs on the H200's host) moves a case's providers alike and their ratio holds.
SDPA's backend is pinned once around each of its timings (``sdpa_kernel``), not on every call.
do_bench flushes L2 before each call, and host work that fits under the flush is not seen: loop
is the number that shows host cost, and the bar is on it: flashlite's loop time <= 1.5x the
baseline's (aim 1.1x); a decode step that appends <= the cuDNN kernel's do_bench time + 25 µs.

Every flashlite output (eager, graph replay, compiled) is checked first: forward outputs against
the fp64 reference, gradients within twice torch's own low-precision error of the fp64 gradient
(plus a floor); a wrong or NaN result is printed at once, kept out of the timings and makes the
exit status 1. A provider or metric that cannot run here (cuDNN unavailable, a backward that
torch.compile cannot hold in one graph) is noted and skipped. Writes
``benchmarks/results/overhead-<device slug>.{json,png,log}``, prints a table last. With
``--cases``, the new rows replace those cases' rows in that file (from the same device and
versions) and the other rows stay; ``meta["merged"]`` says which rows came from which run.

    python benchmarks/bench_overhead.py                      # every case
    python benchmarks/bench_overhead.py --cases grad decode  # cases whose name holds a word
    python benchmarks/bench_overhead.py --no-compile         # skip the torch.compile column
    python benchmarks/bench_overhead.py --metrics loop --providers flashlite  # bench_ab's job
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, bench, device_name, device_slug, metadata, write_results
from _overhead_cases import (
    CHECKED,
    TOL,
    Case,
    WrongResultError,
    _tuple,
    attention_case,
    attention_grad_case,
    cases,
    check,
    cross_entropy_case,
    decode_append_case,
    flex_case,
    floor_function,
    linear_cross_entropy_case,
    max_error,
    softmax_case,
    softmax_grad_case,
    window_case,
)
from _overhead_report import (
    AIM,
    DECODE_SLACK_US,
    METRICS,
    MUST,
    TITLES,
    figure,
    format_table,
    judge,
    merge,
)

from flashlite import plotting

#: the cases (_overhead_cases.py) and the report (_overhead_report.py) are importable from here
__all__ = [
    "AIM",
    "CHECKED",
    "DECODE_SLACK_US",
    "METRICS",
    "MUST",
    "TITLES",
    "TOL",
    "Case",
    "WrongResultError",
    "attention_case",
    "attention_grad_case",
    "cases",
    "check",
    "cross_entropy_case",
    "decode_append_case",
    "figure",
    "flex_case",
    "floor_function",
    "format_table",
    "judge",
    "linear_cross_entropy_case",
    "main",
    "max_error",
    "merge",
    "run",
    "softmax_case",
    "softmax_grad_case",
    "window_case",
]

LOOP_CALLS, LOOP_ROUNDS, LOOP_WARMUP = 1000, 7, 50
#: do_bench, graph and compile are timed in this many interleaved rounds (median reported), so
#: a drifting clock hits every provider alike; loop in LOOP_ROUNDS, interleaved the same way.
ROUNDS = 5
GRAPH_CALLS, GRAPH_WARMUP = 20, 3
VERBOSE = False  # -v: tracebacks of skipped metrics


# =============================================================================== timing
def warm_loop(fn: Callable[[], Any]) -> Callable[[], float]:
    """A timer of one round of :func:`time_loop`, after ``LOOP_WARMUP`` calls."""
    for _ in range(LOOP_WARMUP):
        fn()
    torch.cuda.synchronize()
    return lambda: time_loop(fn)


def time_loop(fn: Callable[[], Any]) -> float:
    """µs per call of ``LOOP_CALLS`` back-to-back calls and one synchronize (one round)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LOOP_CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / LOOP_CALLS * 1e6


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``GRAPH_CALLS`` calls (warm-up on a side stream first, as PyTorch's
    CUDA-graph docs ask) and the static output of its last call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            out = fn()
    return graph, out


def compiled(case: Case, provider: str) -> Callable[..., torch.Tensor]:
    return torch.compile(
        case.providers[provider], mode="reduce-overhead", fullgraph=True, dynamic=False
    )


def prepare(case: Case, provider: str, metric: str, row: dict[str, Any]) -> Callable[[], float]:
    """A timer giving ``metric`` of ``provider`` in µs per call; graph and compile are built
    (and flashlite's outputs from them checked) here, once."""
    fn, args = case.providers[provider], case.inputs
    ours = provider in CHECKED
    if metric == "do_bench":
        return lambda: 1e3 * bench(lambda: fn(*args), warmup=25, rep=200)
    if metric == "loop":
        return warm_loop(lambda: fn(*args))
    if metric == "graph":
        graph, out = capture(lambda: fn(*args))
        graph.replay()
        torch.cuda.synchronize()
        if ours:
            row["max_err_graph"] = check(case, out, f"{provider} (CUDA graph replay)")
        return lambda: 1e3 * bench(graph.replay, warmup=25, rep=200) / GRAPH_CALLS
    if metric == "compile":
        cfn = compiled(case, provider)
        out = tuple(o.clone() for o in _tuple(cfn(*args)))  # reduce-overhead reuses buffers
        out = out if isinstance(case.ref, tuple) else out[0]
        if ours:
            row["max_err_compile"] = check(case, out, f"{provider} (torch.compile)")
        return lambda: 1e3 * bench(lambda: cfn(*args), warmup=25, rep=200)
    raise ValueError(f"metric={metric!r} is not one of {', '.join(METRICS)}")


def warm_up(all_cases: list[Case], seconds: float = 3.0) -> None:
    """Matrix products, then every provider back to back, for ``seconds`` in all, so the GPU's
    clocks are up and every provider's first-call work is done before the first timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 3:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    while time.perf_counter() - t0 < seconds:
        for case in all_cases:
            for provider, fn in case.providers.items():
                with contextlib.suppress(Exception), case.context(provider):  # failures: later
                    for _ in range(20):
                        fn(*case.inputs)
        torch.cuda.synchronize()


# =============================================================================== main
def eager_rows(all_cases: list[Case], failures: list[str]
               ) -> tuple[list[dict[str, Any]], dict[tuple[str, str], dict[str, Any]]]:  # fmt: skip
    """One row per case and provider from its eager output (error against the fp64 reference);
    ``(rows, table)``: every row, and by ``(case, provider)`` those to time (a wrong or failing
    provider is noted in its row, added to ``failures`` if wrong, and never timed)."""
    rows: list[dict[str, Any]] = []
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for case in all_cases:  # eager outputs first: a wrong provider is never timed
        for provider, fn in case.providers.items():
            row = {
                "case": case.name,
                "op": case.op,
                "dtype": str(case.dtype).removeprefix("torch."),
                **case.dims,
                "provider": provider,
                "notes": [],
            }
            row.update({f"{m}_us": None for m in METRICS})
            row.update({f"{m}_us_rounds": [] for m in METRICS})
            try:
                with case.context(provider):
                    out = fn(*case.inputs)
                torch.cuda.synchronize()
                row["max_err"] = max_error(case, out)
                if provider in CHECKED:
                    check(case, out, provider)
                table[(case.name, provider)] = row
            except WrongResultError as exc:
                failures.append(str(exc))
                print(f"WRONG: {exc}", file=sys.stderr, flush=True)
                row["notes"].append(f"wrong: {exc}")
            except Exception as exc:  # noqa: BLE001  (a provider that cannot run is skipped)
                row["notes"].append(f"skipped: {type(exc).__name__}: {exc}"[:300])
                print(f"skip {provider} on {case.name}: {row['notes'][-1]}", file=sys.stderr)
            rows.append(row)
    return rows, table


def time_metric(metric: str, all_cases: list[Case], table: dict[tuple[str, str], dict[str, Any]],
                failures: list[str]) -> None:  # fmt: skip
    """Times ``metric`` of every row in ``table`` in interleaved rounds and stores its median
    and rounds there; a provider whose metric fails is noted in its row and left out."""
    t0 = time.perf_counter()
    timers: dict[tuple[str, str], Callable[[], float]] = {}
    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(LOOP_ROUNDS if metric == "loop" else ROUNDS):
        for case in all_cases:
            for provider in case.providers:
                key, row = (case.name, provider), table.get((case.name, provider))
                if row is None or (rnd > 0 and key not in timers):
                    continue
                try:
                    with case.context(provider):
                        if key not in timers:
                            timers[key] = prepare(case, provider, metric, row)
                        times.setdefault(key, []).append(timers[key]())
                except WrongResultError as exc:
                    failures.append(str(exc))
                    print(f"WRONG: {exc}", file=sys.stderr, flush=True)
                    row["notes"].append(f"wrong ({metric}): {exc}")
                    timers.pop(key, None)
                except Exception as exc:  # noqa: BLE001  (reported, then skipped)
                    note = f"{metric} skipped: {type(exc).__name__}: {exc}"
                    row["notes"].append(note.splitlines()[0][:300])
                    print(f"{provider} on {case.name}: {row['notes'][-1]}", file=sys.stderr)
                    if VERBOSE:
                        traceback.print_exc()
                    timers.pop(key, None)
                    times.pop(key, None)
                    torch.cuda.synchronize()
    for (name, provider), ts in times.items():
        if (name, provider) in timers:
            table[(name, provider)][f"{metric}_us"] = statistics.median(ts)
            table[(name, provider)][f"{metric}_us_rounds"] = ts
    print(f"{metric}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def run(metrics: tuple[str, ...], words: list[str] | None = None,
        providers: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """Every row of the cases whose name holds one of ``words`` (all: None), only ``providers``
    (all: None), timed on ``metrics``; returns ``(rows, wrong results)``."""
    failures: list[str] = []
    all_cases = [c for c in cases() if not words or any(w in c.name for w in words)]
    for case in all_cases if providers else ():
        case.providers = {p: f for p, f in case.providers.items() if p in providers}
    rows, table = eager_rows(all_cases, failures)
    # one metric at a time over every shape: a failing capture or compile cannot spoil the
    # plainer metrics measured before it
    warm_up(all_cases)
    for metric in metrics:
        time_metric(metric, all_cases, table, failures)
    judge(all_cases, table)
    return rows, failures


def run_meta(argv: list[str] | None, words: list[str] | None, failures: list[str],
             seconds: float) -> dict[str, Any]:  # fmt: skip
    """The results file's meta: the command, what each metric and the bar are, the cases
    (``words``) and the wrong results."""
    return metadata(
        dtype="bfloat16 (softmax also float32)",
        command="python benchmarks/bench_overhead.py " + " ".join(argv or sys.argv[1:]),
        seconds=seconds,
        metrics={
            "do_bench": "triton.testing.do_bench median, warmup=25 ms, rep=200 ms",
            "loop": f"wall clock of {LOOP_CALLS} calls + one synchronize, median of "
            f"{LOOP_ROUNDS} interleaved rounds after {LOOP_WARMUP} warm-up calls",
            "graph": f"do_bench median of one replay of a CUDA graph of {GRAPH_CALLS} calls, "
            f"/ {GRAPH_CALLS}",
            "compile": "torch.compile(mode='reduce-overhead', fullgraph=True), do_bench median",
        },
        targets={
            "must": MUST,
            "aim": AIM,
            "on": "loop",
            "decode append": f"loop <= the cuDNN kernel's do_bench + {DECODE_SLACK_US} µs",
        },
        cases=words or "all",
        failures=failures,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile(mode='reduce-overhead') column",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="WORD",
        default=None,
        help="only the cases whose name holds one of these words (default: all)",
    )
    parser.add_argument(
        "--metrics", nargs="+", choices=METRICS, default=None, help="only these metrics"
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        metavar="NAME",
        default=None,
        help="only these providers (e.g. flashlite: the loop column alone, as bench_ab runs it)",
    )
    parser.add_argument("-v", action="store_true", help="print tracebacks of skipped metrics")
    parser.add_argument(
        "--replot", metavar="JSON", help="redraw the PNG of a results file, run nothing"
    )
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        out = plotting.save(
            figure(saved["rows"], f"flashlite per-call cost, {saved['meta']['device']}"),
            Path(args.replot).with_suffix(".png"),
        )
        print(f"wrote {out}")
        return 0
    global VERBOSE
    VERBOSE = args.v
    if not torch.cuda.is_available():
        print("bench_overhead needs CUDA (a GPU): nothing to time on this machine")
        return 2
    t0 = time.perf_counter()
    metrics = tuple(m for m in args.metrics or METRICS if not (args.no_compile and m == "compile"))
    rows, failures = run(metrics, args.cases, args.providers)
    name = device_name()
    seconds = round(time.perf_counter() - t0, 1)
    meta = run_meta(argv, args.cases, failures, seconds)
    saved_path = RESULTS / f"overhead-{device_slug()}.json"
    if args.cases and saved_path.exists():
        try:
            rows, meta = merge(json.loads(saved_path.read_text()), rows, meta, args.cases)
        except ValueError as err:
            print(f"{err}; writing this run alone")
    table = format_table(rows)
    paths = write_results(
        f"overhead-{device_slug()}",
        rows,
        meta,
        log=table,
        figure=figure(rows, f"flashlite per-call cost, {name}"),
    )
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({meta['seconds']} s)\n")
    print(table)
    if failures:
        print(f"\nFAILED: {len(failures)} wrong flashlite result(s):", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
