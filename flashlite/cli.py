"""The `flashlite` command: demo | softmax | attention | traffic | bench.

Everything runs on a CPU (Triton's interpreter) unless `--device cuda` is given; `traffic
--measure` needs a GPU and Nsight Compute. `--json` prints machine-readable results on stdout
(notes and progress go to stderr). The help texts shown to users are the plain-text constants
below (`_DESCRIPTION`, `_EXAMPLES`, ...), not this docstring.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# =============================================================================== helpers
def _max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).abs()
    return float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0


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
    return {
        "op": "log_softmax" if log else "softmax",
        "rows": rows,
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "algorithm": algorithm,
        "device": device,
        "max_abs_error": _max_error(y, ref),
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
    return {
        "op": "attention",
        **shape.to_json(),
        "device": device,
        "max_abs_error": _max_error(o, ref),
        "seconds": elapsed,
    }


def _cmd_softmax(args: argparse.Namespace) -> int:
    r = _run_softmax(args.rows, args.n, _DTYPES[args.dtype], args.algorithm, args.device, args.log)
    _emit(
        args,
        r,
        [
            f"{r['op']} ({args.rows}, {args.n}) {args.dtype} {args.algorithm} on "
            f"{args.device}: max |error| vs torch (fp64) = {r['max_abs_error']:.3g} "
            f"({r['seconds']:.2f} s)"
        ],
    )
    return 0


def _shape_from(args: argparse.Namespace, seq: int) -> Any:
    from flashlite.traffic import AttentionShape

    return AttentionShape(
        batch=args.batch,
        heads=args.heads,
        seq_q=seq,
        head_dim=args.head_dim,
        seq_k=getattr(args, "seq_k", None),
        kv_heads=args.kv_heads,
        dtype=_DTYPES[args.dtype],
        causal=args.causal,
    )


def _cmd_attention(args: argparse.Namespace) -> int:
    shape = _shape_from(args, args.seq)
    r = _run_attention(shape, args.device)
    _emit(
        args,
        r,
        [
            f"attention B={shape.batch} H={shape.heads} Hkv={shape.hkv} Nq={shape.seq_q} "
            f"Nk={shape.nk} D={shape.head_dim} {args.dtype} causal={shape.causal} on "
            f"{args.device}: max |error| vs reference (fp64) = {r['max_abs_error']:.3g} "
            f"({r['seconds']:.2f} s)"
        ],
    )
    return 0


# =============================================================================== traffic
def _cmd_softmax_traffic(args: argparse.Namespace) -> int:
    from flashlite.traffic import format_softmax_table, softmax_rows

    rows, notes = softmax_rows(
        args.rows,
        args.n,
        _DTYPES[args.dtype],
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


def _measure_status(args: argparse.Namespace, rows: Sequence[dict[str, Any]]) -> int:
    """2 when --measure was the whole job and measured nothing (no GPU or ncu), else 0."""
    nothing = all(r.get("measured_bytes") is None for r in rows)
    return 2 if args.measure and nothing and not args.count else 0


def _cmd_traffic(args: argparse.Namespace) -> int:
    from flashlite import traffic
    from flashlite.traffic import format_table, plot_traffic, traffic_rows

    if args.softmax:
        return _cmd_softmax_traffic(args)
    if args.ce:
        from flashlite.traffic import cross_entropy_rows, format_softmax_table

        rows = cross_entropy_rows(args.rows, args.n, _DTYPES[args.dtype], count=args.count,
                                  weight=args.ce_weight)  # fmt: skip
        _emit(args, rows, [format_softmax_table(rows)])
        return 0
    if args.decode:
        from flashlite.traffic import decode_rows

        shapes = [replace(_shape_from(args, n), seq_q=args.decode_q, seq_k=n, causal=True)
                  for n in args.seq]  # fmt: skip
        rows, notes = decode_rows(shapes, count=args.count, measure=args.measure,
                                  show_progress=not args.quiet)  # fmt: skip
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
def _cmd_demo(args: argparse.Namespace) -> int:
    from flashlite.traffic import (
        AttentionShape,
        count_softmax,
        format_table,
        model_softmax,
        plot_traffic,
        traffic_rows,
    )

    print("== softmax vs torch (CPU, Triton interpreter)")
    for alg in ("auto", "online", "three_pass"):
        r = _run_softmax(4, 1000, torch.float32, alg, "cpu")
        print(f"  {alg:<11} (4, 1000) fp32   max |error| = {r['max_abs_error']:.2e}")
    print("\n== attention vs reference (fp64)")
    for causal in (False, True):
        shape = AttentionShape(1, 2, 50, 16, seq_k=70, dtype=torch.float32, causal=causal)
        r = _run_attention(shape, "cpu")
        print(
            f"  B=1 H=2 Nq=50 Nk=70 D=16 fp32 causal={causal!s:<5}  "
            f"max |error| = {r['max_abs_error']:.2e}"
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
    plot_traffic(rows, str(args.out), "B=1 H=2 D=16 fp32 causal (CPU: model and counted)")
    print(f"\nwrote plot: {args.out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    print(
        "Benchmarks are scripts in benchmarks/ (they need a GPU):\n"
        "  python benchmarks/bench_softmax.py      # GB/s against torch and the copy ceiling\n"
        "  python benchmarks/bench_attention.py    # TFLOP/s against SDPA backends and Flex\n"
        "  python benchmarks/bench_traffic.py      # DRAM bytes with Nsight Compute\n"
        "  python benchmarks/bench_overhead.py     # per-call cost at small shapes\n"
        "Each writes JSON + PNG to benchmarks/results/ and prints a table last."
    )
    return 0


# =============================================================================== parser
_DESCRIPTION = """\
Online softmax and tiled attention in Triton: check them against torch, and count the
HBM bytes they move.

