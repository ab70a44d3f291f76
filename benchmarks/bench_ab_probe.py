"""A quick probe of one tree for :mod:`bench_ab`: the per-call cost of a few small calls in a
host-bound loop, and the kernel time of a few large ones (bf16, H100/H200).

    loop (1000 calls or 300, one sync; median of 5 rounds, µs per call):
        attention B=1 H=8 N=128 D=64: plain, causal, window (32, 0), and forward + backward
        (causal, torch.autograd.grad); attention_kvcache appending one token at B=8, Hq 32 /
        Hkv 8, D 128, 4k keys in an 8k cache
    do_bench median (ms): attention forward B=4 H=16 N=4k D=128, causal and not; the causal
        backward

Writes ``benchmarks/results/ab-probe-<device slug>.json`` (rows ``{"point", "value"}``) and
prints them. ``python benchmarks/bench_ab.py --old <tree> --jobs probe`` runs it from two trees
alternately and reports each point's ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
from _common import device_slug, metadata, write_results

import flashlite


def loop(fn: Callable[[], Any], n: int = 1000, rounds: int = 5) -> float:
    """µs per call of ``n`` back-to-back calls and one synchronize (median of ``rounds``)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_ab_probe needs a CUDA GPU")
        return 2
    dev, bf = "cuda", torch.bfloat16
    out: dict[str, float] = {}
    q, k, v = (torch.randn(1, 8, 128, 64, device=dev, dtype=bf) for _ in range(3))
    out["attn fwd N=128 loop_us"] = loop(lambda: flashlite.attention(q, k, v))
    out["attn causal fwd N=128 loop_us"] = loop(lambda: flashlite.attention(q, k, v, causal=True))
    out["attn window fwd N=128 loop_us"] = loop(
        lambda: flashlite.attention(q, k, v, window=(32, 0))
    )
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def grad() -> None:
        o = flashlite.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(o, (qg, kg, vg), o)

    out["attn grad N=128 loop_us"] = loop(grad, n=300)
    qd = torch.randn(8, 1, 32, 128, device=dev, dtype=bf)
    kc, vc = (torch.randn(8, 8192, 8, 128, device=dev, dtype=bf) for _ in range(2))
    lens = torch.full((8,), 4000, dtype=torch.int32, device=dev)
    kn, vn = (torch.randn(8, 1, 8, 128, device=dev, dtype=bf) for _ in range(2))
    with torch.no_grad():
        out["decode append B=8 loop_us"] = loop(
            lambda: flashlite.attention_kvcache(qd, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn),
            n=300,
        )
    qb, kb, vb = (torch.randn(4, 16, 4096, 128, device=dev, dtype=bf) for _ in range(3))
    for causal in (False, True):
        out[f"attn fwd 4k causal={causal} ms"] = triton.testing.do_bench(
            lambda causal=causal: flashlite.attention(qb, kb, vb, causal=causal)
        )
    leaves = [t.clone().requires_grad_() for t in (qb, kb, vb)]
    ob = flashlite.attention(*leaves, causal=True)
    do = torch.randn_like(ob)
    out["attn bwd 4k causal ms"] = triton.testing.do_bench(
        lambda: torch.autograd.grad(ob, leaves, do, retain_graph=True)
    )
    rows = [{"point": name, "value": value} for name, value in out.items()]
    write_results(f"ab-probe-{device_slug()}", rows, metadata(dtype="bfloat16"))
    for r in rows:
        print(f"{r['point']:<34} {r['value']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
