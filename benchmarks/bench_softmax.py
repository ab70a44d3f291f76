"""Row softmax bandwidth: flashlite kernels against torch, torch.compile and a plain copy.

Softmax is memory bound, so every row reports achieved bandwidth: bytes that must cross HBM at
least once (read x, write y; backward: read y and dy, write dx) over the median time. A
device-to-device copy of the same tensor moves the same forward bytes and is the ceiling.
``*_fwd_bwd`` rows time forward + backward through autograd (``torch.autograd.grad`` with a
random upstream gradient), flashlite's op against torch's: their ``vs_torch`` is torch's time over
flashlite's, the ratio its target is stated in (printed last).

    python benchmarks/bench_softmax.py                      # full run on the GPU (< 4 min, H200)
    python benchmarks/bench_softmax.py --quick --device cpu # tiny smoke run in the interpreter

Writes ``<out-dir>/softmax-<device slug>.json`` and ``.png`` and prints a table last.
Every flashlite variant is checked against an fp32 torch reference before it is timed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, bench, device_name, device_slug, metadata, write_results

import flashlite
from flashlite.ops.softmax import softmax_bwd
from flashlite.plotting import Figure, Line, Panel

FULL_NS = [1024, 4096, 16384, 65536, 262144]
QUICK_NS = [64, 1000]
# M·N per dtype: 512 MiB per tensor, far beyond L2, so every pass really goes to HBM
FULL_ELEMS = {torch.bfloat16: 2**28, torch.float32: 2**27}
QUICK_ELEMS = {torch.bfloat16: 2**12, torch.float32: 2**12}
# (atol, rtol) against the fp32 reference; a row outside it is flagged "ok": false. The
# reference is computed from the same low-precision input, so this is output rounding only.
TOL = {torch.bfloat16: (1e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}
ALGORITHMS = ["auto", "online", "three_pass"]


def _timer(device: torch.device, quick: bool) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn``: CUDA-event timing on a GPU, wall clock on the CPU."""
    if device.type == "cuda":
        return lambda fn: bench(fn, warmup=25, rep=100)

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(1 if quick else 5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall


def _compiled_softmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch.compile(torch.softmax) with one static graph per shape (no dynamic-shape kernels)."""
    try:
        for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch releases
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        return torch.compile(lambda t: torch.softmax(t, -1), dynamic=False)
    except Exception:  # noqa: BLE001  (any failure means "no compiled baseline")
        return None


def _row(
    op: str, dtype: torch.dtype, m: int, n: int, provider: str, ms: float | None, nbytes: int,
    check: tuple[float, bool] | None = None,
) -> dict[str, Any]:  # fmt: skip
    gbps = None if ms is None else nbytes / (ms * 1e-3) / 1e9
    return {
        "op": op,
        "dtype": str(dtype).removeprefix("torch."),
        "M": m,
        "N": n,
        "provider": provider,
        "ms": ms,
        "GB/s": gbps,
        "bytes": nbytes,
        "max_err": None if check is None else check[0],
        "ok": None if check is None else check[1],
    }


def _check(y: torch.Tensor, ref: torch.Tensor, per_row: bool = False) -> tuple[float, bool]:
    """Max absolute error and whether every element is within the dtype's (atol, rtol);
    ``per_row``: relative to each row's largest reference value instead of each element's."""
    atol, rtol = TOL[y.dtype]
    diff = (y.float() - ref).abs()
    if torch.isnan(diff).any():  # a NaN must show up as an error, not vanish in max()
        return math.inf, False
    if per_row:
        bound = (atol + rtol) * ref.abs().amax(-1, keepdim=True).clamp_min(1.0)
    else:
        bound = atol + rtol * ref.abs()
    return float(diff.max()), bool((diff <= bound).all())


def bench_shape(
    dtype: torch.dtype, m: int, n: int, device: torch.device, timer: Callable, compiled: Any
) -> list[dict[str, Any]]:
    """All rows for one (dtype, M, N): forward softmax, log_softmax, backward, forward +
    backward through autograd, copy."""
    x = torch.randn(m, n, device=device, dtype=dtype)
    elem = x.element_size()
    fwd_bytes, bwd_bytes = 2 * m * n * elem, 3 * m * n * elem
    rows: list[dict[str, Any]] = []
    y_out = torch.empty_like(x)
    rows.append(_row("copy", dtype, m, n, "copy", timer(lambda: y_out.copy_(x)), fwd_bytes))

    ref = torch.softmax(x.float(), -1)
    for algo in ALGORITHMS:
        err = _check(flashlite.softmax(x, algorithm=algo), ref)
        ms = timer(lambda a=algo: flashlite.softmax(x, algorithm=a))
        rows.append(_row("softmax", dtype, m, n, f"flashlite-{algo}", ms, fwd_bytes, err))
    rows.append(_row("softmax", dtype, m, n, "torch", timer(lambda: torch.softmax(x, -1)),
                     fwd_bytes))  # fmt: skip
    ms = None
    if compiled is not None:
        try:
            compiled(x)
            ms = timer(lambda: compiled(x))
        except Exception:  # noqa: BLE001  (record null, keep benchmarking)
            ms = None
    rows.append(_row("softmax", dtype, m, n, "torch-compile", ms, fwd_bytes))

    ref_log = torch.log_softmax(x.float(), -1)
    err = _check(flashlite.log_softmax(x), ref_log)
    ms = timer(lambda: flashlite.log_softmax(x))
    rows.append(_row("log_softmax", dtype, m, n, "flashlite-auto", ms, fwd_bytes, err))
    rows.append(_row("log_softmax", dtype, m, n, "torch",
                     timer(lambda: torch.log_softmax(x, -1)), fwd_bytes))  # fmt: skip
    del ref_log

    # backward on the same saved y and upstream dy for both providers
    y = torch.softmax(x, -1)
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    dx_ref = torch.ops.aten._softmax_backward_data(dy.float(), y.float(), -1, torch.float32)
    softmax_bwd(y, dy, dx, False)
    err = _check(dx, dx_ref)
    del dx_ref
    ms = timer(lambda: softmax_bwd(y, dy, dx, False))
    rows.append(_row("softmax_bwd", dtype, m, n, "flashlite", ms, bwd_bytes, err))
    ms = timer(lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, dtype))
    rows.append(_row("softmax_bwd", dtype, m, n, "torch", ms, bwd_bytes))
    rows.extend(_fwd_bwd_rows(x, dy, timer))
    return rows


def _fwd_bwd_rows(x: torch.Tensor, dy: torch.Tensor, timer: Callable) -> list[dict[str, Any]]:
    """Forward + backward through autograd (``torch.autograd.grad`` with the upstream ``dy``),
    flashlite's op against torch's, softmax and log_softmax: the pair a training step pays.
    Bytes: the forward's (read x, write y) plus the backward's (read y and dy, write dx)."""
    m, n = x.shape
    nbytes = 5 * m * n * x.element_size()
    rows = []
    with torch.enable_grad():
        xg = x.detach().requires_grad_()
        pairs = (("softmax", flashlite.softmax, torch.softmax),
                 ("log_softmax", flashlite.log_softmax, torch.log_softmax))  # fmt: skip
        for op, ours, theirs in pairs:
            xf = x.detach().float().requires_grad_()
            (ref,) = torch.autograd.grad(theirs(xf, -1), xf, dy.float())
            del xf
            for provider, f in (("flashlite", ours), ("torch", theirs)):

                def step(f: Callable = f) -> torch.Tensor:
                    return torch.autograd.grad(f(xg, -1), xg, dy)[0]

                # log_softmax's gradient is dy − softmax·Σdy: large where Σdy is, so compare
                # relative to the row's scale
                err = _check(step(), ref, per_row=True) if provider == "flashlite" else None
                rows.append(_row(f"{op}_fwd_bwd", x.dtype, m, n, provider, timer(step), nbytes,
                                 err))  # fmt: skip
            del ref
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_copy``: GB/s over the copy's at the same shape; ``vs_torch``: over torch's, same op."""
    by_key = {(r["op"], r["dtype"], r["N"], r["provider"]): r for r in rows}
    for r in rows:
        copy = by_key[("copy", r["dtype"], r["N"], "copy")]["GB/s"]
        torch_row = by_key.get((r["op"], r["dtype"], r["N"], "torch"))
        gbps = r["GB/s"]
        r["vs_copy"] = None if gbps is None or not copy else gbps / copy
        ok = gbps is not None and torch_row is not None and torch_row["GB/s"]
        r["vs_torch"] = gbps / torch_row["GB/s"] if ok else None


#: One colour per provider in every panel (a series is an op's line in its provider's colour).
PROVIDER_COLORS = {"flashlite": "C0", "flashlite-auto": "C0", "flashlite-online": "C2",
                   "flashlite-three_pass": "C4", "torch": "C1", "torch-compile": "C3"}  # fmt: skip
OP_STYLES = {"softmax": "-o", "log_softmax": ":s", "softmax_bwd": "-.^", "softmax_fwd_bwd": "--v",
             "log_softmax_fwd_bwd": "--d"}  # fmt: skip


def figure(rows: list[dict[str, Any]], title: str) -> Figure:
    """GB/s against N: one column per dtype, forward ops in the top row and backward ones below,
    one colour per provider, the copy as a dashed ceiling in every panel."""
    grid: list[list[Panel]] = [[], []]
    for dtype in sorted({r["dtype"] for r in rows}):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r["dtype"] == dtype and r["GB/s"] is not None:
                series.setdefault((r["op"], r["provider"]), []).append((r["N"], r["GB/s"]))
        for row, (which, ops) in enumerate((("forward", ("softmax", "log_softmax")),
                                            ("backward", ("softmax_bwd", "softmax_fwd_bwd",
                                                          "log_softmax_fwd_bwd")))):  # fmt: skip
            lines = []
            for (op, provider), pts in sorted(series.items()):
                if op != "copy" and op not in ops:
                    continue
                ns, gb = zip(*sorted(pts), strict=True)
                if op == "copy":
                    lines.append(Line(ns, gb, "copy (ceiling)", "k--", {"lw": 1.5}))
                else:
                    style = {"ms": 4, "color": PROVIDER_COLORS.get(provider, "C7")}
                    lines.append(Line(ns, gb, f"{op} {provider}", OP_STYLES[op], style))
            grid[row].append(Panel(lines, title=f"{dtype}, {which}", xlabel="N (row length)",
                                   ylabel="GB/s", xlog=2, grid="major", legend=6))  # fmt: skip
    return Figure(grid, title=title, panel_size=(6.5, 4.2))


def print_table(rows: list[dict[str, Any]]) -> None:
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = f"{'op':<20}{'dtype':<9}{'M':>8}{'N':>8}  {'provider':<22}{'ms':>9}{'GB/s':>8}"
    print(head + f"{'vs copy':>9}{'vs torch':>9}{'max err':>10}")
    for r in rows:
        print(
            f"{r['op']:<20}{r['dtype']:<9}{r['M']:>8}{r['N']:>8}  {r['provider']:<22}"
            f"{fmt(r['ms'], '.4f'):>9}{fmt(r['GB/s'], '.0f'):>8}{fmt(r['vs_copy'], '.2f'):>9}"
            f"{fmt(r['vs_torch'], '.2f'):>9}{fmt(r['max_err'], '.1e'):>10}"
            + ("" if r["ok"] is not False else "  WRONG")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="results folder")
    parser.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile baseline (auto: on for cuda, off for cpu)",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available (try --quick --device cpu)")
    ns = QUICK_NS if args.quick else FULL_NS
    elems = QUICK_ELEMS if args.quick else FULL_ELEMS
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    compiled = _compiled_softmax() if use_compile else None
    timer = _timer(device, args.quick)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for dtype, total in elems.items():
            for n in ns:
                rows.extend(bench_shape(dtype, max(1, total // n), n, device, timer, compiled))
    add_ratios(rows)

    name = device_name(device)
    meta = metadata(
        device,
        quick=args.quick,
        timing="triton.testing.do_bench median (warmup=25, rep=100)"
        if device.type == "cuda"
        else "wall-clock median (CPU, Triton interpreter)",
        bytes="softmax/log_softmax/copy: read x + write y; softmax_bwd: read y, dy + write dx; "
        "*_fwd_bwd (autograd, torch.autograd.grad with a random dy): both",
        seconds=round(time.perf_counter() - t0, 1),
    )
    paths = write_results(
        f"softmax-{device_slug(device)}",
        rows,
        meta,
        out_dir=args.out_dir,
        figure=figure(rows, f"flashlite softmax bandwidth, {name}"),
    )
    print(f"wrote {paths['json']} ({meta['seconds']} s)")
    print_table(rows)
    # the target: forward + backward >= 1.0x torch at every N, both dtypes
    pairs = [r for r in rows if r["op"].endswith("_fwd_bwd") and r["provider"] == "flashlite"]
    ratios = [r["vs_torch"] for r in pairs if r["vs_torch"] is not None]
    if ratios:
        worst = min(pairs, key=lambda r: r["vs_torch"] or math.inf)
        print(f"must: fwd+bwd >= 1.0x torch everywhere: worst {min(ratios):.3f}x "
              f"({worst['op']} {worst['dtype']} N={worst['N']}) "
              f"({'pass' if min(ratios) >= 1.0 else 'FAIL'})")  # fmt: skip
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
