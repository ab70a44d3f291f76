"""FP8 attention against flashlite's own bf16 (GPU): the forward and the FP8-cache decode step.

Points, each measured side by side with its bf16 twin in interleaved rounds of
``triton.testing.do_bench`` medians:

    forward   B·N = 16k tokens, H = 2048 / D, D ∈ {64, 128, 256}, N ∈ {4k, 16k}, causal and
              not: ``attention(q8, k8, v8, q_descale=…, k_descale=…, v_descale=…)`` (the call a
              user makes, per-tensor factors) against ``attention(q, k, v)`` in bf16.
              TFLOP/s count 4·B·H·Nq·Nk·D (half of it causal). Bars: ≥ 1.5× at D = 128.
    decode    ``attention_kvcache`` with an e4m3 cache (``k_descale``/``v_descale`` per KV
              head) against a bf16 cache, Hq 32 / Hkv 8, D 128: B = 1 against 128k keys and
              B = 8 against 8k. Bars: ≥ 1.8×, and the FP8 cache read at ≥ 0.85× the copy
              bandwidth (a ``torch`` copy of a buffer the cache's size, same run).

Before timing, every FP8 result is checked against the bf16 result of the dequantised inputs
(max relative error ≤ 8e-2: e4m3 probabilities in the forward; the decode reads the e4m3 cache
exactly). Beside the default forward, the same call with ``FLASHLITE_FP8_V=n-major`` (V
copied keys-contiguous first) is checked and timed where it runs. Writes
``benchmarks/results/fp8-<device>.{json,png}`` and prints a table last.

    python benchmarks/bench_fp8.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from _common import bench, device_name, device_slug, max_rel_err, metadata, write_results

import flashlite
from flashlite.plotting import Bars, Figure, Panel
from flashlite.reference import quantize_e4m3

TOKENS = 16384
FWD_BAR, DECODE_BAR, COPY_BAR = 1.5, 1.8, 0.85


def timed_pair(fp8, bf16, rounds: int) -> tuple[float, float]:  # noqa: ANN001
    """Median ms of the two calls over interleaved rounds (a drifting clock moves both)."""
    a, b = [], []
    for _ in range(rounds):
        a.append(bench(fp8))
        b.append(bench(bf16))
    return statistics.median(a), statistics.median(b)


def forward_points(rows: list[dict], rounds: int) -> None:
    for d in (64, 128, 256):
        h = 2048 // d
        for n in (4096, 16384):
            b = TOKENS // n
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                   generator=gen) for _ in range(3))  # fmt: skip
            (q8, sq), (k8, sk), (v8, sv) = (quantize_e4m3(x) for x in (q, k, v))
            deq = [(x.float() * s).to(torch.bfloat16) for x, s in ((q8, sq), (k8, sk), (v8, sv))]
            for causal in (False, True):

                def fp8(causal: bool = causal) -> torch.Tensor:
                    return flashlite.attention(
                        q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=causal
                    )

                def bf16(causal: bool = causal) -> torch.Tensor:
                    return flashlite.attention(*deq, causal=causal)

                with torch.no_grad():
                    err = max_rel_err(fp8(), bf16())
                    ms8, ms16 = timed_pair(fp8, bf16, rounds)
                    # beside the default: V copied keys-contiguous first ($FLASHLITE_FP8_V)
                    os.environ["FLASHLITE_FP8_V"] = "n-major"
                    try:
                        err_n_major = max_rel_err(fp8(), bf16())
                        ms_n_major = statistics.median(bench(fp8) for _ in range(rounds))
                    except Exception as e:  # (a layout this Triton cannot multiply)
                        err_n_major, ms_n_major = float("nan"), float("nan")
                        print(f"V n-major failed at D{d} N{n}: {type(e).__name__}: {e}")
                    finally:
                        del os.environ["FLASHLITE_FP8_V"]
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                mask = "causal" if causal else "full"
                rows.append({
                    "kind": "forward", "point": f"D{d} N{n // 1024}k {mask}",
                    "ms_fp8": ms8, "ms_bf16": ms16, "ratio": ms16 / ms8, "max_rel_err": err,
                    "tflops_fp8": flops / ms8 / 1e9, "tflops_bf16": flops / ms16 / 1e9,
                    "ms_fp8_v_n_major": ms_n_major, "max_rel_err_v_n_major": err_n_major,
                    "bar": FWD_BAR if d == 128 else None,
                })  # fmt: skip


def decode_points(rows: list[dict], rounds: int) -> None:
    hq, hkv, d = 32, 8, 128
    for b, nk in ((1, 131072), (8, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(nk)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))  # fmt: skip
        ks, vs = (x.abs().amax(dim=(0, 1, 3)).float() / 448 for x in (k, v))
        k8, v8 = ((x.float() / s.view(1, 1, hkv, 1)).to(torch.float8_e4m3fn)
                  for x, s in ((k, ks), (v, vs)))  # fmt: skip
        kd, vd = ((x.float() * s.view(1, 1, hkv, 1)).to(torch.bfloat16)
                  for x, s in ((k8, ks), (v8, vs)))  # fmt: skip
        lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")

        def fp8() -> torch.Tensor:
            return flashlite.attention_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=ks,
                                               v_descale=vs)  # fmt: skip

        def bf16() -> torch.Tensor:
            return flashlite.attention_kvcache(q, kd, vd, cache_seqlens=lens)

        src = torch.empty(2 * k8.numel(), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        with torch.no_grad():
            err = max_rel_err(fp8(), bf16())
            ms8, ms16 = timed_pair(fp8, bf16, rounds)
            ms_copy = statistics.median(bench(lambda: dst.copy_(src)) for _ in range(rounds))
        cache_bytes = 2 * k8.numel()
        rows.append({
            "kind": "decode", "point": f"decode B{b} Nk{nk // 1024}k", "ms_fp8": ms8,
            "ms_bf16": ms16, "ratio": ms16 / ms8, "max_rel_err": err, "bar": DECODE_BAR,
            "cache_gbps": cache_bytes / ms8 / 1e6, "copy_gbps": 2 * cache_bytes / ms_copy / 1e6,
        })  # fmt: skip
        rows[-1]["of_copy"] = rows[-1]["cache_gbps"] / rows[-1]["copy_gbps"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8 needs a CUDA device")
        return 1
    rows: list[dict] = []
    forward_points(rows, args.rounds)
    decode_points(rows, args.rounds)
    bad = [r["point"] for r in rows if not r["max_rel_err"] <= 8e-2]
    # (NaN: that layout did not run; its failure is printed)
    bad += [r["point"] + " (V n-major)" for r in rows if r.get("max_rel_err_v_n_major", 0) > 8e-2]
    panel = Panel(bars=[Bars([r["ratio"] for r in rows], "bf16 time ÷ FP8 time")],
                  categories=[r["point"] for r in rows],
                  hlines=[(FWD_BAR, f"forward bar {FWD_BAR}"),
                          (DECODE_BAR, f"decode bar {DECODE_BAR}")],
                  title="FP8 speed-up over flashlite's bf16 (do_bench medians)")  # fmt: skip
    fig = Figure([[panel]], title=f"FP8 attention on {device_name()}", panel_size=(16, 4))
    meta = metadata(tokens=TOKENS, command=" ".join(sys.argv))
    paths = write_results(f"fp8-{device_slug()}", rows, meta, figure=fig)
    print(f"\n{'point':24s} {'bf16':>9s} {'fp8':>9s} {'ratio':>7s} {'TFLOP/s or GB/s':>16s}  bar")
    for r in rows:
        rate = r.get("tflops_fp8") or r.get("cache_gbps")
        bar = r["bar"]
        ok = "" if bar is None else ("pass" if r["ratio"] >= bar else "MISS")
        extra = f" of copy {r['of_copy']:.2f}" if "of_copy" in r else ""
        print(f"{r['point']:24s} {r['ms_bf16']:8.3f}m {r['ms_fp8']:8.3f}m {r['ratio']:6.2f}x "
              f"{rate:16.1f}  {ok}{extra}")  # fmt: skip
    print("wrote", paths["json"])
    if bad:
        print("WRONG RESULTS:", bad)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
