"""What attention sinks cost: the same call with and without ``sinks=`` (GPU).

A sink starts each row's online-softmax state at ``(sink, 1)`` instead of ``(−inf, 0)``
(docs/how-it-works/attention.md §6a), so its forward should cost nothing, and its backward only
the sink's gradient, ``−Σ p_sink·delta``, a few elementwise ops over the LSE. Points (bf16):

    attention    B·N = 16k tokens, H = 2048 / D, D ∈ {64, 128}, N ∈ {4k, 16k}, causal and not:
                 forward, and forward + backward (the points of bench_attention.py)
    decode       attention_kvcache, Hq 32 / Hkv 8, D 128: B = 1 against 128k keys and B = 8
                 against 8k (bench_decode.py's)

Each time is the median of interleaved rounds of ``triton.testing.do_bench`` medians (with and
without sinks alternate, so a drifting clock moves both). Before timing, every sinks result is
checked against the exact merge of the sink into the result without sinks
(``o·e^(lse − lse')``, ``lse' = logaddexp(lse, sink)``, autograd through it for the gradients).
The bar: with sinks ≤ 1.03× without. Writes ``benchmarks/results/sinks-<device>.{json,png}`` and
prints a table last.

    python benchmarks/bench_sinks.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _common import bench, device_name, device_slug, max_rel_err, metadata, write_results

import flashlite
from flashlite.plotting import Bars, Figure, Panel

TOKENS = 16384
BAR = 1.03


def merged(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
           heads: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The sink merged into ``(o, lse)`` of ``(B, H, N, D)`` / ``(B, H, N)``: the reference."""
    sink = sinks.float().view(1, heads, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return (o.float() * torch.exp(lse - total).unsqueeze(-1)).to(o.dtype), total


def attention_points(rows: list[dict], rounds: int) -> None:
    for d in (64, 128):
        h = 2048 // d
        for n in (4096, 16384):
            b = TOKENS // n
            gen = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                       generator=gen) for _ in range(4))  # fmt: skip
            sinks = torch.randn(h, device="cuda", generator=gen)
            for causal in (False, True):
                label = f"D{d} N{n // 1024}k {'causal' if causal else 'full'}"
                errs = check_attention(q, k, v, do, sinks, causal)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                sink_leaf = sinks.clone().requires_grad_()

                def fwd(with_sinks: bool, causal: bool = causal) -> None:
                    flashlite.attention(q, k, v, causal=causal,
                                        sinks=sinks if with_sinks else None)  # fmt: skip

                def fwd_bwd(with_sinks: bool, causal: bool = causal) -> None:
                    o = flashlite.attention(*leaves, causal=causal,
                                            sinks=sink_leaf if with_sinks else None)  # fmt: skip
                    o.backward(do)

                for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    rows.append(timed(f"{label} {kind}", fn, rounds, errs, "attention"))


def check_attention(q, k, v, do, sinks, causal) -> dict:  # noqa: ANN001
    """Max relative errors of the sinks call against the merge of the plain one."""
    heads = q.shape[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = flashlite.attention(*leaves[:3], causal=causal, sinks=leaves[3], return_lse=True)
    o.backward(do)
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    o0, lse0 = flashlite.attention(*ref[:3], causal=causal, return_lse=True)
    ro, rlse = merged(o0, lse0, ref[3], heads)
    ro.backward(do)
    errs = {"out": max_rel_err(o, ro), "lse": max_rel_err(lse, rlse)}
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), leaves, ref, strict=True):
        errs[name] = max_rel_err(a.grad, b.grad)
    return errs


def decode_points(rows: list[dict], rounds: int) -> None:
    for bsz, nk in ((1, 131072), (8, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(nk + bsz)
        q = torch.randn(bsz, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_cache, v_cache = (torch.randn(bsz, nk, 8, 128, device="cuda", dtype=torch.bfloat16,
                                        generator=gen) for _ in range(2))  # fmt: skip
        lens = torch.full((bsz,), nk, device="cuda", dtype=torch.int32)
        sinks = torch.randn(32, device="cuda", generator=gen)
        o, lse = flashlite.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lens, sinks=sinks,
                                             return_lse=True)  # fmt: skip
        o0, lse0 = flashlite.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                               return_lse=True)  # fmt: skip
        ro, rlse = merged(o0.transpose(1, 2), lse0, sinks, 32)
        errs = {"out": max_rel_err(o.transpose(1, 2), ro), "lse": max_rel_err(lse, rlse)}

        def step(with_sinks: bool) -> None:
            flashlite.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                        sinks=sinks if with_sinks else None)  # fmt: skip

        rows.append(timed(f"decode B{bsz} Nk{nk // 1024}k", step, rounds, errs, "decode"))


def timed(label: str, fn, rounds: int, errs: dict, group: str) -> dict:  # noqa: ANN001
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for with_sinks in (False, True):
            times[with_sinks].append(bench(lambda w=with_sinks: fn(w)))
    plain, sink = (statistics.median(times[w]) for w in (False, True))
    row = {"point": label, "group": group, "ms_plain": plain, "ms_sinks": sink,
           "ratio": sink / plain, "max_rel_err": errs, "rounds": times}  # fmt: skip
    print(f"{label:28s} {plain:8.3f} ms  {sink:8.3f} ms  {sink / plain:.3f}x  "
          f"err {max(errs.values()):.2e}", flush=True)  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_sinks needs a CUDA device")
        return 1
    rows: list[dict] = []
    attention_points(rows, args.rounds)
    decode_points(rows, args.rounds)
    bad = [r["point"] for r in rows if max(r["max_rel_err"].values()) > 2e-2]
    panel = Panel(bars=[Bars([r["ratio"] for r in rows], "with ÷ without sinks")],
                  categories=[r["point"] for r in rows], hlines=[(BAR, f"bar {BAR}")],
                  title="time with sinks ÷ without (do_bench medians)")  # fmt: skip
    fig = Figure([[panel]], title=f"attention sinks on {device_name()}", panel_size=(14, 4))
    meta = metadata(dtype="bfloat16", tokens=TOKENS, bar=BAR, command=" ".join(sys.argv))
    paths = write_results(f"sinks-{device_slug()}", rows, meta, figure=fig)
    print(f"\n{'point':28s} {'without':>10s} {'with':>10s} {'ratio':>7s}  bar {BAR}")
    for r in rows:
        ok = "pass" if r["ratio"] <= BAR else "MISS"
        print(f"{r['point']:28s} {r['ms_plain']:9.3f}m {r['ms_sinks']:9.3f}m "
              f"{r['ratio']:6.3f}x  {ok}")  # fmt: skip
    print("wrote", paths["json"])
    if bad:
        print("WRONG RESULTS:", bad)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
