"""Decoding, varlen, window and softcap speed on a GPU, against SDPA and cuDNN.

Every case checks flashlite's output against a peer (SDPA or the same flashlite call without
the feature) before timing it; timings are ``do_bench`` medians of one interleaved round each,
ratios are taken within this run. Cases:

* ``decode``: B=1, Hq=32, Hkv=8, Nk=128k, D=128, bf16, Nq=1: ``attention_kvcache`` (split-KV)
  against SDPA cuDNN and flash, and against the copy ceiling (a device copy of the K and V
  bytes). The timed call passes ``validate=False`` (no host sync, as a decode loop or a CUDA
  graph calls it); the row ``flashlite-validated`` is the default call, whose value checks
  read back to the host once per call;
* ``decode-b8``: the same with B=8, Nk=8k, against SDPA-flash;
* ``paged``: the B=1 decode from a paged cache (pages of 16 and 256) against the contiguous one;
* ``varlen``: 16 causal sequences of mixed lengths, 16k tokens in all, D=128, against dense
  flashlite at the mean length (TFLOP/s of the useful FLOPs);
* ``window``: window (4096, 0) at N=32k, D=128, against full causal (useful-FLOP TFLOP/s);
* ``softcap``: causal N=16k, D=128, softcap 50 against no cap (time ratio).

    python benchmarks/bench_decode.py        # JSON + PNG in benchmarks/results

The last table printed lists each speed target with its measured ratio.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from _common import bench, device_name, device_slug, metadata, write_results

import flashlite
from flashlite.plotting import Bars, Figure, Panel
from flashlite.reference import sdpa

BF16 = torch.bfloat16


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> float:
    err = (got.float() - want.float()).abs().max().item()
    if not err <= 2e-2 * max(1.0, want.float().abs().max().item()):
        raise AssertionError(f"{name}: max error {err} against its peer")
    return err


def _time(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    return {name: bench(fn) for name, fn in fns.items()}


def _time_graph(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median ms per call replayed from a CUDA graph (``do_bench_cudagraph``): the GPU's time
    alone, without the host's per-call work, as a decode loop captured in a graph runs."""
    import triton.testing

    return {name: float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
            for name, fn in fns.items()}  # fmt: skip


def decode_case(b: int, nk: int, rows: list[dict[str, Any]]) -> None:
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
    lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    fl = lambda: flashlite.attention_kvcache(q, k, v, cache_seqlens=lens, validate=False)  # noqa: E731
    checked = lambda: flashlite.attention_kvcache(q, k, v, cache_seqlens=lens)  # noqa: E731
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    peers = {"sdpa-flash": lambda: sdpa(qh, kh, vh, backend="flash"),
             "sdpa-cudnn": lambda: sdpa(qh, kh, vh, backend="cudnn")}  # fmt: skip
    want = peers["sdpa-flash"]().transpose(1, 2)
    err = _close(fl(), want, "decode")
    kv_bytes = 2 * k.numel() * k.element_size()
    src = torch.empty(kv_bytes // 2, device="cuda", dtype=BF16)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    times = _time({"flashlite": fl, "flashlite-validated": checked, **peers, "copy": copy})
    graph = _time_graph({"flashlite": fl, **peers})
    copy_tbps = 2 * src.numel() * 2 / times["copy"] / 1e9  # read + write
    for name, ms in times.items():
        if name == "copy":
            continue
        row = {"case": f"decode B={b} Nk={nk // 1024}k", "provider": name, "ms": ms,
               "kv_tbps": kv_bytes / ms / 1e9, "err": err if name == "flashlite" else None,
               "x_copy": kv_bytes / ms / 1e9 / copy_tbps}  # fmt: skip
        if name.startswith("flashlite"):
            row |= {f"x_{p}": times[p] / ms for p in peers}
        if name in graph:
            g = graph[name]
            row["graph_ms"] = g  # (no graph copy ratio: a replayed copy ran slower than eager)
            if name == "flashlite":
                row |= {f"graph_x_{p}": graph[p] / g for p in peers}
        rows.append(row)


def paged_case(rows: list[dict[str, Any]]) -> None:
    b, nk, hq, hkv, d = 1, 131072, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
    lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    want = flashlite.attention_kvcache(q, k, v, cache_seqlens=lens)
    fns = {"contiguous": lambda: flashlite.attention_kvcache(q, k, v, cache_seqlens=lens,
                                                             validate=False)}  # fmt: skip
    for ps in (16, 256):
        per = nk // ps
        table = torch.randperm(b * per, device="cuda").view(b, per).to(torch.int32)
        kp = torch.empty(b * per, ps, hkv, d, device="cuda", dtype=BF16)
        vp = torch.empty_like(kp)
        kp[table.long()] = k.view(b, per, ps, hkv, d)
        vp[table.long()] = v.view(b, per, ps, hkv, d)

        def fn(kp=kp, vp=vp, table=table):  # noqa: ANN001, ANN202
            return flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                               validate=False)  # fmt: skip

        _close(fn(), want, f"paged {ps}")
        fns[f"page {ps}"] = fn
    times, graph = _time(fns), _time_graph(fns)
    for name, ms in times.items():
        rows.append({"case": "paged decode B=1 Nk=128k", "provider": name, "ms": ms,
                     "x_contiguous": times["contiguous"] / ms, "graph_ms": graph[name],
                     "graph_x_contiguous": graph["contiguous"] / graph[name]})  # fmt: skip


