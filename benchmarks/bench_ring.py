"""Ring attention on two GPUs against one.

B=1, H=16, D=128, bf16, causal, forward + backward, total N in {64k, 128k, 256k}.
Efficiency = time on one GPU at N / (2 × time of the two-GPU ring at N) (1.0: perfect scaling).
Each timed point records its peak memory. ``--longest P`` finds the longest N whose forward +
backward trains on P GPUs (1: ``flashlite.attention``; 2: the ring): the peak bytes per local
token measured at 256k give the memory bound (memory is linear in N), the step time there the
time bound (time is quadratic: a step must fit in ``--budget-s``), and one step at the largest
multiple of 256k under both shows it trains (finite output and gradients; on one GPU the last
query rows also against an fp32 reference).

    python benchmarks/bench_ring.py            # starts two NCCL processes itself
    torchrun --nproc-per-node 2 benchmarks/bench_ring.py
    python benchmarks/bench_ring.py --smoke    # two gloo CPU processes, tiny sizes (the logic)
    python benchmarks/bench_ring.py --longest 1 --budget-s 540    # one GPU
    python benchmarks/bench_ring.py --longest 2 --budget-s 300    # the ring on two

Timing: fixed iteration counts on every rank in lockstep (``do_bench`` decides its own count,
which two ranks must not), wall time around synchronised runs, the slowest rank's median.
The peer, where it runs: torch's context parallelism (``context_parallel`` around SDPA's flash
backend) on two GPUs against SDPA flash on one, at the same points.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashlite
from flashlite.distributed import ring_attention
from flashlite.distributed.ring import DEFAULT_TIMEOUT, free_port, init_for_tests

H, D = 16, 128
#: The longest-N search's grain and probe length (its peak bytes per token and step time).
GRAIN = 1 << 18
#: The share of free memory the longest-N search plans to use.
MARGIN = 0.95


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


def _inputs(
    n_total: int, dev: torch.device, dtype: torch.dtype, ring: bool
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, do)`` of one step at total length ``n_total``, ``b n h d``: this rank's shard
    (``n_total / P`` tokens) for the ring, the whole sequence otherwise. The values do not matter
    for timing; the tests check them."""
    world = dist.get_world_size() if ring else 1
    shape = (1, n_total // world, H, D)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn_like(q)


def _fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             ring: bool) -> torch.Tensor:  # fmt: skip
    """One causal forward + backward (gradients into ``.grad``): the ring on this rank's shard,
    or plain flashlite.attention on the whole sequence. Returns the output."""
    for t in (q, k, v):
        t.grad = None
    if ring:
        out = ring_attention(q, k, v, causal=True, validate=False)
    else:
        out = flashlite.attention(q, k, v, causal=True, layout="b n h d")
    out.backward(do)
    return out


def _step(n_total: int, dev: torch.device, dtype: torch.dtype, ring: bool) -> Callable[[], Any]:
    """One forward + backward at total length ``n_total`` as a callable (:func:`_fwd_bwd` on
    :func:`_inputs`)."""
    tensors = _inputs(n_total, dev, dtype, ring)
    return lambda: _fwd_bwd(*tensors, ring)


