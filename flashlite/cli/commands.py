"""What each `flashlite` sub-command runs: demo, softmax, attention, traffic, bench and ring
(the argument tree is :mod:`flashlite.cli.parser`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# (the bench listing lives in cli/bench.py; the parser and the docs' test import it from here)
from flashlite.cli.bench import BENCHMARKS, cmd_bench  # noqa: F401

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: ``traffic``'s attention dtypes: FP8 too (its forward and decode tables)
ATTENTION_DTYPES = {**DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


class UsageError(Exception):
    """A command line its sub-command cannot run (options that do not go together, sizes that
    do not fit): :func:`flashlite.cli.main` reports it through that sub-command's parser, as
    argparse does its own errors (usage, ``flashlite <command>: error: ...``, exit status 2)."""


# =============================================================================== helpers
def _max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).abs()
    return float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0


#: The verdict's tolerances against the fp64 reference, the test suite's table: softmax-family
#: outputs pass elementwise ``|y − ref| <= atol + rtol·|ref|``; attention passes when its largest
#: error is at most twice PyTorch's own in the input dtype plus ``floor`` (flash-attn's rule).
SOFTMAX_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}
ATTENTION_FLOOR = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


#: how every ``--json`` result states its tolerance: ``{"atol", "rtol", "rule"}``
TOLERANCE_RULE = "|out - ref| <= atol + rtol*|ref| elementwise"


def _tolerance(atol: float, rtol: float, why: str = "") -> dict[str, Any]:
    return {"atol": atol, "rtol": rtol, "rule": TOLERANCE_RULE + why}


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _emit(args: argparse.Namespace, result: Any, lines: Sequence[str]) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(lines))


# ======================================================================= softmax / attention
def _run_softmax(
    rows: int, n: int, dtype: torch.dtype, algorithm: str, device: str, log: bool = False
) -> dict[str, Any]:
    import flashlite

    x = torch.randn(rows, n, device=device).to(dtype)
    fn = flashlite.log_softmax if log else flashlite.softmax
    t0 = time.perf_counter()
    y = fn(x, -1, algorithm=algorithm)
    elapsed = time.perf_counter() - t0
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    atol, rtol = SOFTMAX_TOL[dtype]
    ok = bool(((y.double() - ref).abs() <= atol + rtol * ref.abs()).all())
    return {
        "op": "log_softmax" if log else "softmax",
        "rows": rows,
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "algorithm": algorithm,
        "device": device,
        "max_abs_error": _max_error(y, ref),
        "tolerance": _tolerance(atol, rtol),
        "ok": ok,
        "seconds": elapsed,
    }


def _run_attention(shape: Any, device: str) -> dict[str, Any]:
    import flashlite
    from flashlite import reference, traffic

    q, k, v = traffic.make_inputs(shape, device)
    t0 = time.perf_counter()
    o = flashlite.attention(q, k, v, causal=shape.causal)
    elapsed = time.perf_counter() - t0
    ref = reference.attention(q, k, v, causal=shape.causal, upcast=True)
    torch_error = _max_error(reference.attention(q, k, v, causal=shape.causal), ref)
    atol = 2 * torch_error + ATTENTION_FLOOR[q.dtype]
    err = _max_error(o, ref)
    why = "; atol = 2 x torch's own largest error in the input dtype + a floor (flash-attn's rule)"
    return {
        "op": "attention",
        # (the defaults as the values they stand for: keys = queries, KV heads = heads)
        **shape.to_json(),
        "seq_k": shape.nk,
        "kv_heads": shape.hkv,
        "device": device,
        "max_abs_error": err,
        "tolerance": _tolerance(atol, 0.0, why),
        "ok": err <= atol,
        "seconds": elapsed,
    }


def cmd_softmax(args: argparse.Namespace) -> int:
    r = _run_softmax(args.rows, args.n, DTYPES[args.dtype], args.algorithm, args.device, args.log)
    _emit(
        args,
        r,
        [
            f"{r['op']} ({args.rows}, {args.n}) {args.dtype} {args.algorithm} on "
            f"{args.device}: max |error| vs torch (fp64) = {r['max_abs_error']:.3g}, "
            f"tolerance atol {r['tolerance']['atol']:g} + rtol {r['tolerance']['rtol']:g}·|ref|: "
            f"{_verdict(r['ok'])} ({r['seconds']:.2f} s)"
        ],
    )
    return 0 if r["ok"] else 1


def _shape_from(args: argparse.Namespace, seq: int) -> Any:
    from flashlite.traffic import AttentionShape

    return AttentionShape(
        batch=args.batch,
        heads=args.heads,
        seq_q=seq,
        head_dim=args.head_dim,
        seq_k=getattr(args, "seq_k", None),
        kv_heads=args.kv_heads,
        dtype=ATTENTION_DTYPES[args.dtype],
        causal=args.causal,
    )


def cmd_attention(args: argparse.Namespace) -> int:
    shape = _shape_from(args, args.seq)
    r = _run_attention(shape, args.device)
    _emit(
        args,
        r,
        [
            f"attention B={shape.batch} H={shape.heads} Hkv={shape.hkv} Nq={shape.seq_q} "
            f"Nk={shape.nk} D={shape.head_dim} {args.dtype} causal={shape.causal} on "
            f"{args.device}: max |error| vs reference (fp64) = {r['max_abs_error']:.3g}, "
            f"tolerance atol {r['tolerance']['atol']:.3g} (2x torch's own error + floor): "
            f"{_verdict(r['ok'])} ({r['seconds']:.2f} s)"
        ],
    )
    return 0 if r["ok"] else 1


# =============================================================================== traffic
def _cmd_softmax_traffic(args: argparse.Namespace) -> int:
    from flashlite.traffic import format_softmax_table, softmax_rows

    rows, notes = softmax_rows(
        args.rows,
        args.n,
        DTYPES[args.dtype],
        args.algorithm,
        count=args.count,
        measure=args.measure,
        gpu=args.gpu,
        l2_bytes=None if args.l2_mib is None else int(args.l2_mib * 2**20),
    )
    for note in dict.fromkeys(notes):
        print(f"note: {note}", file=sys.stderr)
    _emit(args, rows, [format_softmax_table(rows)])
    return _measure_status(args, rows)


def _unmeasured_rows(
    args: argparse.Namespace, option: str, make: Callable[[], Any], fmt: Callable[[Any], str]
) -> int:
    """A traffic table that ``--measure`` does not cover (``option``; the usage checks refuse
    the pair): the rows ``make()`` returns, its notes on stderr, the table. A ValueError from
    ``make()`` (a shape the model leaves out, before any counting) is a usage error."""
    try:
        rows, notes = make()
    except ValueError as err:
        raise UsageError(f"{option}: {err}") from None
    for note in dict.fromkeys(notes):
        print(f"note: {note}", file=sys.stderr)
    _emit(args, rows, [fmt(rows)])
    return 0


def _cmd_shared_prefix_traffic(args: argparse.Namespace) -> int:
    from flashlite.traffic import format_shared_prefix_table, shared_prefix_rows

    # the suffix caches' lengths are --seq; decoding is causal (as --decode)
    shapes = [
        replace(_shape_from(args, n), seq_q=args.decode_q, seq_k=n, causal=True) for n in args.seq
    ]
    return _unmeasured_rows(
        args,
        "--shared-prefix",
        lambda: shared_prefix_rows(
            shapes, args.shared_prefix, count=args.count, gpu=args.gpu, show_progress=not args.quiet
        ),
        format_shared_prefix_table,
    )


def _cmd_block_sparse_traffic(args: argparse.Namespace) -> int:
    from flashlite.traffic import block_sparse_rows, format_block_sparse_table

    shapes = [replace(_shape_from(args, n), seq_k=None, causal=False) for n in args.seq]
    try:  # (a shape the model leaves out fails before any counting)
        rows, notes = block_sparse_rows(
            shapes,
            args.mask,
            docs=args.docs,
            count=args.count,
            measure=args.measure,
            show_progress=not args.quiet,
        )
    except ValueError as err:
        raise UsageError(f"--mask: {err}") from None
    for note in dict.fromkeys(notes):
        print(f"note: {note}", file=sys.stderr)
    _emit(args, rows, [format_block_sparse_table(rows)])
    return _measure_status(args, rows)


def _measure_status(args: argparse.Namespace, rows: Sequence[dict[str, Any]]) -> int:
    """2 when --measure was the whole job and measured nothing, else 0 (the usage checks have
    refused a machine without a GPU or ncu: here ncu ran and failed, e.g. no permission to
    read the GPU's counters)."""
    nothing = all(r.get("measured_bytes") is None for r in rows)
    return 2 if args.measure and nothing and not args.count else 0


def cmd_traffic(args: argparse.Namespace) -> int:
    from flashlite import traffic
    from flashlite.traffic import format_table, plot_traffic, traffic_rows

    if args.softmax:
        return _cmd_softmax_traffic(args)
    if args.ce:
        from flashlite.traffic import cross_entropy_rows, format_softmax_table

        rows = cross_entropy_rows(
            args.rows, args.n, DTYPES[args.dtype], count=args.count, weight=args.ce_weight
        )
        _emit(args, rows, [format_softmax_table(rows)])
        return 0
    if args.shared_prefix is not None:
        return _cmd_shared_prefix_traffic(args)
    if args.mla is not None:
        from flashlite.traffic import format_mla_table, mla_rows

        shapes = [
            replace(_shape_from(args, n), seq_q=args.decode_q, seq_k=n, kv_heads=1, causal=True)
            for n in args.seq
        ]
        return _unmeasured_rows(
            args,
            "--mla",
            lambda: mla_rows(shapes, args.mla, count=args.count, show_progress=not args.quiet),
            format_mla_table,
        )
    if args.mask is not None:
        return _cmd_block_sparse_traffic(args)
    if args.decode:
        from flashlite.traffic import decode_rows

        shapes = [
            replace(_shape_from(args, n), seq_q=args.decode_q, seq_k=n, causal=True)
            for n in args.seq
        ]
        rows, notes = decode_rows(
            shapes, count=args.count, measure=args.measure, show_progress=not args.quiet
        )
        for note in dict.fromkeys(notes):
            print(f"note: {note}", file=sys.stderr)
        _emit(args, rows, [format_table(rows)])
        return _measure_status(args, rows)
    if args.backward:
        from flashlite.traffic import backward_rows

        shapes = [_shape_from(args, n) for n in args.seq]
        rows, notes = backward_rows(
            shapes, count=args.count, measure=args.measure, show_progress=not args.quiet
        )
        for note in dict.fromkeys(notes):
            print(f"note: {note}", file=sys.stderr)
        _emit(args, rows, [format_table(rows)])
        return _measure_status(args, rows)

    methods = args.methods or (
        list(traffic.ATTENTION_METHODS) if args.measure else ["naive", "flashlite"]
    )
    shapes = [_shape_from(args, n) for n in args.seq]
    rows, notes = traffic_rows(
        shapes,
        methods,
        count=args.count,
        measure=args.measure,
        device=args.device,
        show_progress=not args.quiet,
        gpu=args.gpu,
        config=args.config,
        l2_bytes=None if args.l2_mib is None else int(args.l2_mib * 2**20),
    )
    for note in dict.fromkeys(notes):  # once each, in order
        print(f"note: {note}", file=sys.stderr)
    if args.plot:
        shape = shapes[0]
        title = (
            f"B={shape.batch} H={shape.heads} Hkv={shape.hkv} D={shape.head_dim} "
            f"{args.dtype}{' causal' if shape.causal else ''}"
        )
        plot_traffic(rows, str(args.plot), title)
        print(f"wrote plot: {args.plot}", file=sys.stderr)  # stderr: stdout may be --json
    _emit(args, rows, [format_table(rows)])
    return _measure_status(args, rows)


# =============================================================================== demo / bench
def cmd_demo(args: argparse.Namespace) -> int:
    from flashlite.traffic import (
        AttentionShape,
        count_softmax,
        format_table,
        model_softmax,
        plot_traffic,
        traffic_rows,
    )

    failed = 0
    print("== softmax vs torch (CPU, Triton interpreter; tolerance 1e-5 + 1e-5·|ref|)")
    for alg in ("auto", "online", "three_pass"):
        r = _run_softmax(4, 1000, torch.float32, alg, "cpu")
        failed += not r["ok"]
        print(
            f"  {alg:<11} (4, 1000) fp32   max |error| = {r['max_abs_error']:.2e}  "
            f"{_verdict(r['ok'])}"
        )
    print("\n== attention vs reference (fp64)")
    for causal in (False, True):
        shape = AttentionShape(1, 2, 50, 16, seq_k=70, dtype=torch.float32, causal=causal)
        r = _run_attention(shape, "cpu")
        failed += not r["ok"]
        print(
            f"  B=1 H=2 Nq=50 Nk=70 D=16 fp32 causal={causal!s:<5}  "
            f"max |error| = {r['max_abs_error']:.2e}  atol {r['tolerance']['atol']:.1e}  "
            f"{_verdict(r['ok'])}"
        )
    print("\n== softmax kernels: counted bytes (interpreter) vs model, (8, 3000) fp16")
    for alg in ("three_pass", "online", "single_read"):
        c, m = (
            count_softmax(8, 3000, torch.float16, alg),
            model_softmax(8, 3000, torch.float16, alg),
        )
        print(
            f"  {alg:<11} counted {c.total:>8} B   model {m.total:>8} B   "
            f"{'equal' if c.total == m.total else 'DIFFERENT'}"
        )
    print("\n== attention traffic, B=1 H=2 D=16 fp32 causal: counted vs model")
    shapes = [AttentionShape(1, 2, n, 16, dtype=torch.float32, causal=True) for n in (32, 64, 128)]
    rows, _ = traffic_rows(
        shapes,
        ["naive", "flashlite"],
        count=True,
        show_progress=False,
        gpu=args.gpu,
        config=args.config,
        l2_bytes=None if args.l2_mib is None else int(args.l2_mib * 2**20),
    )
    print(format_table(rows))
    out = args.out if args.out is not None else _default_plot()
    if out is None:
        print('\nno plot: matplotlib is not installed (pip install "flashlite-attn[bench]")')
    else:
        plot_traffic(rows, str(out), "B=1 H=2 D=16 fp32 causal (CPU: model and counted)")
        print(f"\nwrote plot: {out}")
    if failed:
        print(f"FAIL: {failed} accuracy check(s) outside their tolerance", file=sys.stderr)
    return 1 if failed else 0


#: The demo's plot when no ``--out`` is given (written only where matplotlib is installed).
DEMO_PLOT = "flashlite-traffic.png"


def _default_plot() -> Path | None:
    """The demo's plot path without ``--out``: ``flashlite-traffic.png`` in the current folder,
    or None where matplotlib is not installed (a bare install: the demo runs, without a plot)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    return Path(DEMO_PLOT).resolve()


def cmd_ring(args: argparse.Namespace) -> int:
    from flashlite.distributed import demo as ring_demo

    return ring_demo.run(args)
