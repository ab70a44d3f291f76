"""Long-row softmax forward sweep: the Gluon prefetching team kernel's
configs against the copy ceiling, ``auto`` and the team kernel, in one run on one GPU.

Every config is checked against torch in fp32 (with a row of −inf, one −inf chunk and a 1e4
logit) before it is timed; a wrong config is reported and not timed. Prints one line per
variant and writes ``results/longrow-prefetch-<device>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

import torch
from _common import RESULTS, bench, device_slug, metadata, write_results

from flashlite.kernels.softmax_gluon import PrefetchConfig
from flashlite.ops import prefetch as P
from flashlite.ops import softmax as S

ELEMS = {torch.bfloat16: 2**28, torch.float32: 2**27}  # as bench_softmax


def _inputs(dtype: torch.dtype, m: int, n: int) -> torch.Tensor:
    x = torch.randn(m, n, device="cuda", dtype=dtype) * 3
    x[0] = float("-inf")  # a row of -inf: NaN, as torch
    x[1, : n // 3] = float("-inf")  # whole chunks of -inf
    x[2, n // 2] = 1e4  # one huge logit
    return x


def _error(y: torch.Tensor, ref: torch.Tensor, log: bool) -> float:
    """Largest error relative to torch, scaled per element: ``|y − ref| / (atol + rtol·|ref|)``
    with bf16's or fp32's rounding; ≤ 1 is right. The −inf row must be all NaN. (``log`` is
    kept for the signature: log-probabilities near −1e4, spaced 64 apart in bf16, are within
    the relative part.)"""
    if not bool(torch.isnan(y[0]).all()):
        return float("inf")
    atol, rtol = (1e-2, 1.6e-2) if y.dtype != torch.float32 else (1e-5, 1e-5)
    a, b = y[1:].float(), ref[1:]
    fin = torch.isfinite(b)
    if not bool((a[~fin] == b[~fin]).all()):
        return float("inf")
    return float(((a[fin] - b[fin]).abs() / (atol + rtol * b[fin].abs())).max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="16384,65536,262144")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--chunk-bytes", default="16384,32768,65536")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--log", action="store_true", help="log_softmax too, for each config")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args(argv)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        for n in map(int, args.ns.split(",")):
            m = ELEMS[dtype] // n
            x = _inputs(dtype, m, n)
            y = torch.empty_like(x)
            refs = {False: torch.softmax(x.float(), -1), True: torch.log_softmax(x.float(), -1)}
            copy_ms = bench(lambda x=x, y=y: y.copy_(x))

            def add(name: str, ms: float | None, err: float | None, log: bool,
                    dname: str = dname, n: int = n, copy_ms: float = copy_ms) -> None:  # fmt: skip
                row = {"dtype": dname, "N": n, "op": "log_softmax" if log else "softmax",
                       "variant": name, "ms": ms, "x_copy": copy_ms / ms if ms else None,
                       "err": err}  # fmt: skip
                rows.append(row)
                xc = f"{row['x_copy']:.3f}" if ms else "  -  "
                print(f"{dname} N={n:>6} {row['op']:<11} {name:<24} x_copy {xc}  err "
                      f"{err if err is None else round(err, 3)}", flush=True)  # fmt: skip

            add("copy", copy_ms, None, False)
            logs = (False, True) if args.log else (False,)
            for log in logs if not args.no_baselines else ():
                for algo in ("auto", "team"):
                    S.softmax_fwd(x, y, log, algo)
                    err = _error(y, refs[log], log)
                    ms = bench(lambda x=x, y=y, a=algo, lg=log: S.softmax_fwd(x, y, lg, a))
                    add(algo, ms, err, log)
            for log in logs:  # the default config, as auto would launch it
                y.fill_(0)
                P.prefetch_fwd(x, y, log)
                err = _error(y, refs[log], log)
                ms = bench(lambda x=x, y=y, lg=log: P.prefetch_fwd(x, y, lg)) if err <= 1 else None
                add("prefetch default", ms, err, log)
            if not args.chunk_bytes:
                del x, y, refs
                torch.cuda.empty_cache()
                continue
            grid = itertools.product(map(int, args.chunk_bytes.split(",")),
                                     map(int, args.stages.split(",")),
                                     map(int, args.warps.split(",")))  # fmt: skip
            for cb, st, w in grid:
                cols = cb // x.element_size()
                per_thread = cols // (32 * w)
                if per_thread < 16 // x.element_size() or per_thread > 128:
                    continue
                cfg = PrefetchConfig(cols, st, w)
                for log in logs:
                    name = f"prefetch {cb // 1024}K/s{st}/w{w}"
                    try:
                        y.fill_(0)
                        P.prefetch_fwd(x, y, log, cfg)
                        torch.cuda.synchronize()
                        err = _error(y, refs[log], log)
                    except Exception as exc:  # noqa: BLE001 - a sweep reports and goes on
                        print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        add(name, None, None, log)
                        continue
                    ms = None
                    if err <= 1.0:
                        ms = bench(lambda x=x, y=y, c=cfg, lg=log: P.prefetch_fwd(x, y, lg, c))
                    add(name, ms, err, log)
            del x, y, refs
            torch.cuda.empty_cache()
    meta = metadata("cuda", seconds=round(time.perf_counter() - t0, 1),
                    timing="triton.testing.do_bench median (warmup=25, rep=100)")  # fmt: skip
    write_results(f"longrow-prefetch-{device_slug('cuda')}", rows, meta, out_dir=RESULTS)
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["variant"].startswith("prefetch") and r["ms"] and r["op"] == "softmax":
            k = (r["dtype"], r["N"], r["op"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    print("\nbest prefetch per shape (x copy) against auto / team:")
    for (d, n, op), r in sorted(best.items()):
        ref = {v["variant"]: v["x_copy"] for v in rows
               if (v["dtype"], v["N"], v["op"]) == (d, n, op)}  # fmt: skip
        print(
            f"{d} {n:>6} {op:<11} {r['variant']:<24} {r['x_copy']:.3f}  auto "
            f"{ref.get('auto', 0):.3f}  team {ref.get('team', 0):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
