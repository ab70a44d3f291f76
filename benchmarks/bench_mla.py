"""DeepSeek's attention shapes on the GPU: 192/128 attention and absorbed MLA decoding.

Points, each measured side by side in interleaved rounds of ``triton.testing.do_bench`` medians:

    192/128   ``attention(q, k, v)`` with q, k 192 wide and v 128 (bf16), B·N = 16k tokens,
              16 heads, N ∈ {4k, 16k}, causal and not: forward, and forward + backward,
              against SDPA's cuDNN backend on the same shapes where it runs them (else the
              row says what it raised). Bar: ≥ 1.0× cuDNN.
    decode    ``attention_mla_decode``: 128 heads, one query, a paged latent cache (pages of
              64) of 576-wide rows whose first 512 columns are the values, B ∈ {1, 4, 16} ×
              {4k, 16k, 64k} tokens: the latent bytes read per second against a device copy
              of the same bytes (bar: ≥ 0.85× the copy), and B = 128 at 4k tokens against the
              bf16 matrix-product ceiling (a 8192² matmul in the same run; bar: ≥ 0.6×).

Before timing, each result is checked: 192/128 against SDPA's efficient backend (which takes
V's own head dim), the decode against a torch reference of two batch rows. Writes
``benchmarks/results/mla-<device>.{json,png}`` and prints a table last.

    python benchmarks/bench_mla.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _common import bench, device_name, device_slug, max_rel_err, metadata, write_results

import flashlite
from flashlite import reference
from flashlite.plotting import Bars, Figure, Panel

TOKENS = 16384
CUDNN_BAR, COPY_BAR, MATMUL_BAR = 1.0, 0.85, 0.6


def _median(fn, rounds: int) -> float:  # noqa: ANN001
    return statistics.median(bench(fn) for _ in range(rounds))


def attention_points(rows: list[dict], rounds: int) -> None:
    h = 16
    for n in (4096, 16384):
        b = TOKENS // n
        gen = torch.Generator(device="cuda").manual_seed(n)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

        q, k, v, do = rand(b, h, n, 192), rand(b, h, n, 192), rand(b, h, n, 128), rand(b, h, n, 128)
        for causal in (False, True):
            point = f"192/128 N{n // 1024}k {'causal' if causal else 'full'}"
            want = reference.sdpa(q, k, v, causal=causal, backend="efficient")
            err = max_rel_err(flashlite.attention(q, k, v, causal=causal), want)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def ours(causal: bool = causal) -> torch.Tensor:
                return flashlite.attention(q, k, v, causal=causal)

            def ours_fb(causal: bool = causal) -> None:
                out = flashlite.attention(*leaves, causal=causal)
                torch.autograd.grad(out, leaves, do)

            def cudnn(causal: bool = causal) -> torch.Tensor:
                return reference.sdpa(q, k, v, causal=causal, backend="cudnn")

            def cudnn_fb(causal: bool = causal) -> None:
                out = reference.sdpa(*leaves, causal=causal, backend="cudnn")
                torch.autograd.grad(out, leaves, do)

            row = {"kind": "192/128", "point": point, "max_rel_err": err}
            for name, fn, peer in (("fwd", ours, cudnn), ("fwd+bwd", ours_fb, cudnn_fb)):
                row[f"ms_{name}"] = _median(fn, rounds)
                try:
                    row[f"ms_cudnn_{name}"] = _median(peer, rounds)
                    row[f"ratio_{name}"] = row[f"ms_cudnn_{name}"] / row[f"ms_{name}"]
                except RuntimeError as e:  # (cuDNN may not take V's own head dim)
                    row[f"cudnn_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
                    row[f"ratio_{name}"] = None
            rows.append(row)


def _mla_inputs(b: int, n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(b * n)
    pages = b * n // 64
    cache = torch.randn(pages, 64, 1, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(b, n // 64)
    q = torch.randn(b, 1, 128, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return q, cache, table, lens


def _mla_check(q, cache, table, lens) -> float:  # noqa: ANN001
    out = flashlite.attention_mla_decode(q, cache, cache_seqlens=lens, scale=0.1,
                                         block_table=table)  # fmt: skip
    errs = []
    for i in range(min(2, q.shape[0])):
        kv = cache[table[i]].reshape(-1, 576).float()
        s = torch.einsum("hd,kd->hk", q[i, 0].float(), kv) * 0.1
        want = torch.softmax(s, -1) @ kv[:, :512]
        errs.append(max_rel_err(out[i, 0], want))
    return max(errs)


def decode_points(rows: list[dict], rounds: int) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_tflops = 2 * 8192**3 / _median(lambda: a @ a, rounds) / 1e9
    points = [(b, n) for b in (1, 4, 16) for n in (4096, 16384, 65536)] + [(128, 4096)]
    for b, n in points:
        q, cache, table, lens = _mla_inputs(b, n)
        err = _mla_check(q, cache, table, lens)

        def step() -> torch.Tensor:
            return flashlite.attention_mla_decode(q, cache, cache_seqlens=lens, scale=0.1,
                                                  block_table=table)  # fmt: skip

        src = cache.view(-1)
        dst = torch.empty_like(src)
        ms = _median(step, rounds)
        ms_copy = _median(lambda: dst.copy_(src), rounds)
        latent = cache.numel() * 2
        row = {"kind": "decode", "point": f"MLA B{b} {n // 1024}k", "max_rel_err": err, "ms": ms,
               "latent_gbps": latent / ms / 1e6,
               "copy_gbps": 2 * latent / ms_copy / 1e6}  # fmt: skip
        row["of_copy"] = row["latent_gbps"] / row["copy_gbps"]
        flops = 2 * b * 128 * n * (576 + 512)
        row["tflops"] = flops / ms / 1e9
        row["of_matmul"] = row["tflops"] / matmul_tflops
        row["bar"] = MATMUL_BAR if b == 128 else COPY_BAR
        rows.append(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla needs a CUDA device")
        return 1
    rows: list[dict] = []
    attention_points(rows, args.rounds)
    decode_points(rows, args.rounds)
    bad = [r["point"] for r in rows if not r["max_rel_err"] <= 2e-2]

    def shown(r: dict) -> float:  # (vs cuDNN; the decode vs the copy, B = 128 vs matmul)
        if r.get("bar") == MATMUL_BAR:
            return r["of_matmul"]
        return r.get("ratio_fwd") or r.get("of_copy") or float("nan")

    values = [shown(r) for r in rows]
    panel = Panel(bars=[Bars(values, "vs cuDNN (192/128) · vs copy or matmul (MLA decode)")],
                  categories=[r["point"] for r in rows],
                  hlines=[(1.0, ""), (COPY_BAR, f"copy bar {COPY_BAR}")],
                  title="DeepSeek shapes against their baselines (do_bench medians)")  # fmt: skip
    fig = Figure([[panel]], title=f"192/128 attention and absorbed MLA on {device_name()}",
                 panel_size=(16, 4))  # fmt: skip
    paths = write_results(f"mla-{device_slug()}", rows, metadata(command=" ".join(sys.argv)),
                          figure=fig)  # fmt: skip
    print(f"\n{'point':26s} {'ms':>9s} {'ratio':>8s}  detail")
    for r in rows:
        if r["kind"] == "192/128":
            detail = (f"fwd {r['ratio_fwd'] or r.get('cudnn_fwd')} x cuDNN, fwd+bwd "
                      f"{r['ratio_fwd+bwd'] or r.get('cudnn_fwd+bwd')} x cuDNN")  # fmt: skip
            print(f"{r['point']:26s} {r['ms_fwd']:8.3f}m {'':>8s}  {detail}")
        else:
            print(f"{r['point']:26s} {r['ms']:8.3f}m {r['of_copy']:7.2f}x  "
                  f"{r['latent_gbps']:.0f} GB/s, {r['tflops']:.0f} TFLOP/s "
                  f"({r['of_matmul']:.2f}x matmul)")  # fmt: skip
    print("wrote", paths["json"])
    if bad:
        print("WRONG RESULTS:", bad)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
