"""Attention backward on the GPU: flashlite against SDPA's flash and cuDNN backends.

Setup: bf16, B·N = 16k tokens, H = 2048 / D, D ∈ {64, 128}, N ∈ {4k, 16k}, causal and not.
Backward time = (forward + backward) − forward, each a ``do_bench`` median, in interleaved rounds
(median round); FLOPs = 2.5 × the forward's (``4·B·H·N²·D``, halved when causal). Every
provider's gradients are checked against SDPA-flash's (NaN fails the point). Also: extra memory of
forward + backward beyond inputs, outputs and gradients at the largest N, D = 128.

``--sweep`` instead times the dK/dV and dQ kernels apart for every candidate config
(``SWEEP_DKDV``, ``SWEEP_DQ``, each with pointer and TMA-descriptor loads), after checking each
config's gradients against SDPA-flash's; it prints the fastest per point and writes
``attention-bwd-sweep-<device>.json``: the data for ``HOPPER_BWD_CONFIGS``.

    python benchmarks/bench_attention_bwd.py            # JSON + PNG in benchmarks/results
    python benchmarks/bench_attention_bwd.py --sweep    # per-kernel config sweep
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
from flashlite.kernels.configs import BwdConfig
from flashlite.masking import masks
from flashlite.ops import attention as attention_ops
from flashlite.plotting import Bars, Figure, Panel
from flashlite.reference import sdpa

PROVIDERS: dict[str, Callable[[bool], Callable[..., torch.Tensor]]] = {
    "flashlite": lambda causal: lambda q, k, v: flashlite.attention(q, k, v, causal=causal),
    "sdpa-flash": lambda causal: lambda q, k, v: sdpa(q, k, v, causal=causal, backend="flash"),
    "sdpa-cudnn": lambda causal: lambda q, k, v: sdpa(q, k, v, causal=causal, backend="cudnn"),
}
MUST_FLASH, MUST_CUDNN = 1.3, 0.80  # backward speed, flashlite / peer (the targets)


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


#: Sweep candidates by head dim: dK/dV (query step, key block, warps, stages) and dQ (query
#: block, key step, warps, stages); each runs with pointer and with descriptor loads.
SWEEP_DKDV = {
    64: [
        (32, 64, 4, 3),
        (32, 64, 4, 4),
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 128, 8, 2),
        (32, 128, 8, 3),
    ],
    128: [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3)],
}
SWEEP_DQ = {
    64: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 2)],
    128: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 2)],
}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def sweep(seqs: list[int], head_dims: list[int]) -> int:
    """Time every candidate config of the two main backward kernels apart (see module doc)."""
    rows: list[dict[str, Any]] = []
    for d in head_dims:
        for n in seqs:
            for causal in (False, True):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                               for _ in range(4))  # fmt: skip
                scale = d**-0.5
                o, lse, _ = attention_ops.attention_fwd(
                    q, k, v, attention_ops.Request.of_mask(masks.describe(causal), scale)
                )
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                sdpa(*leaves, causal=causal, backend="flash").backward(do)
                ref = [t.grad for t in leaves]
                qs = torch.empty_like(q)
                delta = attention_ops.bwd_preprocess(o, do, lse, None, q, qs, scale)
                base = {"D": d, "N": n, "causal": causal, "B": b, "H": h}
                for kind, cands in (("dkdv", SWEEP_DKDV), ("dq", SWEEP_DQ)):
                    for tiles in cands.get(d, []):
                        for use_desc in (False, True):
                            cfg = (BwdConfig(*tiles, 64, 64, 4, 2, use_desc) if kind == "dkdv"
                                   else BwdConfig(32, 64, 4, 3, *tiles, use_desc))  # fmt: skip
                            rows.append({**base, **_sweep_one(kind, cfg, qs, k, v, do, lse, delta,
                                                              causal, scale, ref)})  # fmt: skip
                            r = rows[-1]
                            print(
                                f"D={d} N={n} causal={causal!s:5} {kind:4} {tiles} "
                                f"desc={use_desc!s:5} ms={r['ms']} err={r['err']}",
                                flush=True,
                            )
                del q, k, v, do, o, lse, leaves, ref, qs, delta
                torch.cuda.empty_cache()
    meta = metadata(dtype="bfloat16", tokens=16384, kind="backward kernel sweep")
    write_results(f"attention-bwd-sweep-{device_slug()}", rows, meta)
    print(f"{'D':>4}{'N':>7}{'causal':>8}  fastest dK/dV                     fastest dQ")
    for d in head_dims:
        for n in seqs:
            for causal in (False, True):
                line = f"{d:>4}{n:>7}{causal!s:>8}"
                for kind in ("dkdv", "dq"):
                    ok = [r for r in rows if (r["D"], r["N"], r["causal"], r["kind"]) ==
                          (d, n, causal, kind) and r["ms"] is not None]  # fmt: skip
                    best = min(ok, key=lambda r: r["ms"]) if ok else None
                    line += f"  {_cell(best):<32}"
                print(line)
    return 0


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return f"{tuple(row['tiles'])}{' desc' if row['use_desc'] else ''} {row['ms']:.3f} ms"


def _sweep_one(kind, cfg, qs, k, v, do, lse, delta, causal, scale, ref) -> dict[str, Any]:  # noqa: ANN001
    """Check one config's gradients against SDPA-flash's, then time its kernel alone."""
    tiles = cfg[:4] if kind == "dkdv" else cfg[4:8]
    out: dict[str, Any] = {"kind": kind, "tiles": list(tiles), "use_desc": cfg.use_desc}
    mask = masks.describe(causal)
    try:
        if kind == "dkdv":
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            run = lambda: attention_ops.bwd_dkdv(qs, k, v, do, lse, delta, dk, dv, mask,  # noqa: E731
                                                 scale, cfg)  # fmt: skip
            run()
            err = max(_rel_err(dk, ref[1]), _rel_err(dv, ref[2]))
        else:
            dq = torch.empty_like(qs)
            run = lambda: attention_ops.bwd_dq(qs, k, v, do, lse, delta, dq, mask, scale, cfg)  # noqa: E731
            run()
            err = _rel_err(dq, ref[0])
    except Exception as e:  # a config that does not compile or launch here: recorded
        return {**out, "ms": None, "err": f"{type(e).__name__}: {str(e)[:120]}"}
    # a wrong or NaN config is not timed (Triton 3.6 has produced NaN for one config only)
    out["err"] = err
    out["ms"] = bench(run) if err < 2e-2 else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--rounds", type=int, default=3, help="interleaved timings per provider")
    p.add_argument("--sweep", action="store_true", help="per-kernel config sweep instead")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_bwd needs a CUDA GPU")
        return 2
    if args.sweep:
        return sweep(args.seqs, args.head_dims)
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
