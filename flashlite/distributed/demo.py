"""Ring attention on CPU across gloo processes: the error against single-process attention and
the bytes each rank sent, forward and backward.

    flashlite ring --nproc 2 --seq 512            # starts the processes itself
    torchrun --nproc-per-node 2 -m flashlite.distributed.demo --seq 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse type of an int in ``[lo, hi]`` (no upper bound for None): anything else is a
    usage error naming the option and the accepted range, before any work starts (the
    ``flashlite`` command's numeric options use it too)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < lo or (hi is not None and n > hi):
            accepted = f">= {lo}" if hi is None else f"from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"must be an integer {accepted}, got {n}")
        return n

    return parse


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (shared with ``flashlite ring``)."""
    count = int_in(1)
    p.add_argument(
        "--nproc", type=count, default=2, help="processes (ranks) to start (default: %(default)s)"
    )
    p.add_argument(
        "--seq", type=count, default=512, help="total sequence length N (default: %(default)s)"
    )
    p.add_argument("--heads", type=count, default=4, help="query heads (default: %(default)s)")
    p.add_argument(
        "--kv-heads", type=count, default=2, help="key/value heads, GQA (default: %(default)s)"
    )
    p.add_argument(
        "--head-dim",
        type=int_in(1, 256),
        default=32,
        help="head dimension D, 1 to 256 (default: %(default)s)",
    )
    p.add_argument(
        "--no-causal", dest="causal", action="store_false", help="full attention (default: causal)"
    )
    p.add_argument(
        "--contiguous", action="store_true", help="contiguous shards, not zigzag (default: zigzag)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument(
        "--json", action="store_true", help="print the per-rank results as JSON (default: a table)"
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines on stderr (default: shown unless --json)",
    )
    return p


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """``step(what)``: a line ``[  12.3 s] what`` on stderr, unless ``--quiet`` or ``--json``
    (the interpreter makes this demo take minutes on a CPU: each stage says when it starts)."""
    start = time.perf_counter()
    quiet = getattr(args, "quiet", False) or getattr(args, "json", False)

    def step(what: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    return step


def build_parser() -> argparse.ArgumentParser:
    return add_options(
        argparse.ArgumentParser(prog="flashlite ring", description=__doc__.splitlines()[0])
    )


def run_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's run in an initialised gloo group: its shard of a seeded sequence through
    ring attention (forward and backward), compared with single-process attention."""
    import flashlite
    from flashlite.distributed import ring_attention, shard_sequence
    from flashlite.distributed.ring import comm_model, count_p2p

    zigzag = not args.contiguous
    step = progress(args) if rank == 0 else (lambda what: None)
    gen = torch.Generator().manual_seed(args.seed)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    q, k, v, do = (torch.randn(1, args.seq, h, args.head_dim, generator=gen) for h in heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    step(f"rank 0: the single-process reference, N={args.seq} (forward + backward)")
    ref = flashlite.attention(*leaves, causal=args.causal, layout="b n h d")
    ref.backward(do)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 1, zigzag=zigzag)

    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    with count_p2p() as log:
        step(f"rank 0: ring attention forward over {world} ranks")
        out = ring_attention(*mine, causal=args.causal, zigzag=zigzag)
        n_forward = len(log)
        step("rank 0: ring attention backward")
        out.backward(shard(do))
    step("rank 0: done; waiting for the other ranks")
    sent = [sum(b for b, _ in log[:n_forward]), sum(b for b, _ in log[n_forward:])]
    pairs = zip([out, *(t.grad for t in mine)], [ref, *(t.grad for t in leaves)], strict=True)
    errors = {
        name: (a - shard(b)).abs().max().item()
        for name, (a, b) in zip(("out", "dq", "dk", "dv"), pairs, strict=True)
    }
    sizes = (world, 1, args.kv_heads, args.seq // world, args.head_dim, 4)
    model = [sum(int(m["bytes"]) for m in comm_model(*sizes, bwd)) for bwd in (False, True)]
    return {
        "rank": rank,
        "world": world,
        "max_error": errors,
        "bytes_sent_forward": sent[0],
        "bytes_sent_backward": sent[1],
        "model_forward": model[0],
        "model_backward": model[1],
    }


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import torch.distributed as dist

    from flashlite.distributed.ring import init_for_tests

    init_for_tests(rank, world, port)
    try:
        queue.put(run_rank(rank, world, args))
    finally:
        dist.destroy_process_group()


def _print(results: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=1))
        return
    print("rank  max |err| out / dq / dk / dv              sent fwd (model)      sent bwd (model)")
    for r in results:
        e = r["max_error"]
        errs = " / ".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv"))
        print(
            f"{r['rank']:>4}  {errs:34} {r['bytes_sent_forward']:>9} ({r['model_forward']:>9})"
            f"  {r['bytes_sent_backward']:>9} ({r['model_backward']:>9})"
        )


def check_args(args: argparse.Namespace) -> None:
    """Options that do not go together, checked before any process starts.

    Raises:
        ValueError: ``--kv-heads`` does not divide ``--heads``, or ``--seq`` does not split
            into the shards the ranks hold (two per rank when zigzag, one when contiguous);
            the message names the options.
    """
    if args.heads % args.kv_heads:
        raise ValueError(
            f"--kv-heads={args.kv_heads} must divide --heads={args.heads} (grouped-query heads)"
        )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ranks = int(os.environ["WORLD_SIZE"])  # torchrun decides the ranks, not --nproc
    else:
        ranks = args.nproc
    parts = ranks if args.contiguous else 2 * ranks
    if args.seq % parts:
        each = "one shard" if args.contiguous else "two zigzag shards"
        raise ValueError(
            f"--seq={args.seq} must be a multiple of {parts}: {ranks} ranks hold {each} each"
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        parser.error(str(err))  # usage, "flashlite ring: error: ...", exit status 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` gloo processes (or, under torchrun, be one rank) and print
    (``args`` as :func:`check_args` accepts them)."""
    check_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        import torch.distributed as dist

        from flashlite.distributed.ring import DEFAULT_TIMEOUT

        dist.init_process_group("gloo", timeout=DEFAULT_TIMEOUT)
        try:
            result = run_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        _print([result], args.json)
        return 0
    from flashlite.distributed.ring import free_port

    progress(args)(
        f"starting {args.nproc} gloo processes (the kernels run in Triton's interpreter "
        "on a CPU: about 4 min at the defaults on 2 cores)"
    )
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _spawned,
        args=(args.nproc, free_port(), args, queue),
        nprocs=args.nproc,
        join=True,
        start_method="spawn",
    )
    results = sorted((queue.get() for _ in range(args.nproc)), key=lambda r: r["rank"])
    _print(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
