"""The argument tree of the `flashlite` command: shared options and sub-commands (their help
texts are :mod:`flashlite.cli.texts`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flashlite.cli import texts
from flashlite.cli.commands import (
    ATTENTION_DTYPES,
    DEMO_PLOT,
    DTYPES,
    cmd_attention,
    cmd_bench,
    cmd_demo,
    cmd_ring,
    cmd_softmax,
    cmd_traffic,
)
from flashlite.distributed import demo as ring_demo

# keeps the line breaks of descriptions and examples; option help is wrapped as usual
_Formatter = argparse.RawDescriptionHelpFormatter


def _option(parser: argparse.ArgumentParser, *flags: str, help: str, **kwargs: Any) -> None:
    """`parser.add_argument` whose help always ends with the default (unless it states one)."""
    if "default" not in help:
        on_off = kwargs.get("action") == "store_true"
        help += " (default: off)" if on_off else " (default: %(default)s)"
    parser.add_argument(*flags, help=help, **kwargs)


def _positive_float(value: str) -> float:
    """argparse type of a finite number > 0."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return x


def device_arg(value: str) -> str:
    """argparse type of ``--device``: cpu, cuda or cuda:N, a CUDA one only where this torch has
    CUDA (one usage error instead of torch's assertion deep in the run)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        msg = f"{value!r} is not a device: cpu, cuda or cuda:N"
        raise argparse.ArgumentTypeError(msg) from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{value!r}: flashlite runs on cpu and cuda devices")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{value!r}: this torch ({torch.__version__}) has no CUDA device; use --device "
                "cpu (Triton's interpreter) or a CUDA build of torch on a GPU machine"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{value!r}: there are {torch.cuda.device_count()} CUDA devices"
            )
    return value


#: the head dims flashlite's attention takes
_HEAD_DIM = ring_demo.int_in(1, 1024)  # (above 256: --mla's latent rows only)
_COUNT = ring_demo.int_in(1)


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
        type=_positive_float,
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
            'plots need matplotlib: pip install matplotlib (or pip install "flashlite-attn[bench]")'
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
    _option(sp, "--batch", type=_COUNT, default=1, help="batch size B")
    _option(sp, "--heads", type=_COUNT, default=2, help="query heads H")
    _option(
        sp,
        "--kv-heads",
        type=_COUNT,
        default=None,
        help="key/value heads (fewer than --heads for GQA; default: --heads)",
    )
    if many:
        _option(
            sp,
            "--seq",
            type=_COUNT,
            nargs="+",
            default=[64, 128],
            metavar="N",
            help="sequence lengths, one row each (queries and keys; default: 64 128)",
        )
    else:
        _option(sp, "--seq", type=_COUNT, default=64, help="query length")
        _option(sp, "--seq-k", type=_COUNT, default=None, help="key length (default: --seq)")
    _option(sp, "--head-dim", type=_HEAD_DIM, default=16, help="head dimension D, 1 to 256")
    _option(
        sp,
        "--dtype",
        choices=list(ATTENTION_DTYPES),
        default="float32",
        help="Q, K, V dtype (float8_e4m3fn: traffic's forward and --decode tables; in decoding an "
        "e4m3 cache read by bf16 queries)",
    )
    _option(
        sp,
        "--causal",
        action="store_true",
        help="causal mask, aligned bottom-right when there are more keys than queries",
    )
    _option(sp, "--device", type=device_arg, default="cpu", help=device_help)
    _option(sp, "--json", action="store_true", help="print the results as JSON on stdout")


def _command(
    sub: Any, name: str, summary: str, description: str, examples: str | None = None
) -> Any:
    """A sub-command of ``sub`` (the parser's subparsers) with its help texts."""
    return sub.add_parser(
        name, help=summary, description=description, epilog=examples, formatter_class=_Formatter
    )


def _add_demo(sub: Any) -> None:
    summary = "quick CPU tour: accuracy checks, traffic table, plot"
    d = _command(sub, "demo", summary, texts.DEMO, texts.DEMO_EXAMPLES)
    _option(
        d,
        "--out",
        "--plot",
        dest="out",
        type=_plot_path,
        default=None,
        metavar="PATH",
        help="where to write the plot (.png, .svg, .pdf, ...); relative paths are taken from "
        "the current folder and the absolute path is printed (default: "
        f"{DEMO_PLOT}, or no plot where matplotlib is not installed)",
    )
    _tile_options(d)
    d.set_defaults(func=cmd_demo)


def _add_softmax(sub: Any) -> None:
    summary = "flashlite.softmax on a random (rows, n) tensor"
    s = _command(sub, "softmax", summary, texts.SOFTMAX, texts.SOFTMAX_EXAMPLES)
    _option(s, "--rows", type=_COUNT, default=8, help="number of rows")
    _option(s, "--n", type=_COUNT, default=1000, help="row length, the softmax dimension")
    _option(s, "--dtype", choices=list(DTYPES), default="float32", help="input dtype")
    _option(
        s,
        "--algorithm",
        choices=["auto", "three_pass", "online"],
        default="auto",
        help="auto: the fastest correct kernel; online: one tiled pass for the row statistics, "
        "then the write; three_pass: max, sum, write",
    )
    _option(s, "--log", action="store_true", help="run log_softmax instead of softmax")
    _option(s, "--device", type=device_arg, default="cpu", help=_DEVICE_HELP)
    _option(s, "--json", action="store_true", help="print the result as JSON on stdout")
    s.set_defaults(func=cmd_softmax)


def _add_traffic(sub: Any) -> None:
    summary = "HBM bytes: model, counted (CPU), measured (ncu, GPU)"
    t = _command(sub, "traffic", summary, texts.TRAFFIC, texts.TRAFFIC_EXAMPLES)
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
    _traffic_tables(t)
    _option(t, "--rows", type=_COUNT, default=4096, help="softmax rows (with --softmax)")
    _option(t, "--n", type=_COUNT, default=4096, help="softmax row length (with --softmax)")
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
    t.set_defaults(func=cmd_traffic)


def _traffic_tables(t: argparse.ArgumentParser) -> None:
    """The `traffic` options that show another table than the attention forward's."""
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
    _option(
        t,
        "--decode-q",
        type=_COUNT,
        default=1,
        help="queries per sequence, with --decode (--shared-prefix models one)",
    )
    _option(
        t,
        "--shared-prefix",
        type=_COUNT,
        default=None,
        metavar="NP",
        help="show shared-prefix decoding's bytes: --batch requests share a prefix of NP keys, "
        "each with a full cache of --seq keys of its own; one attention_shared_prefix step "
        "against attention_kvcache over per-request copies of the prefix, with the prefix's "
        "bytes (model; --count counts both, with the interpreter's tiles) (default: off)",
    )
    _option(
        t,
        "--mla",
        type=_COUNT,
        default=None,
        metavar="DV",
        help="show absorbed multi-head latent attention's bytes: --decode-q new queries of --heads "
        "heads against one latent cache of --seq tokens, rows --head-dim wide (576 for "
        "DeepSeek) whose first DV columns are the values (512); one attention_mla_decode step "
        "(model; --count counts it) beside what per-head K and V caches (192 + 128 wide) would "
        "read (default: off)",
    )
    _option(
        t,
        "--mask",
        choices=["causal", "sliding_window", "prefix_lm", "document", "document_causal"],
        default=None,
        help="show block-sparse attention's bytes: flex_attention with this gallery mask "
        "(window N/8, prefix N/4, --docs random documents per sequence; 128x128 tables) against "
        "the same kernel over every tile and the naive reference; for the document masks also "
        "the documents packed as attention_varlen sequences (model; --count counts the flex "
        "and varlen rows, --measure measures them with ncu) (default: off)",
    )
    _option(t, "--docs", type=_COUNT, default=8, help="documents per sequence (with --mask)")
    _option(
        t,
        "--ce",
        action="store_true",
        help="show fused cross-entropy's bytes, forward + backward, on (--rows, --n) logits "
        "(model; --count counts it) against torch's cross_entropy (counted)",
    )
    _option(t, "--ce-weight", action="store_true", help="with --ce: class weights")


class CommandParser(argparse.ArgumentParser):
    """The `flashlite` parser: ``commands[name]`` is a sub-command's own parser, whose
    ``error`` prints that sub-command's usage and ``flashlite <name>: error: ...``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}


def build_parser() -> CommandParser:
    """The argparse tree of the `flashlite` command."""
    p = CommandParser(
        prog="flashlite",
        description=texts.DESCRIPTION,
        epilog=texts.EXAMPLES,
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--version", action=_Version, help="print the flashlite, torch and triton versions and exit"
    )
    # not required: a bare `flashlite` prints the help (flashlite.cli.main)
    sub = p.add_subparsers(dest="command", title="commands", parser_class=argparse.ArgumentParser)
    _add_demo(sub)
    _add_softmax(sub)
    summary = "flashlite.attention vs the fp64 reference"
    a = _command(sub, "attention", summary, texts.ATTENTION, texts.ATTENTION_EXAMPLES)
    _shape_options(a, many=False, device_help=_DEVICE_HELP)
    a.set_defaults(func=cmd_attention)
    _add_traffic(sub)
    b = _command(sub, "bench", "how to run the benchmark scripts", texts.BENCH)
    b.set_defaults(func=cmd_bench)
    r = _command(
        sub,
        "ring",
        "ring attention across gloo processes on CPU: error and bytes per rank",
        ring_demo.__doc__ or "",
    )
    ring_demo.add_options(r)
    r.set_defaults(func=cmd_ring)
    p.commands.update(sub.choices)  # (the sub-commands' parsers by name)
    return p