def varlen_case(rows: list[dict[str, Any]]) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = torch.randint(256, 1793, (16,), generator=gen)
    lengths = weights * 16384 // weights.sum()
    lengths[-1] += 16384 - int(lengths.sum())  # 16k tokens in all, every length near 256-1792
    h, d = 16, 128
    cu = torch.tensor([0, *torch.cumsum(lengths, 0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(16384, h, d, device="cuda", dtype=BF16) for _ in range(3))
    mx = int(lengths.max())
    fn = lambda: flashlite.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True,  # noqa: E731
                                            validate=False)  # fmt: skip
    checked = lambda: flashlite.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True)  # noqa: E731
    out = checked()
    i = int(lengths.argmax())
    one = [t[cu[i] : cu[i + 1]].unsqueeze(0) for t in (q, k, v)]
    _close(out[cu[i] : cu[i + 1]], flashlite.attention(*one, causal=True, layout="b n h d")[0],
           "varlen")  # fmt: skip
    mean = 16384 // 16
    dq, dk, dv = (torch.randn(16, mean, h, d, device="cuda", dtype=BF16) for _ in range(3))
    dense = lambda: flashlite.attention(dq, dk, dv, causal=True, layout="b n h d")  # noqa: E731
    times = _time({"varlen": fn, "varlen-validated": checked, "dense": dense})
    useful = sum(2 * 2 * h * d * n * (n + 1) / 2 for n in lengths.tolist())
    dense_flops = 16 * 2 * 2 * h * d * mean * (mean + 1) / 2
    tf = {name: useful / times[name] / 1e9 for name in ("varlen", "varlen-validated")}
    tf["dense"] = dense_flops / times["dense"] / 1e9
    for name in ("varlen", "varlen-validated", "dense"):
        rows.append({"case": "varlen 16 seqs 16k tokens", "provider": name, "ms": times[name],
                     "tflops": tf[name], "x_dense": tf[name] / tf["dense"]})  # fmt: skip


def window_softcap_cases(rows: list[dict[str, Any]]) -> None:
    h, d = 16, 128
    for case, n, kw_base, kw in (("window (4096, 0) N=32k", 32768, {"causal": True},
                                  {"causal": True, "window": (4096, 0)}),
                                 ("softcap 50 N=16k", 16384, {"causal": True},
                                  {"causal": True, "softcap": 50.0})):  # fmt: skip
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=BF16) for _ in range(3))
        fn = lambda kw=kw: flashlite.attention(q, k, v, **kw)  # noqa: E731
        base = lambda kw=kw_base: flashlite.attention(q, k, v, **kw)  # noqa: E731
        if "window" in kw:  # checked against the reference on the last 256 queries
            tail = q[:, :, -256:]
            want = flashlite.reference.attention(tail.float(), k.float(), v.float(), causal=True,
                                                 window=(4096, 0))  # fmt: skip
            _close(fn()[:, :, -256:], want, case)
            useful = 2 * 2 * h * d * sum(min(i + 1, 4097) for i in range(n))
        else:
            small = [t[:, :, :2048] for t in (q, k, v)]
            want = flashlite.reference.attention(*(t.float() for t in small), **kw)
            _close(flashlite.attention(*small, **kw), want, case)
            useful = 2 * 2 * h * d * n * (n + 1) / 2
        full = 2 * 2 * h * d * n * (n + 1) / 2
        times = _time({"feature": fn, "causal": base})
        rows.append({"case": case, "provider": "flashlite", "ms": times["feature"],
                     "tflops": useful / times["feature"] / 1e9,
                     "causal_tflops": full / times["causal"] / 1e9,
                     "x_time_causal": times["feature"] / times["causal"]})  # fmt: skip


