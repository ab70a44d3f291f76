"""Ring attention on two GPUs against one: issue 13's must 5.

B=1, H=16, D=128, bf16, causal, forward + backward, total N in {64k, 128k, 256k}.
Efficiency = time on one GPU at N / (2 × time of the two-GPU ring at N) (1.0: perfect scaling).
Also the longest N (doubling from 64k) whose forward + backward fits on one GPU and on two.

    python benchmarks/bench_ring.py            # starts two NCCL processes itself
    torchrun --nproc-per-node 2 benchmarks/bench_ring.py
    python benchmarks/bench_ring.py --smoke    # two gloo CPU processes, tiny sizes (the logic)

Timing: fixed iteration counts on every rank in lockstep (``do_bench`` decides its own count,
which two ranks must not), wall time around synchronised runs, the slowest rank's median.
torch's own context-parallel attention is not timed here yet. Written 2026-11-30; run only in
``--smoke`` mode so far (not yet on two GPUs).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashlite
from flashlite.distributed import ring_attention, shard_sequence

H, D = 16, 128


def _timed(fn: Callable[[], Any], dev: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (every rank runs the same count)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step(n_total: int, dev: torch.device, dtype: torch.dtype, ring: bool) -> Callable[[], Any]:
    """One forward + backward at total length ``n_total``: the ring on this rank's zigzag shard,
    or plain flashlite.attention on the whole sequence."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1, n_total, H, D, generator=gen, dtype=torch.float32)
    x = shard_sequence(full, 1) if ring else full
    q, k, v = (x.to(dev, dtype).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        if ring:
            out = ring_attention(q, k, v, causal=True, validate=False)
        else:
            out = flashlite.attention(q, k, v, causal=True, layout="b n h d")
        out.backward(do)

    return run


def _fits(n_total: int, dev: torch.device, dtype: torch.dtype, ring: bool) -> bool:
    """Whether one forward + backward at ``n_total`` runs (every rank agrees)."""
    ok = torch.ones(1, device=dev)
    try:
        _step(n_total, dev, dtype, ring)()
    except torch.cuda.OutOfMemoryError:
        ok.zero_()
    if ring:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return bool(ok.item())


def run(rank: int, world: int, smoke: bool) -> list[dict[str, Any]]:
    dev = torch.device("cuda", rank) if not smoke else torch.device("cpu")
    dtype = torch.bfloat16 if not smoke else torch.float32
    sizes = [65536, 131072, 262144] if not smoke else [64, 128]
    warmup, reps = (2, 5) if not smoke else (1, 1)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        one = torch.zeros(1, device=dev)
        if rank == 0:  # one GPU, the whole sequence
            one += _timed(_step(n, dev, dtype, False), dev, warmup, reps)
        dist.barrier()
        ring = torch.tensor([_timed(_step(n, dev, dtype, True), dev, warmup, reps)], device=dev)
        dist.all_reduce(ring, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        dist.broadcast(one, 0)
        rows.append({"n": n, "one_gpu_ms": one.item() * 1e3, "ring_ms": ring.item() * 1e3,
                     "efficiency": one.item() / (world * ring.item())})  # fmt: skip
    if not smoke:
        for ring_mode in (False, True):
            n, longest = 65536, 0
            while n <= 1 << 20:
                fits = _fits(n, dev, dtype, ring_mode) if (ring_mode or rank == 0) else True
                if not ring_mode:
                    flag = torch.tensor([float(fits)], device=dev)
                    dist.broadcast(flag, 0)
                    fits = bool(flag.item())
                if not fits:
                    break
                longest, n = n, 2 * n
            rows.append({"longest_n": longest, "gpus": world if ring_mode else 1,
                         "tested_up_to": 1 << 20})  # fmt: skip
    return rows


def _spawned(rank: int, world: int, port: int, smoke: bool, queue: Any) -> None:
    backend = "gloo" if smoke else "nccl"
    if not smoke:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        rows = run(rank, world, smoke)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="two gloo CPU processes, tiny sizes")
    args = p.parse_args(argv)
    if not args.smoke and torch.cuda.device_count() < 2:
        print("bench_ring needs two CUDA GPUs (or --smoke)")
        return 2
    if "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not args.smoke:
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo" if args.smoke else "nccl")
        rows = run(rank, world, args.smoke)
        dist.destroy_process_group()
        if rank:
            return 0
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_spawned, args=(2, port, args.smoke, queue), nprocs=2, join=True,
                           start_method="spawn")  # fmt: skip
        rows = queue.get()
    for r in rows:
        print(r)
    if not args.smoke:
        from _common import metadata, write_results

        from flashlite.plotting import Bars, Figure, Panel

        timed = [r for r in rows if "n" in r]
        panel = Panel(bars=[Bars([r["efficiency"] for r in timed], "efficiency")],
                      categories=[f"N={r['n'] // 1024}k" for r in timed],
                      title="ring attention, 2 GPUs vs 1 (causal, fwd+bwd, bf16)",
                      ylabel="t1 / (2·t2)")  # fmt: skip
        write_results("ring-nvidia-h200x2", rows, metadata(dtype="bfloat16"),
                      figure=Figure([[panel]], title="ring attention scaling"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
