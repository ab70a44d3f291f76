"""Attention backward on the GPU: flashlite against SDPA's flash and cuDNN backends (issue 10).

Setup: bf16, B·N = 16k tokens, H = 2048 / D, D ∈ {64, 128}, N ∈ {4k, 16k}, causal and not.
Backward time = (forward + backward) − forward, each a ``do_bench`` median, in interleaved rounds
(median round); FLOPs = 2.5 × the forward's (``4·B·H·N²·D``, halved when causal). Every
provider's gradients are checked against SDPA-flash's (NaN fails the point). Also: extra memory of
forward + backward beyond inputs, outputs and gradients at the largest N, D = 128.

    python benchmarks/bench_attention_bwd.py            # JSON + PNG in benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from _common import bench, device_name, device_slug, metadata, write_results

import flashlite
from flashlite.plotting import Bars, Figure, Panel
from flashlite.reference import sdpa

PROVIDERS: dict[str, Callable[[bool], Callable[..., torch.Tensor]]] = {
    "flashlite": lambda causal: lambda q, k, v: flashlite.attention(q, k, v, causal=causal),
    "sdpa-flash": lambda causal: lambda q, k, v: sdpa(q, k, v, causal=causal, backend="flash"),
    "sdpa-cudnn": lambda causal: lambda q, k, v: sdpa(q, k, v, causal=causal, backend="cudnn"),
}
MUST_FLASH, MUST_CUDNN = 1.3, 0.80  # backward speed, flashlite / peer (issue 10)


def fwd_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    return 4 * b * h * n * n * d * (0.5 if causal else 1.0)


def time_provider(fn, q, k, v, do) -> tuple[float, float]:  # noqa: ANN001
    """(forward ms, forward + backward ms), do_bench medians."""
    fwd = bench(lambda: fn(q, k, v))
    both = bench(lambda: fn(q, k, v).backward(do), rep=200)
    return fwd, both


def grads(fn, q, k, v, do) -> list[torch.Tensor]:  # noqa: ANN001
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(do)
    return [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]


def extra_memory(fn, q, k, v, do) -> float:  # noqa: ANN001
    """MiB allocated at the peak of forward + backward beyond q, k, v, do, O and the grads.

    The grads start as None, so autograd keeps the backward's own dq, dk, dv as ``.grad``
    (pre-set grads would be accumulated into, and the fresh ones counted as extra).
    """
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outputs = sum(t.numel() * t.element_size() for t in (q, q, k, v))  # O, dq, dk, dv
    base = torch.cuda.memory_allocated() + outputs
    out = fn(q, k, v)
    out.backward(do)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--rounds", type=int, default=3, help="interleaved timings per provider")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_bwd needs a CUDA GPU")
        return 2
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    memory: dict[str, float] = {}
    for d in args.head_dims:
        for n in args.seqs:
            for causal in (False, True):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))  # fmt: skip
                do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                fns = {name: make(causal) for name, make in PROVIDERS.items()}
                ref = grads(fns["sdpa-flash"], q, k, v, do)
                usable = {}
                for name, fn in fns.items():
                    try:
                        got = grads(fn, q, k, v, do)
                    except Exception as e:  # a backend that cannot run here: noted, skipped
                        failures.append(f"{name} D={d} N={n} causal={causal}: {e}")
                        continue
                    pairs = zip(got, ref, strict=True)
                    err = max((g.float() - r.float()).abs().max().item() for g, r in pairs)
                    if not all(torch.isfinite(g).all() for g in got):
                        failures.append(f"{name} D={d} N={n} causal={causal}: NaN in gradients")
                        continue
                    usable[name] = (fn, err)
                timings: dict[str, list[tuple[float, float]]] = {name: [] for name in usable}
                for _ in range(args.rounds):
                    for name, (fn, _) in usable.items():
                        timings[name].append(time_provider(fn, q, k, v, do))
                flops = fwd_flops(b, h, n, d, causal)
                for name, (_, err) in usable.items():
                    fwd = statistics.median(t[0] for t in timings[name])
                    both = statistics.median(t[1] for t in timings[name])
                    bwd = max(both - fwd, 1e-6)
                    rows.append({"provider": name, "D": d, "N": n, "B": b, "H": h,
                                 "causal": causal, "fwd_ms": fwd, "fwd_bwd_ms": both,
                                 "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd / 1e9,
                                 "fwd_bwd_tflops": 3.5 * flops / both / 1e9,
                                 "max_abs_grad_diff_vs_flash": err})  # fmt: skip
                if d == max(args.head_dims) and n == max(args.seqs) and not causal:
                    for name in ("flashlite", "sdpa-flash"):
                        if name in usable:
                            memory[name] = extra_memory(usable[name][0], q, k, v, do)
                del q, k, v, do
                torch.cuda.empty_cache()
    by = {(r["provider"], r["D"], r["N"], r["causal"]): r for r in rows}
    for r in rows:
        if r["provider"] == "flashlite":
            for peer in ("sdpa-flash", "sdpa-cudnn"):
                other = by.get((peer, r["D"], r["N"], r["causal"]))
                if other:
                    r[f"bwd_x_{peer}"] = other["bwd_ms"] / r["bwd_ms"]
                    r[f"fwd_bwd_x_{peer}"] = other["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    targets = {"bwd_x_sdpa-flash": MUST_FLASH, "bwd_x_sdpa-cudnn": MUST_CUDNN}
    meta = metadata(dtype="bfloat16", tokens=16384, rounds=args.rounds, failures=failures,
                    extra_memory_mib=memory, targets=targets)  # fmt: skip
    labels = [f"D{r['D']} {r['N'] // 1024}k{' c' if r['causal'] else ''}" for r in rows
              if r["provider"] == "flashlite"]  # fmt: skip
    bars = [Bars([r["bwd_tflops"] for r in rows if r["provider"] == name], name)
            for name in PROVIDERS]  # fmt: skip
    panel = Panel(bars=bars, categories=labels, title="attention backward, bf16",
                  ylabel="TFLOP/s (2.5x forward FLOPs)")  # fmt: skip
    figure = Figure([[panel]], title=f"attention backward, {device_name()}", panel_size=(10, 4))
    write_results(f"attention-bwd-{device_slug()}", rows, meta, figure=figure)
    for f in failures:
        print(f"note: {f}")
    print(f"extra memory at the largest point (MiB): {memory}")
    print(f"{'D':>4}{'N':>7}{'causal':>8}{'bwd TFLOP/s':>13}{'x flash':>9}{'x cuDNN':>9}"
          f"{'fwd+bwd x flash':>17}{'must':>6}")  # fmt: skip
    for r in rows:
        if r["provider"] != "flashlite":
            continue
        xf, xc = r.get("bwd_x_sdpa-flash"), r.get("bwd_x_sdpa-cudnn")
        ok = xf is not None and xc is not None and xf >= MUST_FLASH and xc >= MUST_CUDNN
        print(f"{r['D']:>4}{r['N']:>7}{r['causal']!s:>8}{r['bwd_tflops']:>13.0f}"
              f"{xf or 0:>9.3f}{xc or 0:>9.3f}{r.get('fwd_bwd_x_sdpa-flash') or 0:>17.3f}"
              f"{'pass' if ok else 'FAIL':>6}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
