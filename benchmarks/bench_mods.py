"""Your own masks and score functions on the GPU: flashlite.flex_attention against torch's
compiled flex_attention on the same block mask, and against flashlite's built-in kernels.

Points (bf16, D 128, H 16, B 1):

    document     document-causal masks of 8 random-length documents per sequence,
                 N ∈ {8k, 32k, 64k}: flashlite, torch.compile(flex_attention) with torch's
                 block mask of the same mod, and flashlite's dense causal kernel, forward and
                 forward + backward, in TFLOP/s of useful work (4·D per visible pair forward,
                 3.5× that for forward + backward). Bars: ≥ 1.3× Flex, ≥ 0.9× dense causal.
                 Forward + backward is ``torch.autograd.grad`` of q, k, v; the same with
                 ``.backward()`` (which also adds into the leaves' ``.grad``) is recorded
                 beside it ("fwd+bwd into .grad").
    scores       causal N 16k: ALiBi and a relative-bias table as score functions against the
                 same call without one. Bar: ≤ 1.10×.
    built-ins    causal and a 1024-key sliding window written as mask functions against
                 flashlite.attention's causal and window paths (N 16k). Bar: ≤ 1.03×; whether
                 the outputs agree bit for bit is reported. And the built-in window (the flex
                 Hopper kernels over its band) against the Triton window kernels it ran
                 before (``FLASHLITE_HOPPER_KERNEL=0``). Bar: ≤ 1.0×.
    lengths      one mod over 20 sequence lengths: Triton compilations of flashlite's kernels
                 and graphs Dynamo compiles for Flex.
    block mask   create_block_mask at 64k, flashlite's against torch's.
    varlen       (``--only varlen``) 8 random-length documents packed into N ∈ {8k, 32k}:
                 attention_varlen with a causal mask function (and with ALiBi too), against
                 attention_varlen(causal=True) and flex_attention's document-causal tables
                 over the packed sequence. Writes ``mods-varlen-<device>.{json,png}``
                 (the code: ``_mods_varlen.py``).
    python mask  (``--only python``, the code: ``_mods_python.py``) the document-causal mask
                 written as plain Python, ``(ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >=
                 kv_idx)``: against the same mask as the gallery's jit function over 8
                 random-length documents, N ∈ {8k, 32k}, forward and forward + backward
                 (python ÷ jit time).
    document 1k, and forward + backward against Flex with torch's block mask of the same
    document 2k  Python function, fixed-length documents: 1k tokens at N 8k, 2k tokens at
                 N 8k and 32k (Flex ÷ flashlite time; the jit mask beside it). Writes
                 ``mods-python-<device>.{json,png}``.

Every timed result is checked first: flashlite against Flex (both bf16) and against an fp64
reference on the last 128 query rows (the python points: their gradients too). Times are
medians of interleaved rounds of ``triton.testing.do_bench`` medians. Writes
``benchmarks/results/mods-<device>.{json,png}`` and prints a table last.

    python benchmarks/bench_mods.py [--rounds 3] [--quick] [--only {varlen,python}]
    python benchmarks/bench_mods.py --replot benchmarks/results/<file>.json   # PNG only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _common import (
    Setup,
    device_name,
    device_slug,
    max_rel_err,
    metadata,
    replot,
    rows_reference,
    timed_kinds,
    useful_pairs,
    write_results,
)
from _mods_python import python_figure, run_python, sizes
from _mods_varlen import run_varlen, varlen_figure

import flashlite
from flashlite.masking import gallery
from flashlite.ops.attention import compiled_variants
from flashlite.plotting import Bars, Figure, Panel

H, D = 16, 128
DTYPE = torch.bfloat16


def document_points(rows: list[dict], rounds: int, lengths: list[int]) -> None:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    flex = torch.compile(torch_flex)
    for n in lengths:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (
            torch.randn(1, H, n, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(4)
        )
        mm = gallery.document_causal(gallery.random_documents(1, n, 8, seed=n).cuda())
        bm = flashlite.create_block_mask(mm, 1, None, n, n, device="cuda")
        tbm = torch_create(mm, 1, None, n, n, device="cuda")
        pairs = useful_pairs(bm)
        ours = flashlite.flex_attention(q, k, v, block_mask=bm)
        theirs = flex(q, k, v, block_mask=tbm)
        errs = {
            "vs_flex": max_rel_err(ours, theirs),
            "vs_fp64": max_rel_err(ours[:, :, -128:], rows_reference(q, k, v, mm, None)),
        }
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        calls = {
            "flashlite": lambda a, b, c: flashlite.flex_attention(a, b, c, block_mask=bm),
            "flex": lambda a, b, c: flex(a, b, c, block_mask=tbm),
            "dense causal": lambda a, b, c: flashlite.attention(a, b, c, causal=True),
        }
        kinds = ("fwd", "fwd+bwd", "fwd+bwd into .grad")
        for kind, ms in timed_kinds(calls, q, k, v, leaves, do, rounds, kinds):
            flops = 4 * D * H * (1.0 if kind == "fwd" else 3.5)
            dense_pairs = n * (n + 1) // 2
            tflops = {
                name: flops * (dense_pairs if name == "dense causal" else pairs) / t / 1e9
                for name, t in ms.items()
            }
            row = {  # (the .grad variant: a group of its own, beside the bars)
                "group": "document" if kind != "fwd+bwd into .grad" else "document .grad",
                "point": f"doc-causal N{n // 1024}k {kind}",
                "n": n,
                "kind": kind,
                "ms": ms,
                "tflops": tflops,
                "useful_pairs": pairs,
                "sparsity": bm.sparsity(),
                "vs_flex": ms["flex"] / ms["flashlite"],
                "vs_dense_tflops": tflops["flashlite"] / tflops["dense causal"],
                "max_rel_err": errs,
            }
            rows.append(row)
            print(
                f"{row['point']:26s} flashlite {ms['flashlite']:.3f} ms, flex {ms['flex']:.3f}, "
                f"dense {ms['dense causal']:.3f}; x flex {row['vs_flex']:.2f}, TFLOP/s x dense "
                f"{row['vs_dense_tflops']:.2f}; err {max(errs.values()):.1e}",
                flush=True,
            )


def ratio_points(rows: list[dict], rounds: int) -> None:
    n = 16384
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (
        torch.randn(1, H, n, D, device="cuda", dtype=DTYPE, generator=gen) for _ in range(4)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    causal = gallery.causal()
    bm = flashlite.create_block_mask(causal, None, None, n, n, device="cuda")
    scores = {
        "alibi": gallery.alibi(gallery.alibi_slopes(H).cuda()),
        "relative bias": gallery.relative_bias(torch.randn(H, 257, device="cuda")),
    }
    for name, sm in scores.items():
        ours = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm)
        errs = {"vs_fp64": max_rel_err(ours[:, :, -128:], rows_reference(q, k, v, causal, sm))}
        calls = {
            "with": lambda a, b, c, sm=sm: flashlite.flex_attention(
                a, b, c, score_mod=sm, block_mask=bm
            ),
            "without": lambda a, b, c: flashlite.flex_attention(a, b, c, block_mask=bm),
        }
        _ratio_rows(
            rows, "scores", f"{name} N16k", calls, q, k, v, leaves, do, rounds, errs, bar=1.10
        )
    window = 1024
    for name, mm, kw in (
        ("causal", causal, {"causal": True}),
        (
            f"window {window}",
            gallery.sliding_window(window),
            {"causal": True, "window": (window, 0)},
        ),
    ):
        mbm = flashlite.create_block_mask(mm, None, None, n, n, device="cuda")
        ours = flashlite.flex_attention(q, k, v, block_mask=mbm)
        builtin = flashlite.attention(q, k, v, **kw)
        errs = {"vs_builtin": max_rel_err(ours, builtin)}
        calls = {
            "with": lambda a, b, c, m=mbm: flashlite.flex_attention(a, b, c, block_mask=m),
            "without": lambda a, b, c, kw=kw: flashlite.attention(a, b, c, **kw),
        }
        made = _ratio_rows(
            rows,
            "built-ins",
            f"{name} as a mod N16k",
            calls,
            q,
            k,
            v,
            leaves,
            do,
            rounds,
            errs,
            bar=1.03,
        )
        for r in made:
            r["bitwise"] = bool(torch.equal(ours, builtin))
    # the built-in window runs the flex kernels over its band where the Hopper kernels apply:
    # against the Triton window kernels it ran before (FLASHLITE_HOPPER_KERNEL=0 keeps a call,
    # its backward included, on them)
    kw = {"causal": True, "window": (window, 0)}
    folded = flashlite.attention(q, k, v, **kw)
    triton_window = _hopper(flashlite.attention, on=False)(q, k, v, **kw)
    os.environ.pop("FLASHLITE_HOPPER_KERNEL", None)
    calls = {
        "with": _hopper(lambda a, b, c: flashlite.attention(a, b, c, **kw), on=True),
        "without": _hopper(lambda a, b, c: flashlite.attention(a, b, c, **kw), on=False),
    }
    errs = {"vs_triton_window": max_rel_err(folded, triton_window)}
    _ratio_rows(rows, "built-ins", f"window {window} folded vs Triton N16k", calls, q, k, v,
                leaves, do, rounds, errs, bar=1.0)  # fmt: skip
    os.environ.pop("FLASHLITE_HOPPER_KERNEL", None)  # (the points after run as users do)


def _hopper(fn, on: bool):  # noqa: ANN001, ANN202
    """``fn`` with the Hopper kernels allowed (``on``) or not (``FLASHLITE_HOPPER_KERNEL=0``)
    for its call and the backward that follows: the switch stays as set until the next such
    call."""

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if on:
            os.environ.pop("FLASHLITE_HOPPER_KERNEL", None)
        else:
            os.environ["FLASHLITE_HOPPER_KERNEL"] = "0"
        return fn(*args, **kwargs)

    return call


def _ratio_rows(rows, group, label, calls, q, k, v, leaves, do, rounds, errs, bar):  # noqa: ANN001, ANN202
    made = []
    for kind, ms in timed_kinds(calls, q, k, v, leaves, do, rounds):
        row = {
            "group": group,
            "point": f"{label} {kind}",
            "kind": kind,
            "ms": ms,
            "ratio": ms["with"] / ms["without"],
            "bar": bar,
            "max_rel_err": errs,
        }
        rows.append(row)
        made.append(row)
        print(
            f"{row['point']:34s} {ms['with']:.3f} ms / {ms['without']:.3f} ms = "
            f"{row['ratio']:.3f}x (bar {bar}); err {max(errs.values()):.1e}",
            flush=True,
        )
    return made


def lengths_point(rows: list[dict]) -> None:
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    flex = torch.compile(torch_flex)
    lengths = [1000 + 97 * i for i in range(20)]
    causal = gallery.causal()
    first = compiled_variants()
    graphs0 = counters["stats"]["unique_graphs"]
    for n in lengths:
        q, k, v = (
            torch.randn(1, H, n, D, device="cuda", dtype=DTYPE, requires_grad=True)
            for _ in range(3)
        )
        bm = flashlite.create_block_mask(causal, None, None, n, n, device="cuda")
        flashlite.flex_attention(q, k, v, block_mask=bm).sum().backward()
        tbm = torch_create(causal, None, None, n, n, device="cuda")
        flex(q, k, v, block_mask=tbm).sum().backward()
    torch.cuda.synchronize()
    row = {
        "group": "lengths",
        "point": "20 lengths, one mod",
        "lengths": lengths,
        "flashlite_triton_compiles": compiled_variants() - first,
        "flex_dynamo_graphs": counters["stats"]["unique_graphs"] - graphs0,
    }
    rows.append(row)
    print(
        f"20 lengths: flashlite compiled {row['flashlite_triton_compiles']} Triton kernels, "
        f"Flex compiled {row['flex_dynamo_graphs']} graphs",
        flush=True,
    )


def block_mask_point(rows: list[dict], n: int) -> None:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    mm = gallery.document_causal(gallery.random_documents(1, n, 8).cuda())
    times: dict[str, list[float]] = {"flashlite": [], "flex": []}
    for _ in range(3):
        for name, make in (("flashlite", flashlite.create_block_mask), ("flex", torch_create)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            make(mm, 1, None, n, n, device="cuda")
            torch.cuda.synchronize()
            times[name].append(1e3 * (time.perf_counter() - t0))
    ms = {name: statistics.median(t[1:]) for name, t in times.items()}  # (the first compiles)
    rows.append(
        {
            "group": "block mask",
            "point": f"create_block_mask N{n // 1024}k",
            "ms": ms,
            "ratio": ms["flex"] / ms["flashlite"],
            "rounds": times,
        }
    )
    print(
        f"create_block_mask N{n}: flashlite {ms['flashlite']:.2f} ms, flex {ms['flex']:.2f} ms",
        flush=True,
    )


def _short(point: str) -> str:
    """A tick label: ``doc-causal N32k fwd+bwd`` → ``32k f+b``, ``alibi N16k fwd`` → ``alibi f``."""
    words = point.replace("fwd+bwd", "f+b").replace("fwd", "f").split()
    words = [w for w in words if w not in ("doc-causal", "N16k", "as", "a", "mod")]
    return " ".join(w[1:] if w.startswith("N") and w[1:2].isdigit() else w for w in words)


def figure(rows: list[dict], device: str) -> Figure:
    """Document-causal TFLOP/s per engine, and the time ratios of score functions and of the
    built-ins written as mods (f: forward, f+b: forward + backward)."""
    docs = [r for r in rows if r["group"] == "document"]
    ratios = [r for r in rows if r["group"] in ("scores", "built-ins")]
    panels = [
        Panel(
            bars=[
                Bars([r["tflops"][m] for r in docs], m)
                for m in ("flashlite", "flex", "dense causal")
            ],
            categories=[_short(r["point"]) for r in docs],
            ylabel="TFLOP/s (useful)",
            title="document-causal, 8 documents (f: forward, f+b: + backward)",
        ),
        Panel(
            bars=[Bars([r["ratio"] for r in ratios], "with ÷ without")],
            categories=[_short(r["point"]) for r in ratios],
            hlines=[(1.10, "1.10"), (1.03, "1.03")],
            title="score functions; built-ins as mods ÷ built-ins; folded window ÷ Triton (N 16k)",
        ),
    ]
    return Figure([panels], title=f"mask and score functions on {device}", panel_size=(9, 4.5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8k only, one round")
    ap.add_argument(
        "--only", choices=["varlen", "python"], help="run only this group (own results file)"
    )
    ap.add_argument("--replot", metavar="JSON", help="redraw a results JSON's PNG, run nothing")
    args = ap.parse_args(argv)
    if args.replot:
        own = {"mods-varlen": varlen_figure, "mods-python": python_figure}
        replot(args.replot, next((f for k, f in own.items() if k in args.replot), figure))
        return 0
    if not torch.cuda.is_available():
        print("bench_mods needs a CUDA device")
        return 1
    rounds = 1 if args.quick else args.rounds
    lengths = [8192] if args.quick else [8192, 32768, 65536]
    if args.only == "varlen":
        return run_varlen(rounds, lengths[:2], Setup())
    if args.only == "python":
        return run_python(rounds, Setup(), *sizes(args.quick))
    rows: list[dict] = []
    document_points(rows, rounds, lengths)
    ratio_points(rows, rounds)
    lengths_point(rows)
    block_mask_point(rows, lengths[-1])
    docs = [r for r in rows if r["group"] == "document"]
    ratios = [r for r in rows if r["group"] in ("scores", "built-ins")]
    fig = figure(rows, device_name())
    meta = metadata(dtype="bfloat16", heads=H, head_dim=D, command=" ".join(sys.argv))
    paths = write_results(f"mods-{device_slug()}", rows, meta, figure=fig)
    bad = [r["point"] for r in rows if max(r.get("max_rel_err", {"": 0}).values()) > 2e-2]
    print(f"\n{'point':34s} {'result':>40s}")
    for r in docs:
        print(
            f"{r['point']:34s} x flex {r['vs_flex']:5.2f} (bar 1.3), TFLOP/s x dense causal "
            f"{r['vs_dense_tflops']:4.2f} (bar 0.9)"
        )
    for r in rows:
        if r["group"] == "document .grad":
            print(f"{r['point']:34s} x flex {r['vs_flex']:5.2f} (no bar: .backward() into .grad)")
    for r in ratios:
        extra = f", bitwise {r['bitwise']}" if "bitwise" in r else ""
        print(f"{r['point']:34s} {r['ratio']:5.3f}x (bar {r['bar']}){extra}")
    for r in rows:
        if r["group"] == "lengths":
            print(
                f"{r['point']:34s} flashlite compiles {r['flashlite_triton_compiles']}, "
                f"Flex graphs {r['flex_dynamo_graphs']}"
            )
        if r["group"] == "block mask":
            print(
                f"{r['point']:34s} flashlite {r['ms']['flashlite']:.2f} ms, Flex "
                f"{r['ms']['flex']:.2f} ms ({r['ratio']:.1f}x)"
            )
    print("wrote", paths["json"])
    if bad:
        print("WRONG RESULTS:", bad)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
