"""Attention forward throughput on a GPU: flashlite against SDPA's backends, FlexAttention, naive.

TFLOP/s = 4·B·H·Nq·Nk·D / time (halved for causal), bf16, B·N = 16k tokens, H = 2048 / D.
Every provider's output is checked against SDPA-flash; the timings (``do_bench`` medians) are taken
in ``--rounds`` interleaved rounds and the median round is reported, so a drifting clock hits every
provider alike. ``--sweep`` first checks and times every flashlite config (``GPU_CONFIGS`` and
``HOPPER_CONFIGS``) on its own; one that returns NaN is reported and kept out of the autotuner.

    python benchmarks/bench_attention.py            # full table, JSON + PNG in benchmarks/results
    python benchmarks/bench_attention.py --sweep    # per-config check and timing first
    python benchmarks/bench_attention.py --backward # backward and fwd+bwd (bench_attention_bwd)
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
import triton
from _common import (
    PeerUnavailableError,
    bench,
    device_name,
    device_slug,
    flex_attention,
    metadata,
    write_results,
)

import flashlite
from flashlite import reference
from flashlite.kernels import configs as K
from flashlite.masking import masks
from flashlite.ops.attention import Request, attention_fwd
from flashlite.plotting import Figure, Line, Panel
from flashlite.reference import attention as naive_attention

TOKENS = 16384
SEQS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)


def tflops(b: int, h: int, n: int, d: int, causal: bool, ms: float) -> float:
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def sdpa(backend: str, causal: bool) -> Callable[..., torch.Tensor]:
    """``f(q, k, v)``: :func:`flashlite.reference.sdpa` pinned to ``backend``."""
    return lambda q, k, v: reference.sdpa(q, k, v, causal=causal, backend=backend)


def check(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference to the reference; inf for NaN/inf outputs."""
    if not torch.isfinite(out).all():
        return math.inf
    return (out.float() - ref.float()).abs().max().item()


def make(b: int, h: int, n: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(n * d)
    return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(3)]  # fmt: skip


def sweep(rows: list[dict]) -> None:
    """Check and time every GPU config on its own, at N = 4k and 16k."""
    for d in HEAD_DIMS:
        h = 2048 // d
        for n in (4096, 16384):
            b = TOKENS // n
            q, k, v = make(b, h, n, d)
            for causal in (False, True):
                ref = sdpa("flash", causal)(q, k, v)
                mask = masks.describe(causal)
                for cfg in dict.fromkeys([*K.GPU_CONFIGS, *K.HOPPER_CONFIGS.values()]):
                    bd = max(16, triton.next_power_of_2(d))
                    if not K.keep_config(cfg, bd, 2, True):
                        continue
                    try:
                        out = attention_fwd(q, k, v, Request.of_mask(mask, d**-0.5), config=cfg)[0]
                        err = check(out, ref)
                        ms = bench(
                            lambda cfg=cfg: attention_fwd(
                                q, k, v, Request.of_mask(mask, d**-0.5), config=cfg
                            )
                        )
                    except Exception as exc:  # a config that fails to compile is reported
                        err, ms = math.inf, math.nan
                        print(f"config {cfg} failed: {type(exc).__name__}: {exc}"[:200])
                    rows.append({"kind": "sweep", "config": cfg._asdict(), "d": d, "n": n,
                                 "causal": causal, "ms": ms, "max_err_vs_flash": err,
                                 "tflops": tflops(b, h, n, d, causal, ms)})  # fmt: skip
                    print(f"sweep D={d} N={n} causal={causal} cfg={cfg} "
                          f"err={err:.3g} {rows[-1]['tflops']:.0f} TFLOP/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="check and time each config first")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (slow compiles)")
    ap.add_argument("--seqs", type=int, nargs="*", default=list(SEQS))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timings per provider")
    ap.add_argument("--backward", action="store_true", help="backward and fwd+bwd table instead")
    args, rest = ap.parse_known_args()
    if args.backward:  # one entry point; the backward's own script holds its method
        import bench_attention_bwd

        raise SystemExit(bench_attention_bwd.main(rest))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    rows: list[dict] = []
    if args.sweep:
        sweep(rows)
        bad = {K.Config(**r["config"]) for r in rows if not r["max_err_vs_flash"] < 0.05}
        if bad:
            print("configs with wrong results, removed from the autotuner:", sorted(bad))
            K.GPU_CONFIGS[:] = [c for c in K.GPU_CONFIGS if c not in bad]

    providers = {
        "flashlite": lambda causal, n: lambda q, k, v: flashlite.attention(q, k, v, causal=causal),
        "sdpa-flash": lambda causal, n: sdpa("flash", causal),
        "sdpa-cudnn": lambda causal, n: sdpa("cudnn", causal),
        "sdpa-efficient": lambda causal, n: sdpa("efficient", causal),
        "flex": lambda causal, n: flex_attention(causal, n, n),
        "naive": lambda causal, n: lambda q, k, v: naive_attention(q, k, v, causal),
    }
    if args.no_flex:
        del providers["flex"]
    unavailable: set[str] = set()  # optional peers that cannot run here: noted once, skipped
    for d in HEAD_DIMS:
        h = 2048 // d
        for n in args.seqs:
            b = TOKENS // n
            q, k, v = make(b, h, n, d)
            for causal in (False, True):
                ref = sdpa("flash", causal)(q, k, v)
                fns, errs = {}, {}
                for name, factory in providers.items():
                    if name == "naive" and b * h * n * n * 2 * 3 > 40e9:  # S, P, softmax temp
                        continue
                    if name == "flex" and n not in (4096, 16384):  # each shape compiles anew
                        continue
                    if name in unavailable:
                        continue
                    try:
                        fn = factory(causal, n)
                        errs[name] = check(fn(q, k, v), ref)
                        fns[name] = fn
                    except PeerUnavailableError as exc:
                        print(f"skipping {name}: {exc}")
                        unavailable.add(name)
                    except Exception as exc:
                        print(f"{name} D={d} N={n} causal={causal} failed: {exc}"[:200])
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.rounds):  # interleaved: clock drift hits every provider
                    for name, fn in fns.items():
                        times[name].append(bench(lambda fn=fn: fn(q, k, v)))
                info = attention_fwd(q, k, v, Request.of_mask(masks.describe(causal), d**-0.5))[2]
                for name, ms_all in times.items():
                    ms = statistics.median(ms_all)
                    row = {"kind": "fwd", "provider": name, "d": d, "n": n, "b": b, "h": h,
                           "causal": causal, "ms": ms, "ms_rounds": ms_all,
                           "max_err_vs_flash": errs[name],
                           "tflops": tflops(b, h, n, d, causal, ms)}  # fmt: skip
                    if name == "flashlite" and info is not None:
                        row["config"] = {**info.config._asdict(), "block_d": info.block_d,
                                         "use_desc": info.use_desc}  # fmt: skip
                    rows.append(row)
                    print(f"{name:15s} D={d:3d} N={n:5d} causal={causal!s:5s} "
                          f"{row['tflops']:6.1f} TFLOP/s err={errs[name]:.3g}")  # fmt: skip
            del q, k, v, ref
    # peak extra memory at N = 16k, D = 128 (beyond inputs and output)
    for name in ("flashlite", "sdpa-flash", "sdpa-cudnn", "naive"):
        d, n = 128, 16384
        q, k, v = make(TOKENS // n, 2048 // d, n, d)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = providers[name](False, n)(q, k, v)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        rows.append({"kind": "memory", "provider": name, "d": d, "n": n,
                     "extra_bytes": int(extra)})  # fmt: skip
        del out
    write(rows)


