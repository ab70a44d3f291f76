"""flashlite.distributed (issue 13): ring attention across gloo processes on CPU.

Each test starts 2 or 3 processes with ``torch.multiprocessing`` (gloo on a free loopback port,
with a timeout so that a dead peer cannot hang the rest). Every rank builds the same full
sequence from one seed, runs single-process ``flashlite.attention`` on it as the reference, and
checks its own output shard and its dq/dk/dv shards against the reference's, plus
``gather(shard(x)) == x`` and the bytes its point-to-point calls sent against the closed-form
model.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from conftest import TOL

import flashlite
from flashlite.distributed import gather_sequence, ring_attention, shard_sequence
from flashlite.distributed.ring import comm_model, count_p2p, free_port, init_for_tests

# (causal, zigzag, layout, dtype, Hq, Hkv[, sinks])
CASES = [
    (True, True, "b n h d", torch.float32, 4, 2),  # causal zigzag, GQA
    (True, True, "b n h d", torch.float32, 4, 2, True),  # with sinks: merged once
    (False, True, "b h n d", torch.float32, 2, 2),  # not causal, the other layout
    (True, False, "b n h d", torch.float32, 2, 1),  # causal on contiguous shards, MQA
    (True, True, "b n h d", torch.bfloat16, 2, 2),
]
N, D = 48, 16


def _case(rank: int, world: int, case: tuple) -> None:

    causal, zigzag, layout, dtype, hq, hkv, *with_sinks = case
    seq_dim = 1 if layout == "b n h d" else 2
    gen = torch.Generator().manual_seed(hq * 10 + hkv)

    def shape(h: int) -> tuple[int, ...]:
        return (1, N, h, D) if layout == "b n h d" else (1, h, N, D)

    q, k, v, do = (torch.randn(shape(h), generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    ref_sinks = sinks.clone().requires_grad_() if with_sinks else None
    ref, ref_lse = flashlite.attention(*leaves, causal=causal, layout=layout, return_lse=True,
                                       sinks=ref_sinks)  # fmt: skip
    ref.backward(do)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, seq_dim, zigzag=zigzag)

    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_() if with_sinks else None
    with count_p2p() as log:
        out, lse = ring_attention(*mine, causal=causal, layout=layout, zigzag=zigzag,
                                  return_lse=True, sinks=my_sinks)  # fmt: skip
        n_forward = len(log)
        out.backward(shard(do))
    if with_sinks:  # each rank holds its rows' share of the sinks' gradient: summed, the whole
        import torch.distributed as dist

        total = my_sinks.grad.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_sinks.grad, atol=1e-5, rtol=1e-5)
    tol = TOL[dtype]
    got = [out, *(t.grad for t in mine)]
    want = [ref, *(t.grad for t in leaves)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        scale = max(1.0, b.abs().max().item())
        err = (a.double() - shard(b).double()).abs().max().item()
        assert err <= 4 * tol.floor * scale, (rank, case, name, err)
    want_lse = shard_sequence(ref_lse, 2, zigzag=zigzag)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=0)
    assert torch.equal(gather_sequence(shard(q), seq_dim, zigzag=zigzag), q)
    n_local = N // world
    model = [m["bytes"] for m in comm_model(world, 1, hkv, n_local, D, q.element_size())]
    model += [m["bytes"] for m in comm_model(world, 1, hkv, n_local, D, q.element_size(), True)]
    assert [s for s, _ in log] == model, (rank, log, model)  # counted equals the model
    assert [r for _, r in log] == model and n_forward == world - 1


def _bad_inputs(rank: int, world: int) -> None:
    x = torch.randn(1, 8 + 2 * rank, 2, 16)  # a different length on every rank
    with pytest.raises(ValueError, match=r"ranks hold \[8, 10"):
        ring_attention(x, x, x)
    odd = torch.randn(1, 3, 2, 16)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(odd, odd, odd, causal=True)
    with pytest.raises(ValueError, match="divide by 2P"):
        shard_sequence(torch.randn(1, 2 * world + 1, 2, 16), 1)


def _compiled_and_opcheck() -> None:
    """``torch.compile(fullgraph=True)`` traces ring attention (the ring runs inside the custom
    ops, opaque to the tracer) with eager's results; both ops pass ``opcheck``."""
    from torch.library import opcheck

    from flashlite.distributed.ring import _group_name

    gen = torch.Generator().manual_seed(1)
    mine = [shard_sequence(torch.randn(1, 32, 2, 16, generator=gen), 1) for _ in range(3)]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, causal=True)

    runs = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in mine]
        out = f(*leaves)
        out.sum().backward()
        runs.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    q, k, v = (t.transpose(1, 2) for t in mine)
    fields = {"group_name": _group_name(None), "scale": 0.25, "causal": True, "zigzag": True}
    opcheck(torch.ops.flashlite.ring_attention_fwd.default, (q, k, v), fields)
    o, lse = torch.ops.flashlite.ring_attention_fwd.default(q, k, v, **fields)
    grads = (torch.randn_like(o), q, k, v, o, lse, None)
    opcheck(torch.ops.flashlite.ring_attention_bwd.default, grads, fields)