def _sdpa_step(n_total: int, dev: torch.device, dtype: torch.dtype, cp: bool) -> Callable[[], Any]:
    """The peer: SDPA (flash backend) forward + backward on one GPU, or with ``cp`` inside
    torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``,
    its ring with causal load balancing) over all ranks."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = (torch.randn(1, H, n_total, D, device=dev, dtype=dtype) for _ in range(4))
    mesh = None
    if cp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (dist.get_world_size(),))

    def run() -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
            if cp:
                from torch.distributed.tensor.experimental import context_parallel

                # shards the four buffers in place for the block, restores them after
                stack.enter_context(context_parallel(mesh, buffers=[q, k, v, do],
                                                     buffer_seq_dims=[2, 2, 2, 2]))  # fmt: skip
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            # every call must see this rank's whole shard (the buffers restored after each)
            want = n_total // dist.get_world_size() if cp else n_total
            if leaves[0].shape[2] != want or do.shape[2] != want:
                raise RuntimeError(f"context_parallel shard of {leaves[0].shape[2]} tokens, "
                                   f"expected {want}")  # fmt: skip
            # looked up at the call: context_parallel patches F's function for the block
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)

    return run


def _peak_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(dev: torch.device) -> float:
    """Bytes allocated at the peak since :func:`_peak_reset` (0 on CPU)."""
    return float(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else 0.0


def _pair(
    rank: int,
    world: int,
    dev: torch.device,
    one: Callable[[], Callable[[], Any]],
    many: Callable[[], Callable[[], Any]],
    warmup: int,
    reps: int,
) -> tuple[float, float, float, float]:
    """Seconds on one GPU (rank 0 alone) and on all ranks together (the slowest rank), and the
    peak bytes of each (inputs, outputs, gradients and workspace; the ranks' largest)."""
    t1 = torch.zeros(2, device=dev, dtype=torch.float64)
    if rank == 0:
        _peak_reset(dev)
        t1[0] = _timed(one(), dev, warmup, reps)
        t1[1] = _peak(dev)
    _peak_reset(dev)
    dist.barrier()
    tp = torch.tensor([_timed(many(), dev, warmup, reps), _peak(dev)], device=dev,
                      dtype=torch.float64)  # fmt: skip
    dist.all_reduce(tp, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    dist.broadcast(t1, 0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return t1[0].item(), tp[0].item(), t1[1].item(), tp[1].item()


def run(rank: int, world: int, smoke: bool) -> list[dict[str, Any]]:
    dev = torch.device("cuda", rank) if not smoke else torch.device("cpu")
    dtype = torch.bfloat16 if not smoke else torch.float32
    sizes = [65536, 131072, 262144] if not smoke else [64, 128]
    warmup, reps = (1, 3) if not smoke else (1, 1)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        t1, tp, m1, mp = _pair(rank, world, dev, lambda: _step(n, dev, dtype, False),
                               lambda: _step(n, dev, dtype, True), warmup, reps)  # fmt: skip
        row = {"n": n, "one_gpu_ms": t1 * 1e3, "ring_ms": tp * 1e3,
               "efficiency": t1 / (world * tp), "one_gpu_peak_gib": m1 / 2**30,
               "ring_peak_gib_per_rank": mp / 2**30}  # fmt: skip
        if not smoke:  # torch's context parallelism at the same point, where it runs
            try:
                s1, sp, _, _ = _pair(rank, world, dev, lambda: _sdpa_step(n, dev, dtype, False),
                                     lambda: _sdpa_step(n, dev, dtype, True), warmup,
                                     reps)  # fmt: skip
                row.update({"sdpa_one_gpu_ms": s1 * 1e3, "torch_cp_ms": sp * 1e3,
                            "torch_cp_efficiency": s1 / (world * sp),
                            "ring_vs_torch_cp": sp / tp})  # fmt: skip
            except Exception as err:  # noqa: BLE001  (the peer is optional: say why it is absent)
                row["torch_cp_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    return rows


def _all_finite(t: torch.Tensor, chunk: int = 1 << 28) -> bool:
    """Whether every entry is finite, a chunk at a time (a whole-tensor mask would not fit
    beside a step at the memory limit)."""
    flat = t.reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk)
    )


def _last_rows_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> float:
    """Largest |o − reference| over the last two query rows of every head: the fp32 reference
    attention of those rows against all keys (causal, bottom-right: the rows see every key but
    the last, and all), one head at a time (the whole sequence in fp32 would not fit)."""
    n, worst = q.shape[1], 0.0
    for h in range(q.shape[2]):
        head = [t[:, :, h : h + 1].transpose(1, 2) for t in (q, k, v, o)]  # b h n d
        rows, keys, values = head[0][:, :, n - 2 :].float(), head[1].float(), head[2].float()
        want = flashlite.reference.attention(rows, keys, values, causal=True)
        got = head[3][:, :, n - 2 :].float()
        worst = max(worst, (got - want).abs().max().item())
    return worst


def _trains(n_total: int, dev: torch.device, ring: bool) -> dict[str, Any]:
    """One forward + backward at ``n_total`` (every rank agrees on the outcome): seconds, peak
    GiB, finiteness, and on one GPU the error of the last rows."""
    world = dist.get_world_size() if ring else 1
    _peak_reset(dev)
    row: dict[str, Any] = {"n": n_total, "gpus": world}
    ok = torch.ones(1, device=dev)
    try:
        q, k, v, do = _inputs(n_total, dev, torch.bfloat16, ring)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = _fwd_bwd(q, k, v, do, ring)
        torch.cuda.synchronize(dev)
        row["step_s"] = time.perf_counter() - t0
        row["peak_gib"] = _peak(dev) / 2**30
        del do
        row["finite"] = all(_all_finite(t) for t in (out, q.grad, k.grad, v.grad))
        good = row["finite"]
        if not ring:  # far offsets (past 2^31 elements at 1M) index the right rows
            row["last_rows_max_abs_err"] = err = _last_rows_error(q, k, v, out)
            good = good and err <= 2e-2  # bf16 output
        ok.fill_(float(good))
    except torch.cuda.OutOfMemoryError as err:
        row["oom"] = str(err).splitlines()[0][:160]
        ok.zero_()
    if ring:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    row["trains"] = bool(ok.item())
    return row


def longest(rank: int, world: int, budget_s: float) -> list[dict[str, Any]]:
    """The longest N (a multiple of ``GRAIN``) that trains on ``world`` GPUs within memory and
    within one step of ``budget_s`` seconds: probe at ``GRAIN``, predict both bounds, run there."""
    dev, ring = torch.device("cuda", rank), world > 1
    start = time.perf_counter()
    probe = _trains(GRAIN, dev, ring)  # compiles the kernels (and sets NCCL up)
    probe = _trains(GRAIN, dev, ring)
    _peak_reset(dev)
    free = torch.cuda.mem_get_info(dev)[0]  # what is left beside CUDA's and NCCL's own memory
    # every rank's figures: the smallest free memory, the largest peak and time set the bounds
    figs = torch.tensor([-free, probe["peak_gib"], probe["step_s"]], device=dev)
    if ring:
        dist.all_reduce(figs, op=dist.ReduceOp.MAX)
    free_b, per_token, t0 = (
        -figs[0].item(),
        figs[1].item() * 2**30 / (GRAIN // world),
        figs[2].item(),
    )
    # a rank that runs out of memory mid-ring leaves its peers waiting on it: keep 5% spare
    memory_n = int(MARGIN * free_b / per_token) * world // GRAIN * GRAIN
    left = budget_s - (time.perf_counter() - start)
    time_n = int(GRAIN * math.sqrt(max(left, 0.0) / t0)) // GRAIN * GRAIN
    n = min(memory_n, time_n)
    if rank == 0:
        print(f"free {free_b / 2**30:.1f} GiB, {per_token:.0f} B per local token: memory bound "
              f"{memory_n}, time bound {time_n}; trying {n}", flush=True)  # fmt: skip
    rows = [probe | {"probe": True}]
    if n >= GRAIN:
        rows.append(_trains(n, dev, ring))
    head = {"gpus": world, "free_gib": free_b / 2**30, "memory_margin": MARGIN,
            "peak_bytes_per_local_token": per_token, "probe_step_s": t0,
            "memory_bound_n": memory_n, "time_bound_n": time_n, "budget_s": budget_s,
            "bound": "memory" if memory_n <= time_n else "time",
            "longest_n_trained": max([r["n"] for r in rows if r["trains"]], default=0)}  # fmt: skip
    if rank == 0:
        for r in rows:
            print(r, flush=True)
        print(head, flush=True)
    return [head, *rows]


def _spawned(
    rank: int, world: int, port: int, smoke: bool, budget: float | None, queue: Any
) -> None:
    backend = "gloo" if smoke else "nccl"
    if not smoke:
        torch.cuda.set_device(rank)
    # with a timeout: a peer that fails (out of memory at the longest N) must not leave the
    # other waiting long
    init_for_tests(rank, world, port, backend)
    try:
        rows = run(rank, world, smoke) if budget is None else longest(rank, world, budget)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="two gloo CPU processes, tiny sizes")
    p.add_argument("--longest", type=int, choices=(1, 2), metavar="P",
                   help="find the longest N that trains on P GPUs (1: no ring)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="--longest: the seconds one step (and the probes) may take")  # fmt: skip
    args = p.parse_args(argv)
    need = 0 if args.smoke else (args.longest or 2)
    if torch.cuda.device_count() < need:
        print(f"bench_ring needs {need} CUDA GPU(s) (or --smoke)")
        return 2
    budget = args.budget_s if args.longest else None
    if args.longest == 1:
        rows = longest(0, 1, args.budget_s)
    elif "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not args.smoke:
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo" if args.smoke else "nccl", timeout=DEFAULT_TIMEOUT)
        rows = run(rank, world, args.smoke) if budget is None else longest(rank, world, budget)
        dist.destroy_process_group()
        if rank:
            return 0
    else:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_spawned, args=(2, free_port(), args.smoke, budget, queue), nprocs=2,
                           join=True, start_method="spawn")  # fmt: skip
        rows = queue.get()
    if args.longest:
        from _common import metadata, write_results

        write_results(f"ring-longest-nvidia-h200x{args.longest}", rows,
                      metadata(dtype="bfloat16"))  # fmt: skip
        return 0
    for r in rows:
        print(r)
    long = [r["efficiency"] for r in rows if r.get("n", 0) >= 131072]
    if long:
        print(f"must: efficiency >= 0.80 at N >= 128k: worst {min(long):.3f} "
              f"({'pass' if min(long) >= 0.80 else 'FAIL'})")  # fmt: skip
    if not args.smoke:
        from _common import metadata, write_results

        from flashlite.plotting import Bars, Figure, Panel

        timed = [r for r in rows if "n" in r]
        bars = [Bars([r["efficiency"] for r in timed], "flashlite ring")]
        if all("torch_cp_efficiency" in r for r in timed):
            bars.append(Bars([r["torch_cp_efficiency"] for r in timed], "torch context_parallel"))
        panel = Panel(bars=bars, categories=[f"N={r['n'] // 1024}k" for r in timed],
                      title="2 GPUs vs 1 (causal, fwd+bwd, bf16, B=1 H=16 D=128)",
                      ylabel="t1 / (2·t2)")  # fmt: skip
        write_results("ring-nvidia-h200x2", rows, metadata(dtype="bfloat16"),
                      figure=Figure([[panel]], title="ring attention scaling"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