Without a CUDA GPU every kernel runs in Triton's interpreter on the CPU: the same kernel
source, slower, no setting needed. Give --device cuda to run compiled on a GPU."""

_EXAMPLES = """\
examples:
  flashlite demo                        accuracy checks, traffic table and a plot (CPU)
  flashlite softmax --rows 4 --n 4096 --algorithm online
  flashlite attention --seq 128 --seq-k 256 --causal --json
  flashlite traffic --seq 64 128 256 --count --plot traffic.png
  flashlite traffic --seq 4096 16384 --head-dim 128 --dtype bfloat16 --measure   (GPU + ncu)

Run 'flashlite COMMAND --help' for the options of one command. With --json, results go to
stdout as JSON; notes and progress go to stderr."""

_DEMO = """\
A quick tour on the CPU (Triton's interpreter, a few seconds):
  1. softmax (every algorithm) and attention (causal and not) against fp64 references;
  2. the bytes each softmax kernel loads and stores, counted, next to the traffic model;
  3. the same for attention (naive vs flashlite), as a table and a log-log plot.
The plot is written to --out; the command prints its absolute path."""

_DEMO_EXAMPLES = """\
examples:
  flashlite demo                        writes ./flashlite-traffic.png
  flashlite demo --out /tmp/traffic.svg"""

_SOFTMAX = """\
Run flashlite.softmax (or log_softmax) on a random (rows, n) tensor and print the largest
absolute error against torch computed in fp64, and the time the call took."""

_SOFTMAX_EXAMPLES = """\
examples:
  flashlite softmax --rows 4 --n 4096 --algorithm online
  flashlite softmax --log --dtype bfloat16 --json"""

_ATTENTION = """\
Run flashlite.attention on random Q, K, V of shape (batch, heads, seq, head-dim) and print
the largest absolute error against flashlite.reference.attention in fp64."""

_ATTENTION_EXAMPLES = """\
examples:
  flashlite attention --seq 128 --causal
  flashlite attention --heads 8 --kv-heads 2 --seq 1 --seq-k 300 --json   (GQA, one query)"""

_TRAFFIC = """\
HBM bytes of one attention call, per method and sequence length, three ways:
  model     closed-form bytes (always shown);
  counted   bytes of every load and store, running the kernels in Triton's interpreter
            (--count; on a CUDA machine the command re-runs itself with TRITON_INTERPRET=1);
  measured  DRAM bytes from Nsight Compute (--measure; needs a CUDA GPU and ncu).
The last column compares the best available figure with the compulsory bytes (Q, K, V and
O each moved once)."""

_TRAFFIC_EXAMPLES = """\
examples:
  flashlite traffic --seq 1024 4096 --head-dim 64                   model only, instant
  flashlite traffic --seq 64 128 256 --causal --count --plot traffic.png
  flashlite traffic --seq 4096 16384 --heads 16 --head-dim 128 --dtype bfloat16 --measure"""

_BENCH = """\
Print how to run the benchmark scripts in benchmarks/ (they need a GPU and write JSON and
PNG files to benchmarks/results/)."""


# keeps the line breaks of descriptions and examples; option help is wrapped as usual
_Formatter = argparse.RawDescriptionHelpFormatter


def _option(parser: argparse.ArgumentParser, *flags: str, help: str, **kwargs: Any) -> None:
    """`parser.add_argument` whose help always ends with the default (unless it states one)."""
    if "default" not in help:
        on_off = kwargs.get("action") == "store_true"
        help += " (default: off)" if on_off else " (default: %(default)s)"
    parser.add_argument(*flags, help=help, **kwargs)


def _tile_options(parser: argparse.ArgumentParser) -> None:
    """--gpu and --config: which tiles flashlite's kernels are counted and modelled with."""
    _option(
        parser,
        "--gpu",
        choices=["h200", "generic"],
        default="h200",
        help="whose tile table picks flashlite's config for each shape (the interpreter runs any "
        "tile): h200, Hopper's measured table; generic, the autotuner's first fitting candidate",
    )
    _option(
        parser,
        "--l2-mib",
        type=float,
        default=None,
        help="L2 size in MiB for the DRAM estimate (default: the --gpu table's, 60 for h200, "
        "40 for generic)",
    )
    _option(
        parser,
        "--config",
        default=None,
        metavar="BMxBN[xWARPSxSTAGES]",
        help="count and model flashlite with this tile config instead, e.g. 64x64 or 128x64x4x3 "
        "(default: the --gpu table's choice)",
    )


def _plot_path(value: str) -> Path:
    """argparse type of a plot path: absolute, in a folder that exists, with a format matplotlib
    writes (checked before any slow work, so a typo does not cost a whole run)."""
    path = Path(value).expanduser().resolve()
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: folder {path.parent} does not exist")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as err:
        raise argparse.ArgumentTypeError(
            "plots need matplotlib: pip install matplotlib (or flashlite[bench])"
        ) from err
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"{value!r}: the file name must end in one of {', '.join('.' + f for f in formats)}"
        )
    return path