def write(rows: list[dict]) -> None:
    dev = device_name()
    meta = metadata(
        dtype="bfloat16",
        tokens=TOKENS,
        autotune_configs=[c._asdict() for c in K.GPU_CONFIGS],
        hopper_configs={f"D{bd}{'-causal' if c else ''}": cfg._asdict()
                        for (bd, c), cfg in K.HOPPER_CONFIGS.items()},
    )  # fmt: skip
    paths = write_results(f"attention-{device_slug()}", rows, meta, figure=figure(rows, dev))
    summary(rows)
    print("wrote", paths["json"])


def figure(rows: list[dict], dev: str) -> Figure:
    """TFLOP/s against N per provider, one panel per (D, causal), flashlite drawn thick."""
    panels = []
    for i, (d, causal) in enumerate([(64, False), (64, True), (128, False), (128, True)]):
        fwd = [r for r in rows if r["kind"] == "fwd" and r["d"] == d and r["causal"] == causal]
        lines = []
        for prov in dict.fromkeys(r["provider"] for r in fwd):
            pts = [(r["n"], r["tflops"]) for r in fwd if r["provider"] == prov
                   and math.isfinite(r["tflops"])]  # fmt: skip
            if pts:
                style = {"marker": "o", "lw": 2.5 if prov == "flashlite" else 1}
                lines.append(Line(*zip(*pts, strict=True), label=prov, style=style))
        panels.append(
            Panel(
                lines,
                title=f"D={d} {'causal' if causal else 'non-causal'}",
                xlabel="sequence length (B·N = 16k)",
                ylabel="TFLOP/s (bf16, fwd)" if i == 0 else "",
                xlog=2,
                legend=8 if i == 0 else None,
            )
        )
    return Figure(
        [panels], title=f"attention forward on {dev}", panel_size=(4.5, 4), sharey=True, dpi=110
    )


def summary(rows: list[dict]) -> None:
    fwd = {(r["provider"], r["d"], r["n"], r["causal"]): r["tflops"] for r in rows
           if r["kind"] == "fwd"}  # fmt: skip
    print("\nD    N      causal  flashlite  flash   cudnn   x flash  x cudnn")
    for d in HEAD_DIMS:
        for n in SEQS:
            for causal in (False, True):
                f = fwd.get(("flashlite", d, n, causal))
                if f is None:
                    continue
                fa, cu = (
                    fwd.get(("sdpa-flash", d, n, causal)),
                    fwd.get(("sdpa-cudnn", d, n, causal)),
                )
                print(f"{d:<4d} {n:<6d} {causal!s:7s} {f:8.1f} {fa:7.1f} {cu:7.1f} "
                      f"{f / fa:8.3f} {f / cu:8.3f}")  # fmt: skip
    for r in rows:
        if r["kind"] == "memory":
            print(
                f"extra memory {r['provider']:12s} N=16k D=128: {r['extra_bytes'] / 2**20:9.1f} MiB"
            )


if __name__ == "__main__":
    main()
