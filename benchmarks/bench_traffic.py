"""Measured HBM (DRAM) traffic of one attention forward: naive vs flashlite vs SDPA backends.

Needs a CUDA GPU and Nsight Compute (``ncu``; ``$NCU`` overrides the path). For every method one
ncu process profiles a child that runs all configs, each measured call in its own NVTX range, so
the slow ncu start-up and the autotuning happen once per method, not once per config.

Grid: N ∈ {4096, 16384, 32768}, D ∈ {64, 128}, H = 16, B = 1, bf16, causal and not. Three levels
per row: issued bytes (the model), the DRAM estimate (``flashlite.traffic.dram_attention``, with
this GPU's L2) and ncu's measured DRAM bytes, beside the compulsory bytes; the table's last
column is estimate / measured (the model's target is 0.85–1.15 at every point).
Writes ``benchmarks/results/traffic-<device slug>.json`` and ``.png`` and prints a table last.

    python benchmarks/bench_traffic.py [--seq 1024 4096] [--methods naive flashlite]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from typing import Any

import torch
from _common import device_name, device_slug, metadata, write_results

from flashlite import traffic
from flashlite.plotting import Figure, Line, Panel
from flashlite.traffic import AttentionShape


def ncu_version(ncu: str | None) -> str | None:
    if ncu is None:
        return None
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def figure(rows: list[dict[str, Any]], title: str, l2_bytes: int | None = None) -> Figure:
    """One panel per (D, causal): measured (solid), DRAM estimate (dash-dot) and issued (dotted)
    bytes vs N, log-log."""
    colors = {method: f"C{i}" for i, method in enumerate(traffic.ATTENTION_METHODS)}
    l2_mib = (l2_bytes or traffic.DEFAULT_L2_BYTES) / 2**20  # (what the DRAM estimate assumes)
    grid = []
    for d in sorted({r["head_dim"] for r in rows}):
        panels = []
        for causal in sorted({r["causal"] for r in rows}):
            panel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            lines = []
            for method in traffic.ATTENTION_METHODS:
                mine = sorted(
                    (r for r in panel if r["method"] == method), key=lambda r: r["seq_len"]
                )
                for key, ls, label in (
                    ("measured_bytes", "-", "DRAM measured"),
                    ("dram_bytes", "-.", f"DRAM estimate (L2 {l2_mib:.0f} MiB)"),
                    ("model_bytes", ":", "issued (loads + stores)"),
                ):
                    pts = [(r["seq_len"], r[key]) for r in mine if r[key]]
                    if pts:
                        style = {"ls": ls, "marker": "o", "color": colors[method]}
                        lines.append(
                            Line(*zip(*pts, strict=True), f"{method} {label}", style=style)
                        )
            comp = sorted({(r["seq_len"], r["compulsory_bytes"]) for r in panel})
            if comp:
                style = {"color": "black", "lw": 2}
                lines.append(Line(*zip(*comp, strict=True), "compulsory", style=style))
            below = any((r.get("measured_bytes") or r.get("dram_bytes") or 1e30)
                        < r["compulsory_bytes"] for r in panel)  # fmt: skip
            panels.append(
                Panel(
                    lines,
                    notes=[
                        "DRAM below compulsory: output writes still in L2\nwhen a kernel ends "
                        "are not counted"
                    ]
                    if below
                    else [],  # fmt: skip
                    title=f"D={d}{' causal' if causal else ''}",
                    xlabel="N",
                    ylabel="bytes per call (DRAM, or issued)",
                    xlog=10,
                    ylog=10,
                    grid="both",
                    legend=6,
                )
            )
        grid.append(panels)
    return Figure(grid, title=title, panel_size=(5.5, 4))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(traffic.ATTENTION_METHODS),
        choices=traffic.ATTENTION_METHODS,
    )
    p.add_argument("--timeout", type=float, default=280.0, help="seconds per ncu process")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_traffic needs a CUDA GPU (DRAM counters come from Nsight Compute)")
        return 2
    ncu = traffic.find_ncu()
    if ncu is None:
        print("bench_traffic needs ncu (Nsight Compute CLI): put it on PATH or set $NCU")
        return 2

    shapes = [
        AttentionShape(args.batch, args.heads, n, d, dtype=torch.bfloat16, causal=c)
        for d in args.head_dim
        for c in (False, True)
        for n in args.seq
    ]
    t0 = time.perf_counter()
    results: dict[str, traffic.Measurement] = {}
    for i, method in enumerate(args.methods):
        print(
            f"[{i + 1}/{len(args.methods)}] {method}: {len(shapes)} configs under ncu ...",
            file=sys.stderr,
            flush=True,
        )
        results[method] = traffic.measure_attention(method, shapes, timeout=args.timeout)
        if results[method].message:
            print(f"  {results[method].message}", file=sys.stderr)
        print(f"  done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    rows: list[dict[str, Any]] = []
    for method in args.methods:
        m = results[method]
        for j, shape in enumerate(shapes):
            config = m.configs.get(j, {}) if method == "flashlite" else {}
            model = dram = None
            if method == "naive" or (method == "flashlite" and config):
                tiles = {k: v for k, v in config.items() if k not in ("gpu", "config")}
                model = traffic.model_attention(method, shape, **tiles)
                dram = traffic.dram_attention(method, shape, l2_bytes=l2_bytes, **tiles)
            meas, comp = m.traffic[j], traffic.compulsory_attention(shape)
            rows.append(
                {
                    "method": method,
                    "seq_len": shape.seq_q,
                    "head_dim": shape.head_dim,
                    "heads": shape.heads,
                    "batch": shape.batch,
                    "causal": shape.causal,
                    "dtype": "bfloat16",
                    **traffic.byte_fields(model=model, dram=dram, measured=meas),
                    "compulsory_bytes": comp.total,
                    "kernels": [k.name for k in m.kernels[j]] if j < len(m.kernels) else [],
                    "config": config or None,
                    "l2_note": traffic.l2_note(shape),
                }
            )

    name = device_name()
    meta = metadata(
        ncu=ncu_version(ncu),
        l2_bytes=l2_bytes,
        notes=[results[m].message for m in args.methods if results[m].message],
    )
    title = f"attention forward bytes, DRAM and issued, {name}, B={args.batch} H={args.heads} bf16"
    paths = write_results(f"traffic-{device_slug()}", rows, meta,
                          figure=figure(rows, title, l2_bytes))  # fmt: skip

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e9:.3f}"

    written = ", ".join(p.name for p in paths.values())
    print(f"\n{name}: {written} ({time.perf_counter() - t0:.0f} s)")
    print(
        f"{'method':<11}{'N':>6}{'D':>5}{'causal':>8}{'issued GB':>11}{'DRAM est GB':>13}"
        f"{'measured GB':>13}{'compulsory GB':>15}{'meas/comp':>11}{'est/meas':>10}"
    )
    for r in rows:
        meas = r["measured_bytes"]
        ratio = meas / r["compulsory_bytes"] if meas else math.nan
        est = r["dram_bytes"] / meas if meas and r["dram_bytes"] else math.nan
        print(
            f"{r['method']:<11}{r['seq_len']:>6}{r['head_dim']:>5}{r['causal']!s:>8}"
            f"{gb(r['model_bytes']):>11}{gb(r['dram_bytes']):>13}{gb(meas):>13}"
            f"{gb(r['compulsory_bytes']):>15}{ratio:>10.2f}x{est:>9.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