class _Version(argparse.Action):
    """`--version`: imports flashlite only when asked (importing it loads triton)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        import triton

        import flashlite

        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        print(f"flashlite {flashlite.__version__} ({versions})")
        parser.exit()


_DEVICE_HELP = (
    "where the tensors live: cpu runs the kernels in Triton's interpreter, cuda or cuda:N "
    "compiles them for that GPU"
)


def _shape_options(sp: argparse.ArgumentParser, *, many: bool, device_help: str) -> None:
    """The attention shape options `attention` and `traffic` share."""
    _option(sp, "--batch", type=int, default=1, help="batch size B")
    _option(sp, "--heads", type=int, default=2, help="query heads H")
    _option(
        sp,
        "--kv-heads",
        type=int,
        default=None,
        help="key/value heads (fewer than --heads for GQA; default: --heads)",
    )
    if many:
        _option(
            sp,
            "--seq",
            type=int,
            nargs="+",
            default=[64, 128],
            metavar="N",
            help="sequence lengths, one row each (queries and keys; default: 64 128)",
        )
    else:
        _option(sp, "--seq", type=int, default=64, help="query length")
        _option(sp, "--seq-k", type=int, default=None, help="key length (default: --seq)")
    _option(sp, "--head-dim", type=int, default=16, help="head dimension D")
    _option(sp, "--dtype", choices=list(_DTYPES), default="float32", help="Q, K, V dtype")
    _option(
        sp,
        "--causal",
        action="store_true",
        help="causal mask, aligned bottom-right when there are more keys than queries",
    )
    _option(sp, "--device", default="cpu", help=device_help)
    _option(sp, "--json", action="store_true", help="print the results as JSON on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the `flashlite` command."""
    p = argparse.ArgumentParser(
        prog="flashlite", description=_DESCRIPTION, epilog=_EXAMPLES, formatter_class=_Formatter
    )
    p.add_argument(
        "--version", action=_Version, help="print the flashlite, torch and triton versions and exit"
    )
    sub = p.add_subparsers(dest="command", required=True, title="commands")

    def command(name: str, summary: str, description: str, examples: str | None = None) -> Any:
        return sub.add_parser(
            name,
            help=summary,
            description=description,
            epilog=examples,
            formatter_class=_Formatter,
        )

    d = command(
        "demo", "quick CPU tour: accuracy checks, traffic table, plot", _DEMO, _DEMO_EXAMPLES
    )
    _option(
        d,
        "--out",
        "--plot",
        dest="out",
        type=_plot_path,
        default="flashlite-traffic.png",
        metavar="PATH",
        help="where to write the plot (.png, .svg, .pdf, ...); relative paths are taken from "
        "the current folder and the absolute path is printed (default: %(default)s)",
    )
    _tile_options(d)
    d.set_defaults(func=_cmd_demo)

    s = command(
        "softmax", "flashlite.softmax on a random (rows, n) tensor", _SOFTMAX, _SOFTMAX_EXAMPLES
    )
    _option(s, "--rows", type=int, default=8, help="number of rows")
    _option(s, "--n", type=int, default=1000, help="row length, the softmax dimension")
    _option(s, "--dtype", choices=list(_DTYPES), default="float32", help="input dtype")
    _option(
        s,
        "--algorithm",
        choices=["auto", "three_pass", "online"],
        default="auto",
        help="auto: the fastest correct kernel; online: one tiled pass for the row statistics, "
        "then the write; three_pass: max, sum, write",
    )
    _option(s, "--log", action="store_true", help="run log_softmax instead of softmax")
    _option(s, "--device", default="cpu", help=_DEVICE_HELP)
    _option(s, "--json", action="store_true", help="print the result as JSON on stdout")
    s.set_defaults(func=_cmd_softmax)

    a = command(
        "attention", "flashlite.attention vs the fp64 reference", _ATTENTION, _ATTENTION_EXAMPLES
    )
    _shape_options(a, many=False, device_help=_DEVICE_HELP)
    a.set_defaults(func=_cmd_attention)

    t = command(
        "traffic",
        "HBM bytes: model, counted (CPU), measured (ncu, GPU)",
        _TRAFFIC,
        _TRAFFIC_EXAMPLES,
    )
    _shape_options(
        t,
        many=True,
        device_help="where the flashlite model's tile config comes from: cpu, the --gpu "
        "table (or --config); cuda or cuda:N, what that GPU runs. Counting always runs on the CPU",
    )
    methods = ["naive", "flashlite", "sdpa-flash", "sdpa-cudnn"]
    _option(
        t,
        "--methods",
        nargs="+",
        default=None,
        choices=methods,
        metavar="METHOD",
        help=f"attention implementations to show, any of {', '.join(methods)}; sdpa-* are only "
        "measured (default: naive flashlite; all four with --measure)",
    )
    _option(t, "--count", action="store_true", help="count bytes by running on the CPU")
    _option(
        t,
        "--measure",
        action="store_true",
        help="measure DRAM bytes with Nsight Compute; needs a CUDA GPU and ncu",
    )
    _option(
        t,
        "--plot",
        type=_plot_path,
        default=None,
        metavar="PATH",
        help="also write a log-log plot there; its absolute path is printed on stderr "
        "(default: no plot)",
    )
    _tile_options(t)
    _option(
        t,
        "--softmax",
        action="store_true",
        help="show the row softmax's bytes instead of attention's (--rows, --n, --algorithm)",
    )
    _option(
        t,
        "--backward",
        action="store_true",
        help="show the attention backward's bytes: flashlite's three kernels (model; --count "
        "counts them) against naive autograd (counted); --measure: DRAM bytes of each backward "
        "alone (GPU + ncu)",
    )
    _option(
        t,
        "--decode",
        action="store_true",
        help="show decoding's bytes: --decode-q new queries against caches of --seq keys, "
        "flashlite's split-KV path (model; --count counts it) against the materialising "
        "reference (counted)",
    )
    _option(t, "--decode-q", type=int, default=1, help="queries per sequence (with --decode)")
    _option(
        t,
        "--ce",
        action="store_true",
        help="show fused cross-entropy's bytes, forward + backward, on (--rows, --n) logits "
        "(model; --count counts it) against torch's cross_entropy (counted)",
    )
    _option(t, "--ce-weight", action="store_true", help="with --ce: class weights")
    _option(t, "--rows", type=int, default=4096, help="softmax rows (with --softmax)")
    _option(t, "--n", type=int, default=4096, help="softmax row length (with --softmax)")
    algorithms = ["auto", "three_pass", "online", "single_read", "split", "team", "prefetch"]
    _option(
        t,
        "--algorithm",
        nargs="+",
        choices=algorithms,
        default=["three_pass", "online", "single_read", "team", "prefetch"],
        metavar="ALG",
        help=f"softmax kernels to show, any of {', '.join(algorithms)} (team and prefetch run "
        "on GPUs only: modelled, not counted) (default: three_pass online single_read team "
        "prefetch)",
    )
    _option(t, "--quiet", action="store_true", help="no progress bar on stderr")
    t.set_defaults(func=_cmd_traffic)

    b = command("bench", "how to run the benchmark scripts", _BENCH)
    b.set_defaults(func=_cmd_bench)

    from flashlite.distributed import demo as ring_demo

    r = command(
        "ring",
        "ring attention across gloo processes on CPU: error and bytes per rank",
        ring_demo.__doc__ or "",
    )
    ring_demo.add_options(r)
    r.set_defaults(func=_cmd_ring)
    return p


