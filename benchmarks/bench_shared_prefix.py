"""Shared-prefix (cascade) decoding: ``attention_shared_prefix`` against ``attention_kvcache``
over per-request caches that each hold a copy of the prefix.

One decode step of B=64 requests continuing one Np=32k prompt, each with 1k keys of its own
(``cache_seqlens = 1024``) and one new token appended (Nq=1); Hq=32, Hkv=8, D=128, bf16. Both
calls are checked against each other before they are timed (``do_bench`` medians, and CUDA-graph
replays: the GPU's time without the host's). Reported beside the times:

* the speedup (target >= 8x);
* the step's bound on the H200: ``max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s)`` (HBM3e bandwidth
  and dense bf16 peak from NVIDIA's H200 datasheet), where bytes are the prefix's K/V once, each
  request's own K/V, the appended K/V (read and written) and q/o, and FLOPs ``4·rows·keys·D``;
  the ratio of that bound to the measured time;
* the memory the prefix takes once against B copies.

    python benchmarks/bench_shared_prefix.py            # JSON + PNG in benchmarks/results
    python benchmarks/bench_shared_prefix.py --small    # tiny sizes (CPU interpreter smoke run)

The last table printed lists both calls, their ratio and the bound.
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
from flashlite.plotting import Bars, Figure, Panel

#: H200 SXM (NVIDIA datasheet): HBM3e bandwidth in bytes/s, dense bf16 tensor-core FLOP/s
HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 989e12
FULL = {"b": 64, "n_prefix": 32768, "suffix": 1024, "hq": 32, "hkv": 8, "d": 128}
SMALL = {"b": 3, "n_prefix": 80, "suffix": 24, "hq": 4, "hkv": 2, "d": 32}


def _timer(cuda: bool) -> Callable[[Callable[[], Any]], float]:
    if cuda:
        return bench

    def cpu(fn: Callable[[], Any]) -> float:  # (the interpreter: a few calls, median ms)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu


def _graph_ms(fn: Callable[[], Any]) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph, or None where capture fails."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception as err:  # noqa: BLE001  (reported, not fatal)
        print(f"CUDA graph capture failed: {err!r:.200}")
        return None


def run(shape: dict[str, int], device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    b, n_prefix, suffix, hq, hkv, d = (shape[k] for k in ("b", "n_prefix", "suffix", "hq", "hkv",
                                                          "d"))  # fmt: skip
    cap = suffix + 16
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    q, kn, vn = mk(b, 1, hq, d), mk(b, 1, hkv, d), mk(b, 1, hkv, d)
    pk, pv = mk(n_prefix, hkv, d), mk(n_prefix, hkv, d)
    kc, vc = mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = torch.full((b,), suffix, dtype=torch.int32, device=device)
    # the baseline's caches: each request's own copy of the prefix, then its keys
    k_all, v_all = (torch.cat([p.expand(b, -1, -1, -1), c], 1) for p, c in ((pk, kc), (pv, vc)))
    lens_all = lens + n_prefix

    def shared(validate: bool = True) -> torch.Tensor:
        return flashlite.attention_shared_prefix(q, pk, pv, kc, vc, cache_seqlens=lens, k_new=kn,
                                                 v_new=vn, validate=validate)  # fmt: skip

    def copies(validate: bool = True) -> torch.Tensor:
        return flashlite.attention_kvcache(q, k_all, v_all, cache_seqlens=lens_all, k_new=kn,
                                           v_new=vn, validate=validate)  # fmt: skip

    got, want = shared(), copies()
    err = (got.float() - want.float()).abs().max().item()
    if not err <= 2e-2 * max(1.0, want.float().abs().max().item()):
        raise AssertionError(f"shared prefix against kvcache over copies: max error {err}")
    fns = {"shared-prefix": shared, "shared-prefix validate=False": lambda: shared(False),
           "kvcache over copies": copies, "kvcache over copies validate=False":
           lambda: copies(False)}  # fmt: skip
    cuda = device == "cuda"
    times = {name: _timer(cuda)(fn) for name, fn in fns.items()}
    graph = {name: _graph_ms(fn) if cuda else None for name, fn in fns.items()}
    esize, keys, rows = q.element_size(), n_prefix + suffix + 1, b * hq
    kv_row = 2 * hkv * d * esize  # one key's K and V
    step_bytes = (n_prefix * kv_row + b * (suffix + 1) * kv_row + b * hkv * d * 2 * esize
                  + 2 * q.numel() * esize)  # fmt: skip
    flops = 4 * rows * keys * d
    bound_ms = max(step_bytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3
    copies_bytes = b * keys * kv_row + 2 * q.numel() * esize
    prefix_once = n_prefix * kv_row
    out = []
    for name, ms in times.items():
        row = {"case": f"B={b} Np={n_prefix} suffix={suffix} Hq={hq} Hkv={hkv} D={d}",
               "provider": name, "ms": ms, "graph_ms": graph[name], "err": err,
               "x_copies": times["kvcache over copies"] / ms}  # fmt: skip
        if name.startswith("shared"):
            row |= {"bound_ms": bound_ms, "x_bound": bound_ms / ms, "step_bytes": step_bytes,
                    "step_flops": flops, "prefix_gib": prefix_once / 2**30}  # fmt: skip
            if graph[name] and graph["kvcache over copies"]:
                row["graph_x_copies"] = graph["kvcache over copies"] / graph[name]
                row["graph_x_bound"] = bound_ms / graph[name]
        else:
            own = max(copies_bytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3
            row |= {"bound_ms": own, "x_bound": own / ms, "step_bytes": copies_bytes,
                    "prefix_gib": b * prefix_once / 2**30}  # fmt: skip
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{rows[0]['case']} (bound: each call's own bytes and FLOPs on the H200)",
             f"{'provider':36} {'ms':>8} {'graph ms':>9} {'x copies':>9} "
             f"{'bound ms':>9} {'x bound':>8} {'prefix GiB':>11}"]  # fmt: skip
    for r in rows:
        g = r["graph_ms"]
        lines.append(f"{r['provider']:36} {r['ms']:8.4f} {g if g else math.nan:9.4f} "
                     f"{r['x_copies']:9.2f} {r['bound_ms']:9.4f} {r['x_bound']:8.2f} "
                     f"{r['prefix_gib']:11.3f}")  # fmt: skip
    saved = rows[-1]["prefix_gib"] - rows[0]["prefix_gib"]
    lines.append(f"memory saved by storing the prefix once: {saved:.3f} GiB; target >= 8x "
                 f"copies: {'pass' if rows[0]['x_copies'] >= 8 else 'FAIL'}")  # fmt: skip
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], device: str) -> Figure:
    names = [r["provider"].replace(" validate", "\nvalidate") for r in rows]
    times = Panel(bars=[Bars([r["ms"] for r in rows], "ms"),
                        Bars([r["bound_ms"] for r in rows], "bytes/FLOPs bound")],
                  categories=names, title=rows[0]["case"],
                  ylabel="ms (lower is better)")  # fmt: skip
    memory = Panel(bars=[Bars([r["prefix_gib"] for r in rows], "prefix K/V")], categories=names,
                   title="prefix storage", ylabel="GiB")  # fmt: skip
    return Figure([[times, memory]], title=f"shared-prefix decoding, {device}",
                  panel_size=(8, 4.5))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (the interpreter on CPU)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        print("bench_shared_prefix needs a CUDA GPU (or --small, for the interpreter)")
        return 2
    shape = SMALL if args.small else FULL
    rows = run(shape, "cuda" if cuda else "cpu", torch.bfloat16)
    for r in rows:
        print({k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
               for k, v in r.items()})  # fmt: skip
    stem = f"shared-prefix{'-small' if args.small else ''}-{device_slug()}"
    write_results(stem, rows, metadata(dtype="bfloat16", **shape), out_dir=args.out,
                  figure=figure(rows, device_name()))  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