def _worker(rank: int, world: int, port: int, cases: list) -> None:
    import torch.distributed as dist

    init_for_tests(rank, world, port)
    try:
        for case in cases:
            _case(rank, world, case)
        _bad_inputs(rank, world)
        if world == 2:
            _compiled_and_opcheck()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3])  # an odd ring: every rank both sends and waits
def test_ring_attention_equals_single_process(world: int) -> None:
    """Output, LSE and dq/dk/dv shards equal single-process attention's, causal (zigzag and
    contiguous shards) and not, GQA/MQA, both layouts, fp32 and bf16; bytes counted = model;
    bad input raises on every rank; with two ranks, torch.compile and opcheck too."""
    mp.spawn(_worker, args=(world, free_port(), CASES), nprocs=world, join=True)


def test_ring_attention_needs_a_process_group() -> None:
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)


def test_ring_command_reports_errors_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """``flashlite ring --nproc 2 --seq 32 --json``: every rank's error against single-process
    attention is at fp32 rounding, and the bytes it sent equal the model's."""
    import json

    from flashlite.cli import main

    assert main(["ring", "--nproc", "2", "--seq", "32", "--head-dim", "16", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert max(r["max_error"].values()) < 1e-5, r
        assert r["bytes_sent_forward"] == r["model_forward"] > 0
        assert r["bytes_sent_backward"] == r["model_backward"] > 0


def test_ring_progress_lines_go_to_stderr_unless_json_or_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flashlite.distributed import demo

    for argv, shown in (([], True), (["--json"], False), (["--quiet"], False)):
        demo.progress(demo.build_parser().parse_args(argv))("a stage")
        out, err = capsys.readouterr()
        assert out == ""
        assert ("s] a stage" in err) is shown, (argv, err)


def test_comm_model_totals() -> None:
    fwd = comm_model(4, 1, 8, 1024, 128, 2)
    bwd = comm_model(4, 1, 8, 1024, 128, 2, backward=True)
    kv = 2 * 8 * 1024 * 128 * 2
    assert sum(m["bytes"] for m in fwd) == 3 * kv
    assert sum(m["bytes"] for m in bwd) == 3 * kv + 4 * 2 * kv


@pytest.mark.gpu
def test_ring_attention_nccl_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    mp.spawn(_nccl_worker, args=(2, free_port()), nprocs=2, join=True)


def _nccl_worker(rank: int, world: int, port: int) -> None:
    """Causal zigzag MHA and non-causal GQA, bf16, N = 4096 over two GPUs: shards of the output
    and of dq/dk/dv against single-GPU attention; bytes counted = the model."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    init_for_tests(rank, world, port, "nccl")
    try:
        for causal, kv_heads in ((True, 8), (False, 2)):
            gen = torch.Generator().manual_seed(0)
            q, do = (torch.randn(1, 4096, 8, 128, generator=gen).to("cuda", torch.bfloat16)
                     for _ in range(2))  # fmt: skip
            k, v = (torch.randn(1, 4096, kv_heads, 128, generator=gen).to("cuda", torch.bfloat16)
                    for _ in range(2))  # fmt: skip
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = flashlite.attention(*leaves, causal=causal, layout="b n h d")
            ref.backward(do)
            mine = [shard_sequence(t, 1, zigzag=causal).requires_grad_() for t in (q, k, v)]
            with count_p2p() as log:
                out = ring_attention(*mine, causal=causal, zigzag=causal)
                out.backward(shard_sequence(do, 1, zigzag=causal))
            model = comm_model(world, 1, kv_heads, 4096 // world, 128, 2)
            model += comm_model(world, 1, kv_heads, 4096 // world, 128, 2, backward=True)
            assert [sent for sent, _ in log] == [m["bytes"] for m in model], log
            for a, b in zip([out, *(t.grad for t in mine)], [ref, *(t.grad for t in leaves)],
                            strict=True):  # fmt: skip
                want = shard_sequence(b, 1, zigzag=causal).float()
                err = (a.float() - want).abs().max().item()
                assert err <= 2e-2 * max(1.0, want.abs().max().item()), (causal, err)
    finally:
        dist.destroy_process_group()
