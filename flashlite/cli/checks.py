"""The `flashlite` command's usage checks beyond what argparse sees one option at a time: options
that do not go together, sizes that do not fit each other, and what `traffic --measure` needs.

Each raises :class:`UsageError`; :func:`flashlite.cli.main` reports it through the sub-command's
own parser (its usage line, then ``flashlite <command>: error: ...``, exit status 2), before any
slow work starts."""

from __future__ import annotations

import argparse

import torch

from flashlite.cli.commands import ATTENTION_DTYPES, UsageError

#: the `traffic` options that each choose another table than the attention forward's
TABLES = ("--softmax", "--ce", "--shared-prefix", "--mla", "--mask", "--decode", "--backward")


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``flag`` was given (the options of :data:`TABLES` default to off or None)."""
    value = getattr(args, flag.removeprefix("--").replace("-", "_"))
    return value is not None and value is not False


def check_usage(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for a command line its sub-command cannot run."""
    heads, kv_heads = getattr(args, "heads", None), getattr(args, "kv_heads", None)
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise UsageError(f"--kv-heads={kv_heads} must divide --heads={heads} (grouped-query heads)")
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None and head_dim > 256 and getattr(args, "mla", None) is None:
        raise UsageError(
            f"argument --head-dim: must be an integer from 1 to 256, got {head_dim} (wider: "
            "a latent row, with traffic --mla)"
        )
    if args.command == "traffic":
        _check_traffic(args)
    if args.command == "attention" and args.dtype == "float8_e4m3fn":
        raise UsageError(
            "--dtype float8_e4m3fn: the attention check runs 16/32-bit inputs (FP8 is traffic's "
            "forward and --decode tables)"
        )
    if args.command == "ring":
        from flashlite.distributed import demo as ring_demo

        try:
            ring_demo.check_args(args)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if getattr(args, "config", None):  # a bad --config fails now, before any slow work
        from flashlite.traffic import parse_config

        head_dim = getattr(args, "head_dim", 16)  # demo: D = 16
        try:
            parse_config(args.config, head_dim, ATTENTION_DTYPES[getattr(args, "dtype", "float32")])
        except ValueError as err:
            raise UsageError(f"argument --config: {err}") from None


def _check_traffic(args: argparse.Namespace) -> None:
    tables = [flag for flag in TABLES if _given(args, flag)]
    if len(tables) > 1:
        raise UsageError(f"{' and '.join(tables)} show different tables: give one of them")
    table = tables[0] if tables else None
    if args.dtype == "float8_e4m3fn" and table not in (None, "--decode"):
        raise UsageError(
            f"--dtype float8_e4m3fn: the attention forward's table and --decode model FP8, "
            f"not {table}"
        )
    if table is not None:
        # these options only shape the attention forward's table
        forward_only = {"--methods": args.methods, "--plot": args.plot, "--config": args.config}
        for flag, value in forward_only.items():
            if value is not None:
                raise UsageError(f"{flag} applies to the attention forward's table, not {table}")
    if args.ce_weight and table != "--ce":
        raise UsageError("--ce-weight needs --ce (class weights of the cross-entropy table)")
    if args.shared_prefix is not None and args.decode_q > 1:
        raise UsageError(
            f"--decode-q={args.decode_q} with --shared-prefix: the model covers one query per "
            "request (more causal queries may sit before the prefix's end, where "
            "attention_shared_prefix takes a torch path the model leaves out)"
        )
    if args.mla is not None and args.mla >= args.head_dim:
        raise UsageError(
            f"--mla={args.mla} value columns need a wider latent row: --head-dim={args.head_dim} "
            "(DeepSeek: --head-dim 576 --mla 512)"
        )
    if args.measure:
        _check_measure(table)


def _check_measure(table: str | None) -> None:
    """`traffic --measure` needs a table that ncu measures, a CUDA GPU and ncu itself."""
    if table in ("--ce", "--shared-prefix", "--mla"):
        raise UsageError(f"--measure does not cover {table}: drop --measure (model and --count)")
    if not torch.cuda.is_available():
        raise UsageError(
            f"--measure needs a CUDA GPU, and this torch ({torch.__version__}) sees none: drop "
            "--measure, or use --count to count the bytes in Triton's interpreter on the CPU"
        )
    from flashlite.traffic import find_ncu

    if find_ncu() is None:
        raise UsageError(
            "--measure needs Nsight Compute's ncu, found neither at $NCU, at "
            "/usr/local/cuda/bin/ncu nor on PATH: install it, or set NCU=/path/to/ncu"
        )