def _musts(rows: list[dict[str, Any]]) -> str:
    """Issue 11's speed musts against this run's ratios, one line each."""

    def get(case: str, provider: str, key: str) -> float:
        return next(r[key] for r in rows if r["case"] == case and r["provider"] == provider)

    checks = []
    for mode in ("", "graph_"):  # eager calls, then CUDA-graph replays
        tag = " [graph]" if mode else " [eager]"
        checks += [
            ("decode B=1 Nk=128k >= 0.95x cuDNN" + tag,
             get("decode B=1 Nk=128k", "flashlite", mode + "x_sdpa-cudnn"), 0.95),
            ("decode B=8 Nk=8k >= 1.0x SDPA-flash" + tag,
             get("decode B=8 Nk=8k", "flashlite", mode + "x_sdpa-flash"), 1.0),
            ("paged (page 16) >= 0.9x contiguous" + tag,
             get("paged decode B=1 Nk=128k", "page 16", mode + "x_contiguous"), 0.9),
            ("paged (page 256) >= 0.9x contiguous" + tag,
             get("paged decode B=1 Nk=128k", "page 256", mode + "x_contiguous"), 0.9),
        ]  # fmt: skip
    checks += [
        ("decode B=1 Nk=128k >= 0.85x copy ceiling [eager]",
         get("decode B=1 Nk=128k", "flashlite", "x_copy"), 0.85),
        ("varlen >= 0.9x dense useful TFLOP/s", get("varlen 16 seqs 16k tokens", "varlen",
                                                     "x_dense"), 0.9),
    ]  # fmt: skip
    window = next(r for r in rows if r["case"].startswith("window"))
    checks.append(("window >= 0.85x causal useful TFLOP/s",
                   window["tflops"] / window["causal_tflops"], 0.85))  # fmt: skip
    cap = next(r for r in rows if r["case"].startswith("softcap"))
    lines = [f"{'must':52} {'measured':>9}  {'bound':>6}  result"]
    for name, got, bound in checks:
        lines.append(f"{name:52} {got:9.3f}  {bound:6.2f}  {'pass' if got >= bound else 'FAIL'}")
    got = cap["x_time_causal"]
    lines.append(f"{'softcap time <= 1.15x without':52} {got:9.3f}  {1.15:6.2f}  "
                 f"{'pass' if got <= 1.15 else 'FAIL'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU")
        return 2
    rows: list[dict[str, Any]] = []
    decode_case(1, 131072, rows)
    decode_case(8, 8192, rows)
    paged_case(rows)
    varlen_case(rows)
    window_softcap_cases(rows)
    for r in rows:
        print({k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v)
               for k, v in r.items()})  # fmt: skip
    print(_musts(rows))
    write_results(f"decode-{device_slug()}", rows, metadata(dtype="bfloat16"),
                  figure=figure(rows, device_name()))  # fmt: skip
    return 0


def figure(rows: list[dict[str, Any]], device: str) -> Figure:
    """One bar per (case, provider): milliseconds, lower is better."""
    # (wrapped: sixteen one-line labels run into each other)
    labels = ["\n".join(textwrap.wrap(f"{r['case']}: {r['provider']}", 14)) for r in rows]
    panel = Panel(bars=[Bars([r["ms"] for r in rows], "ms")], categories=labels,
                  title="decode, varlen, window, softcap (bf16)",
                  ylabel="ms (lower is better)")  # fmt: skip
    return Figure([[panel]], title=f"flashlite decoding, {device}", panel_size=(15, 5))


if __name__ == "__main__":
    raise SystemExit(main())