def _cmd_ring(args: argparse.Namespace) -> int:
    from flashlite.distributed import demo as ring_demo

    return ring_demo.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flashlite` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "l2_mib", None) is not None and not args.l2_mib > 0:
        parser.error(f"--l2-mib={args.l2_mib}: the L2 size must be a positive number of MiB")
    if getattr(args, "config", None):  # a bad --config fails now, before any slow work
        from flashlite.traffic import parse_config

        head_dim = getattr(args, "head_dim", 16)  # demo: D = 16
        try:
            parse_config(args.config, head_dim, _DTYPES[getattr(args, "dtype", "float32")])
        except ValueError as err:
            parser.error(str(err))
    counts = args.func is _cmd_demo or (args.func is _cmd_traffic and args.count)
    if counts:
        from flashlite import _backend

        if not _backend.kernels_interpreted():
            # Counting runs kernels in Triton's interpreter, which a process that compiles for
            # its GPU cannot switch on: run the same command in one that interprets.
            cmd = [sys.executable, "-m", "flashlite.cli", *(sys.argv[1:] if argv is None else argv)]
            return subprocess.call(cmd, env={**os.environ, "TRITON_INTERPRET": "1"})
    with warnings.catch_warnings():
        # The interpreter evaluates masked-off lanes too (-inf - -inf there) and numpy warns;
        # those lanes are never stored, so the warnings only alarm users (pyproject does the
        # same for the tests).
        warnings.filterwarnings(
            "ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter"
        )
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
