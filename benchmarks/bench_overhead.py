"""Per-call cost at small shapes: flashlite against torch, SDPA (flash, cuDNN) and cuDNN (GPU).

At these shapes the kernels run for a few µs to a few tens of µs, so the time per call is mostly
host work (argument checks, plans, launches) and launch latency. Cases (bf16 unless noted):

    attention        B=1 H=8 N=128 D=64, non-causal and causal; forward, no grad
    attention grad   forward + backward (torch.autograd.grad of q, k, v), causal, at B=1 H=8
                     N=128 D=64 and B=16 H=6 N=512 D=64 (examples/train_gpt.py's shape)
    decode           B=8 Hq=32 Hkv=8 Nq=1 Nk=512 D=128 (GQA; SDPA gets enable_gqa=True)
    decode append    attention_kvcache with k_new/v_new (a generate loop's step), Hq 32 / Hkv 8,
                     D 128, at B=1 Nk=4k and 128k and B=8 Nk=8k, default and validate=False,
                     against the cuDNN kernel over the same keys
    softmax          4 x 1024, fp32 and bf16, forward
    softmax grad     softmax and log_softmax forward + backward at 4 x 1024, 2048 x 1024 and
                     32 x 65536 (2^21 elements), fp32 and bf16; beside flashlite, ``floor``:
                     the same kernels through a bare ``autograd.Function`` (no checks, plans
                     made beforehand), the least any Python autograd node costs here
    window           attention(window=(1024, 0)) at B=1 H=8 N=4k D=128, forward and forward +
                     backward, against the same call on the Triton window kernels
                     (FLASHLITE_HOPPER_KERNEL=0): what folding the window into the flex
                     kernels costs on the host path
    flex             flex_attention with a document-causal mask (4 documents) at B=1 H=8 N=1k
                     D=64, forward and forward + backward, against torch.compile'd
                     flex_attention over torch's block mask of the same mod
    cross-entropy    forward + backward at 512 x 32k and 8192 x 32k; linear cross-entropy at
                     512 x 1024 x 32k, against torch's (logits materialised)

Four numbers per provider and case, all in µs per call:

    do_bench  ``triton.testing.do_bench`` median (warmup=25 ms, rep=200 ms): the time per call
    loop      wall clock of 1000 back-to-back calls and one synchronize (median of 7 rounds,
              after 50 warm-up calls): what a host-bound caller pays
    graph     replay of a CUDA graph that captured 20 calls (do_bench median / 20)
    compile   ``torch.compile(mode="reduce-overhead", fullgraph=True)``, do_bench median

Every metric is the median of interleaved rounds (every round in the JSON): each round times
every provider of every case once, so a host whose speed drifts during the run (seen: up to 1.6x
between runs on the H200's host) moves a case's providers alike and their ratio holds.
SDPA's backend is pinned once around each of its timings (``sdpa_kernel``), not on every call.
do_bench flushes L2 before each call, and host work that fits under the flush is not seen: loop
is the number that shows host cost, and the bar is on it: flashlite's loop time <= 1.5x the
baseline's (aim 1.1x); a decode step that appends <= the cuDNN kernel's do_bench time + 25 µs.

Every flashlite output (eager, graph replay, compiled) is checked first: forward outputs against
the fp64 reference, gradients within twice torch's own low-precision error of the fp64 gradient
(plus a floor); a wrong or NaN result is printed at once, kept out of the timings and makes the
exit status 1. A provider or metric that cannot run here (cuDNN unavailable, a backward that
torch.compile cannot hold in one graph) is noted and skipped. Writes
``benchmarks/results/overhead-<device slug>.{json,png,log}``, prints a table last. With
``--cases``, the new rows replace those cases' rows in that file (from the same device and
versions) and the other rows stay; ``meta["merged"]`` says which rows came from which run.

    python benchmarks/bench_overhead.py                      # every case
    python benchmarks/bench_overhead.py --cases grad decode  # cases whose name holds a word
    python benchmarks/bench_overhead.py --no-compile         # skip the torch.compile column
    python benchmarks/bench_overhead.py --metrics loop --providers flashlite  # bench_ab's job
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import RESULTS, bench, device_name, device_slug, metadata, write_results
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashlite
from flashlite import plotting, reference
from flashlite.ops import softmax as S
from flashlite.plotting import Bars, Figure, Panel

METRICS = ("do_bench", "loop", "graph", "compile")
TITLES = {
    "do_bench": "do_bench median (time per call)",
    "loop": "1000-call loop + sync (host-bound)",
    "graph": "CUDA graph of 20 calls, replayed",
    "compile": "torch.compile reduce-overhead",
}
MUST, AIM = 1.5, 1.1  # flashlite / baseline on the loop metric
DECODE_SLACK_US = 25.0  # a decode step with append: at most the cuDNN kernel's time + this
LOOP_CALLS, LOOP_ROUNDS, LOOP_WARMUP = 1000, 7, 50
#: do_bench, graph and compile are timed in this many interleaved rounds (median reported), so
#: a drifting clock hits every provider alike; loop in LOOP_ROUNDS, interleaved the same way.
ROUNDS = 5
GRAPH_CALLS, GRAPH_WARMUP = 20, 3
VERBOSE = False  # -v: tracebacks of skipped metrics
#: (atol, rtol) for softmax and the absolute floor for attention, as tests/conftest.py's TOL:
#: attention may differ from fp64 by 2x PyTorch's own low-precision error plus the floor.
TOL = {torch.float32: (1e-5, 1e-5, 2e-5), torch.bfloat16: (8e-3, 1.6e-2, 8e-3)}


#: providers whose outputs are checked against the fp64 reference (a wrong one is not timed)
CHECKED = ("flashlite", "floor")


class WrongResultError(AssertionError):
    """A flashlite output differs from the fp64 reference (or is not finite)."""


@dataclass
class Case:
    """One shape: its inputs, the fp64 reference and the providers that run it."""

    name: str
    op: str  # "attention" | "softmax"
    dtype: torch.dtype
    dims: dict[str, Any]
    inputs: tuple[torch.Tensor, ...]
    providers: dict[str, Callable[..., torch.Tensor]]  # eager callables on ``inputs``
    baseline: str
    ref: torch.Tensor | tuple[torch.Tensor, ...]  # one per output (a gradient tuple: each)
    allowed: Callable[[torch.Tensor, int], Any]  # allowed |error| for output i (per element)
    #: entered around everything a provider runs (SDPA's backend is pinned once, not per call)
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] = field(default_factory=dict)
    #: "ratio": loop <= MUST x the baseline's; "slack": loop <= the baseline's do_bench + slack
    rule: str = "ratio"

    def context(self, provider: str) -> AbstractContextManager[Any]:
        return self.contexts.get(provider, nullcontext)()


def attention_case(
    name: str, b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool
) -> Case:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    ref = reference.attention(q, k, v, causal, upcast=True)
    # PyTorch's own low-precision error (naive attention in bf16), as the tests' rule
    torch_err = (reference.attention(q, k, v, causal).double() - ref).abs().max().item()
    floor = TOL[torch.bfloat16][2]
    return Case(
        name,
        "attention",
        torch.bfloat16,
        {"B": b, "Hq": hq, "Hkv": hkv, "Nq": nq, "Nk": nk, "D": d, "causal": causal},
        (q, k, v),
        {
            "flashlite": lambda q, k, v: flashlite.attention(q, k, v, causal=causal),
            # backend=None: the backend is pinned by the provider's context, entered once
            "sdpa-flash": lambda q, k, v: reference.sdpa(q, k, v, causal=causal, backend=None),
            "sdpa-cudnn": lambda q, k, v: reference.sdpa(q, k, v, causal=causal, backend=None),
        },
        "sdpa-flash",
        ref,
        lambda r, i: torch.full_like(r, 2 * torch_err + floor),
        {
            "sdpa-flash": lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION),
            "sdpa-cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
        },
    )


def softmax_case(name: str, m: int, n: int, dtype: torch.dtype) -> Case:
    x = torch.randn(m, n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.to(dtype)
    atol, rtol, _ = TOL[dtype]
    return Case(
        name,
        "softmax",
        dtype,
        {"M": m, "N": n},
        (x,),
        {"flashlite": lambda x: flashlite.softmax(x), "torch": lambda x: torch.softmax(x, -1)},
        "torch",
        torch.softmax(x.double(), -1),
        lambda r, i: atol + rtol * r.abs(),
    )


def _grads_allowed(ours_ref: tuple[torch.Tensor, ...], torch_grads: tuple[torch.Tensor, ...],
                   floor: float) -> Callable[[torch.Tensor, int], float]:  # fmt: skip
    """Output i may differ from the fp64 gradient by twice torch's own low-precision error on
    that gradient, plus ``floor``."""
    errs = [(t.double() - r).abs().max().item() for t, r in zip(torch_grads, ours_ref, strict=True)]
    return lambda r, i: 2 * errs[i] + floor


def floor_function(x: torch.Tensor, dy: torch.Tensor, log: bool) -> Callable[..., torch.Tensor]:
    """``f(x)`` through the least a Python ``autograd.Function`` can do around flashlite's own
    softmax kernels for tensors like ``x`` and ``dy`` (dense rows): each direction allocates its
    output and calls the launch planned here, once; no checks, no plan lookup, no op layer. What
    flashlite's call costs above it is flashlite's; what it costs above torch, any Python
    autograd node's."""
    n = x.shape[-1]
    y0, dx0 = torch.empty_like(x), torch.empty_like(x)
    fwd = S.plan_fwd(x.detach().view(-1, n), y0.view(-1, n), log)
    bwd = S.plan_bwd(y0.view(-1, n), dy.view(-1, n), dx0.view(-1, n), log)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = torch.empty_like(x)
            fwd(x, y)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
            (y,) = ctx.saved_tensors
            dx = torch.empty_like(y)
            bwd(y, dy, dx)
            return dx

    return Floor.apply


def softmax_grad_case(name: str, m: int, n: int, dtype: torch.dtype, log: bool) -> Case:
    """``torch.autograd.grad(f(x), x, dy)``: forward + backward, returning dx; ``floor`` runs
    the same kernels through a bare ``autograd.Function`` (:func:`floor_function`)."""
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(m, n, device="cuda", generator=g).to(dtype).requires_grad_()
    dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    ours = flashlite.log_softmax if log else flashlite.softmax
    theirs = torch.log_softmax if log else torch.softmax
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(theirs(x64, -1), x64, dy.double())
    (torch_dx,) = torch.autograd.grad(theirs(x, -1), x, dy)
    floor = floor_function(x, dy, log)
    return Case(
        name, "softmax grad", dtype, {"M": m, "N": n, "log": log}, (x, dy),
        {"flashlite": lambda x, dy: torch.autograd.grad(ours(x), x, dy)[0],
         "torch": lambda x, dy: torch.autograd.grad(theirs(x, -1), x, dy)[0],
         "floor": lambda x, dy: torch.autograd.grad(floor(x), x, dy)[0]},
        "torch", ref, _grads_allowed((ref,), (torch_dx,), TOL[dtype][0]),
    )  # fmt: skip


def attention_grad_case(name: str, b: int, h: int, n: int, d: int) -> Case:
    """Causal attention forward + backward: ``torch.autograd.grad(o, (q, k, v), do)``."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qkv64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(reference.attention(*qkv64, True), qkv64, do.double())
    naive = torch.autograd.grad(reference.attention(q, k, v, True), (q, k, v), do)
    sdpa = lambda q, k, v, do: torch.autograd.grad(  # noqa: E731
        reference.sdpa(q, k, v, causal=True, backend=None), (q, k, v), do)  # fmt: skip
    return Case(
        name, "attention grad", torch.bfloat16,
        {"B": b, "Hq": h, "Hkv": h, "Nq": n, "Nk": n, "D": d, "causal": True}, (q, k, v, do),
        {"flashlite": lambda q, k, v, do: torch.autograd.grad(
            flashlite.attention(q, k, v, causal=True), (q, k, v), do),
         "sdpa-flash": sdpa, "sdpa-cudnn": sdpa},
        "sdpa-flash", tuple(ref), _grads_allowed(tuple(ref), naive, TOL[torch.bfloat16][2]),
        {"sdpa-flash": lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION),
         "sdpa-cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)},
    )  # fmt: skip


@contextlib.contextmanager
def _triton_kernels() -> Any:
    """``FLASHLITE_HOPPER_KERNEL=0`` while a provider runs: the Triton kernels, not Hopper's."""
    old = os.environ.get("FLASHLITE_HOPPER_KERNEL")
    os.environ["FLASHLITE_HOPPER_KERNEL"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASHLITE_HOPPER_KERNEL")
        else:
            os.environ["FLASHLITE_HOPPER_KERNEL"] = old


def window_case(name: str, b: int, h: int, n: int, d: int, window: int, grad: bool) -> Case:
    """``attention(window=(window, 0))``: the default call (on Hopper, the window folded into
    the flex kernels) against the same call on the Triton window kernels; the forward, or
    (``grad``) forward + backward."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    w = (window, 0)
    call = lambda q, k, v: flashlite.attention(q, k, v, window=w)  # noqa: E731
    qkv64 = [t.double().requires_grad_(grad) for t in (q, k, v)]
    out64 = reference.attention(*qkv64, window=w)
    dims = {"B": b, "Hq": h, "Hkv": h, "Nq": n, "Nk": n, "D": d, "window": window}
    ctx = {"triton": _triton_kernels}
    if not grad:
        err = (reference.attention(q, k, v, window=w).double() - out64).abs().max().item()
        bound = 2 * err + TOL[torch.bfloat16][2]
        return Case(name, "attention", torch.bfloat16, dims, (q, k, v),
                    {"flashlite": call, "triton": call}, "triton", out64.detach(),
                    lambda r, i: torch.full_like(r, bound), ctx)  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(out64, qkv64, do.double())
    naive = torch.autograd.grad(reference.attention(q, k, v, window=w), (q, k, v), do)
    grads = lambda q, k, v, do: torch.autograd.grad(call(q, k, v), (q, k, v), do)  # noqa: E731
    return Case(
        name, "attention grad", torch.bfloat16, dims, (q, k, v, do),
        {"flashlite": grads, "triton": grads}, "triton", tuple(ref),
        _grads_allowed(tuple(ref), naive, TOL[torch.bfloat16][2]), ctx,
    )  # fmt: skip


def flex_case(name: str, b: int, h: int, n: int, d: int, grad: bool) -> Case:
    """Document-causal attention (4 documents) through ``flashlite.flex_attention`` and torch's
    ``torch.compile(flex_attention)``, each over its own block mask of the same mod, made
    beforehand; the forward, or (``grad``) forward + backward."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from flashlite import gallery  # (where every tree bench_ab compares has it)

    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    mm = gallery.document_causal(gallery.random_documents(b, n, 4, seed=1).cuda())
    ours_bm = flashlite.create_block_mask(mm, b, None, n, n)
    theirs_bm = torch_block_mask(mm, b, None, n, n, device="cuda")
    cflex = torch.compile(torch_flex)
    ours = lambda q, k, v: flashlite.flex_attention(q, k, v, block_mask=ours_bm)  # noqa: E731
    theirs = lambda q, k, v: cflex(q, k, v, block_mask=theirs_bm)  # noqa: E731
    qkv64 = [t.double().requires_grad_(grad) for t in (q, k, v)]
    out64 = reference.attention(*qkv64, mask_mod=mm)
    dims = {"B": b, "Hq": h, "Hkv": h, "Nq": n, "Nk": n, "D": d, "mask": "document_causal"}
    # the allowed error: twice PyTorch's own low-precision error (naive attention in bf16,
    # the tests' rule) plus the floor
    if not grad:
        err = (reference.attention(q, k, v, mask_mod=mm).double() - out64).abs().max().item()
        return Case(name, "flex", torch.bfloat16, dims, (q, k, v),
                    {"flashlite": ours, "torch-flex": theirs}, "torch-flex", out64.detach(),
                    lambda r, i: torch.full_like(r, 2 * err + TOL[torch.bfloat16][2]))  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(out64, qkv64, do.double())
    naive = torch.autograd.grad(reference.attention(q, k, v, mask_mod=mm), (q, k, v), do)
    return Case(
        name, "flex grad", torch.bfloat16, dims, (q, k, v, do),
        {"flashlite": lambda q, k, v, do: torch.autograd.grad(ours(q, k, v), (q, k, v), do),
         "torch-flex": lambda q, k, v, do: torch.autograd.grad(theirs(q, k, v), (q, k, v), do)},
        "torch-flex", tuple(ref), _grads_allowed(tuple(ref), naive, TOL[torch.bfloat16][2]),
    )  # fmt: skip


def cross_entropy_case(name: str, n: int, v: int) -> Case:
    """Mean cross-entropy of bf16 logits, forward + backward (the logits' gradient)."""
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(n, v, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(x64, t), x64)
    (torch_dx,) = torch.autograd.grad(F.cross_entropy(x, t), x)
    return Case(
        name, "cross-entropy grad", torch.bfloat16, {"N": n, "V": v}, (x, t),
        {"flashlite": lambda x, t: torch.autograd.grad(flashlite.cross_entropy(x, t), x)[0],
         "torch": lambda x, t: torch.autograd.grad(F.cross_entropy(x, t), x)[0]},
        "torch", ref, _grads_allowed((ref,), (torch_dx,), 1e-6),
    )  # fmt: skip


def linear_cross_entropy_case(name: str, n: int, d: int, v: int) -> Case:
    """Linear cross-entropy (hidden @ weightᵀ, then the loss), forward + backward of both."""
    g = torch.Generator("cuda").manual_seed(4)
    h = (torch.randn(n, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16)
    w = torch.randn(v, d, device="cuda", generator=g).to(torch.bfloat16)
    h, w = h.requires_grad_(), w.requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    h64, w64 = (a.detach().double().requires_grad_() for a in (h, w))
    ref = torch.autograd.grad(F.cross_entropy(h64 @ w64.T, t), (h64, w64))
    torch_grads = torch.autograd.grad(F.cross_entropy(h @ w.T, t), (h, w))
    return Case(
        name, "cross-entropy grad", torch.bfloat16, {"N": n, "D": d, "V": v}, (h, w, t),
        {"flashlite": lambda h, w, t: torch.autograd.grad(
            flashlite.linear_cross_entropy(h, w, t), (h, w)),
         "torch": lambda h, w, t: torch.autograd.grad(F.cross_entropy(h @ w.T, t), (h, w))},
        "torch", tuple(ref), _grads_allowed(tuple(ref), torch_grads, 1e-6),
    )  # fmt: skip


def decode_append_case(name: str, b: int, nk: int, validate: bool) -> Case:
    """One generate-loop step: ``attention_kvcache`` appends one token per batch at ``nk`` and
    attends to ``nk + 1`` keys (the same slot every call: the timing repeats one step). The
    baseline is the cuDNN kernel over those keys alone (no append): the bar is its do_bench
    time plus :data:`DECODE_SLACK_US`."""
    hq, hkv, d = 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc = (torch.randn(b, nk + 64, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(2))  # fmt: skip
    kn, vn = (torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(2))  # fmt: skip
    lens = torch.full((b,), nk, device="cuda", dtype=torch.int32)
    kc[:, nk : nk + 1], vc[:, nk : nk + 1] = kn, vn  # what the append writes
    keys = [t[:, : nk + 1].transpose(1, 2) for t in (kc, vc)]
    qh = q.transpose(1, 2)
    ref = reference.attention(qh, *keys, False, upcast=True).transpose(1, 2)
    torch_err = (reference.attention(qh, *keys, False).double().transpose(1, 2) - ref).abs().max()
    floor = TOL[torch.bfloat16][2]
    return Case(
        name, "decode append", torch.bfloat16,
        {"B": b, "Hq": hq, "Hkv": hkv, "Nq": 1, "Nk": nk, "D": d, "validate": validate},
        (q, kc, vc, lens, kn, vn),
        {"flashlite": lambda q, kc, vc, lens, kn, vn: flashlite.attention_kvcache(
            q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, validate=validate),
         "sdpa-cudnn": lambda q, *_: reference.sdpa(qh, *keys, backend=None).transpose(1, 2)},
        "sdpa-cudnn", ref, lambda r, i: 2 * torch_err.item() + floor,
        {"sdpa-cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)}, rule="slack",
    )  # fmt: skip


def cases() -> list[Case]:
    grads = [
        softmax_grad_case(f"{'log_' if log else ''}softmax grad {m}x{n} {tag}", m, n, dt, log)
        for m, n in ((4, 1024), (2048, 1024), (32, 65536))
        for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
        for log in (False, True)
    ]
    return [
        attention_case("attn N=128", 1, 8, 8, 128, 128, 64, False),
        attention_case("attn N=128 causal", 1, 8, 8, 128, 128, 64, True),
        attention_grad_case("attn grad N=128 causal", 1, 8, 128, 64),
        attention_grad_case("attn grad 16x6x512 causal", 16, 6, 512, 64),
        window_case("window 1k N=4k", 1, 8, 4096, 128, 1024, False),
        window_case("window 1k grad N=4k", 1, 8, 4096, 128, 1024, True),
        flex_case("flex N=1k doc-causal", 1, 8, 1024, 64, False),
        flex_case("flex grad N=1k doc-causal", 1, 8, 1024, 64, True),
        attention_case("decode Nk=512 GQA", 8, 32, 8, 1, 512, 128, False),
        *(
            decode_append_case(
                f"decode append B={b} Nk={nk // 1024}k{'' if v else ' unchecked'}", b, nk, v
            )
            for b, nk in ((1, 4096), (1, 131072), (8, 8192))
            for v in (True, False)
        ),  # fmt: skip
        softmax_case("softmax 4x1024 fp32", 4, 1024, torch.float32),
        softmax_case("softmax 4x1024 bf16", 4, 1024, torch.bfloat16),
        *grads,
        cross_entropy_case("ce grad 512x32k", 512, 32768),
        cross_entropy_case("ce grad 8192x32k", 8192, 32768),
        linear_cross_entropy_case("linear ce grad 512x1024x32k", 512, 1024, 32768),
    ]


# =============================================================================== checking
def _tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def max_error(case: Case, out: Any) -> float:
    """Max |error| of every output against its fp64 reference."""
    return max((o.double() - r).abs().max().item()
               for o, r in zip(_tuple(out), _tuple(case.ref), strict=True))  # fmt: skip


def check(case: Case, out: Any, what: str) -> float:
    """Max |error| against the fp64 reference (each output of a tuple); raises
    :class:`WrongResultError` when off."""
    worst = 0.0
    for i, (o, ref) in enumerate(zip(_tuple(out), _tuple(case.ref), strict=True)):
        diff = (o.double() - ref).abs()
        if not torch.isfinite(o).all():
            raise WrongResultError(f"{what} on {case.name}: non-finite output {i}")
        allowed = torch.as_tensor(case.allowed(ref, i), dtype=torch.float64, device=ref.device)
        if not (diff <= allowed).all():
            raise WrongResultError(
                f"{what} on {case.name}: output {i}'s max |error| {diff.max().item():.3g} "
                f"over the allowed {allowed.max().item():.3g}"
            )
        worst = max(worst, diff.max().item())
    return worst


# =============================================================================== timing
def warm_loop(fn: Callable[[], Any]) -> Callable[[], float]:
    """A timer of one round of :func:`time_loop`, after ``LOOP_WARMUP`` calls."""
    for _ in range(LOOP_WARMUP):
        fn()
    torch.cuda.synchronize()
    return lambda: time_loop(fn)


def time_loop(fn: Callable[[], Any]) -> float:
    """µs per call of ``LOOP_CALLS`` back-to-back calls and one synchronize (one round)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LOOP_CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / LOOP_CALLS * 1e6


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``GRAPH_CALLS`` calls (warm-up on a side stream first, as PyTorch's
    CUDA-graph docs ask) and the static output of its last call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            out = fn()
    return graph, out


def compiled(case: Case, provider: str) -> Callable[..., torch.Tensor]:
    return torch.compile(
        case.providers[provider], mode="reduce-overhead", fullgraph=True, dynamic=False
    )


def prepare(case: Case, provider: str, metric: str, row: dict[str, Any]) -> Callable[[], float]:
    """A timer giving ``metric`` of ``provider`` in µs per call; graph and compile are built
    (and flashlite's outputs from them checked) here, once."""
    fn, args = case.providers[provider], case.inputs
    ours = provider in CHECKED
    if metric == "do_bench":
        return lambda: 1e3 * bench(lambda: fn(*args), warmup=25, rep=200)
    if metric == "loop":
        return warm_loop(lambda: fn(*args))
    if metric == "graph":
        graph, out = capture(lambda: fn(*args))
        graph.replay()
        torch.cuda.synchronize()
        if ours:
            row["max_err_graph"] = check(case, out, f"{provider} (CUDA graph replay)")
        return lambda: 1e3 * bench(graph.replay, warmup=25, rep=200) / GRAPH_CALLS
    if metric == "compile":
        cfn = compiled(case, provider)
        out = tuple(o.clone() for o in _tuple(cfn(*args)))  # reduce-overhead reuses buffers
        out = out if isinstance(case.ref, tuple) else out[0]
        if ours:
            row["max_err_compile"] = check(case, out, f"{provider} (torch.compile)")
        return lambda: 1e3 * bench(lambda: cfn(*args), warmup=25, rep=200)
    raise ValueError(f"metric={metric!r} is not one of {', '.join(METRICS)}")


def warm_up(all_cases: list[Case], seconds: float = 3.0) -> None:
    """Matrix products, then every provider back to back, for ``seconds`` in all, so the GPU's
    clocks are up and every provider's first-call work is done before the first timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 3:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    while time.perf_counter() - t0 < seconds:
        for case in all_cases:
            for provider, fn in case.providers.items():
                with contextlib.suppress(Exception), case.context(provider):  # failures: later
                    for _ in range(20):
                        fn(*case.inputs)
        torch.cuda.synchronize()


# =============================================================================== main
def run(metrics: tuple[str, ...], words: list[str] | None = None,
        providers: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    all_cases = [c for c in cases() if not words or any(w in c.name for w in words)]
    for case in all_cases if providers else ():
        case.providers = {p: f for p, f in case.providers.items() if p in providers}
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for case in all_cases:  # eager outputs first: a wrong provider is never timed
        for provider, fn in case.providers.items():
            row = {
                "case": case.name,
                "op": case.op,
                "dtype": str(case.dtype).removeprefix("torch."),
                **case.dims,
                "provider": provider,
                "notes": [],
            }
            row.update({f"{m}_us": None for m in METRICS})
            row.update({f"{m}_us_rounds": [] for m in METRICS})
            try:
                with case.context(provider):
                    out = fn(*case.inputs)
                torch.cuda.synchronize()
                row["max_err"] = max_error(case, out)
                if provider in CHECKED:
                    check(case, out, provider)
                table[(case.name, provider)] = row
            except WrongResultError as exc:
                failures.append(str(exc))
                print(f"WRONG: {exc}", file=sys.stderr, flush=True)
                row["notes"].append(f"wrong: {exc}")
            except Exception as exc:  # noqa: BLE001  (a provider that cannot run is skipped)
                row["notes"].append(f"skipped: {type(exc).__name__}: {exc}"[:300])
                print(f"skip {provider} on {case.name}: {row['notes'][-1]}", file=sys.stderr)
            rows.append(row)
    # one metric at a time over every shape: a failing capture or compile cannot spoil the
    # plainer metrics measured before it
    warm_up(all_cases)
    for metric in metrics:
        t0 = time.perf_counter()
        timers: dict[tuple[str, str], Callable[[], float]] = {}
        times: dict[tuple[str, str], list[float]] = {}
        for rnd in range(LOOP_ROUNDS if metric == "loop" else ROUNDS):
            for case in all_cases:
                for provider in case.providers:
                    key, row = (case.name, provider), table.get((case.name, provider))
                    if row is None or (rnd > 0 and key not in timers):
                        continue
                    try:
                        with case.context(provider):
                            if key not in timers:
                                timers[key] = prepare(case, provider, metric, row)
                            times.setdefault(key, []).append(timers[key]())
                    except WrongResultError as exc:
                        failures.append(str(exc))
                        print(f"WRONG: {exc}", file=sys.stderr, flush=True)
                        row["notes"].append(f"wrong ({metric}): {exc}")
                        timers.pop(key, None)
                    except Exception as exc:  # noqa: BLE001  (reported, then skipped)
                        note = f"{metric} skipped: {type(exc).__name__}: {exc}"
                        row["notes"].append(note.splitlines()[0][:300])
                        print(f"{provider} on {case.name}: {row['notes'][-1]}", file=sys.stderr)
                        if VERBOSE:
                            traceback.print_exc()
                        timers.pop(key, None)
                        times.pop(key, None)
                        torch.cuda.synchronize()
        for (name, provider), ts in times.items():
            if (name, provider) in timers:
                table[(name, provider)][f"{metric}_us"] = statistics.median(ts)
                table[(name, provider)][f"{metric}_us_rounds"] = ts
        print(f"{metric}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for case in all_cases:
        ours, base = table.get((case.name, "flashlite")), table.get((case.name, case.baseline))
        if ours is None:
            continue
        ours["baseline"] = case.baseline
        for metric in METRICS:
            a, b = ours[f"{metric}_us"], base and base[f"{metric}_us"]
            ours[f"ratio_{metric}"] = a / b if a and b else None
        ours["rule"] = case.rule
        if case.rule == "slack":  # the step's loop time against the kernel's own time
            loop, kernel = ours["loop_us"], base and base["do_bench_us"]
            ours["must"] = None if not (loop and kernel) else loop <= kernel + DECODE_SLACK_US
            ours["aim"] = ours["must"]
        else:
            r = ours["ratio_loop"]
            ours["must"] = None if r is None else r <= MUST
            ours["aim"] = None if r is None else r <= AIM
        floor = table.get((case.name, "floor"))
        if floor is not None:  # (the bare Function's ratios, beside flashlite's; no bar)
            floor["baseline"], floor["must"], floor["aim"] = case.baseline, None, None
            for metric in METRICS:
                a, b = floor[f"{metric}_us"], base and base[f"{metric}_us"]
                floor[f"ratio_{metric}"] = a / b if a and b else None
    return rows, failures


def figure(rows: list[dict[str, Any]], title: str) -> Figure:
    """Two wide panels, one above the other: the loop time per call (the bar's metric) per
    provider, then flashlite / baseline for every metric that was measured."""
    names = list(dict.fromkeys(r["case"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    by = {(r["case"], r["provider"]): r for r in rows}

    def value(case: str, provider: str, key: str) -> float:
        v = by.get((case, provider), {}).get(key)
        return math.nan if v is None else v

    measured = [m for m in METRICS if any(r.get(f"{m}_us") is not None for r in rows)]
    labels = [n.replace(" ", "\n") for n in names]
    loop = Panel(
        bars=[Bars([value(n, p, "loop_us") for n in names], p) for p in providers],
        categories=labels,
        title=TITLES["loop"],
        ylabel="µs per call",
        ylog=10,
        grid="major",
    )
    ratios = Panel(
        bars=[Bars([value(n, "flashlite", f"ratio_{m}") for n in names], m) for m in measured],
        categories=labels,
        hlines=[(MUST, f"must {MUST}x"), (AIM, f"aim {AIM}x"), (1.0, "")],
        title="flashlite / baseline (decode append: the cuDNN kernel)",
        ylabel="ratio",
        grid="major",
    )
    width = max(8.0, 0.8 * len(names))
    return Figure([[loop], [ratios]], title=title, panel_size=(width, 4.2))


def format_table(rows: list[dict[str, Any]]) -> str:
    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [
        f"{'shape':<34}{'provider':<12}"
        + "".join(f"{m + ' µs':>12}" for m in METRICS)
        + f"{'max err':>10}"
    ]
    for r in rows:
        err = "-" if r.get("max_err") is None else f"{r['max_err']:.1e}"
        lines.append(
            f"{r['case']:<34}{r['provider']:<12}"
            + "".join(f"{us(r[f'{m}_us']):>12}" for m in METRICS)
            + f"{err:>10}"
        )
    lines.append(
        f"\nflashlite (and floor) / baseline per metric (must <= {MUST}x, aim <= {AIM}x on loop; "
        f"decode append: loop <= cuDNN's do_bench + {DECODE_SLACK_US:.0f} µs)"
    )
    lines.append(
        f"{'shape':<34}{'baseline':<12}"
        + "".join(f"{m:>12}" for m in METRICS)
        + f"{'must':>7}{'aim':>7}"
    )
    for r in rows:
        if r["provider"] not in CHECKED or "baseline" not in r:
            continue
        must = {True: "pass", False: "FAIL", None: "-"}[r["must"]]
        aim = {True: "pass", False: "miss", None: "-"}[r["aim"]]
        ratios = "".join(f"{ratio(r[f'ratio_{m}']):>12}" for m in METRICS)
        base = r["baseline"] if r["provider"] == "flashlite" else f"floor:{r['baseline']}"
        lines.append(f"{r['case']:<34}{base:<12}{ratios}{must:>7}{aim:>7}")
    notes = [f"{r['case']} / {r['provider']}: {n}" for r in rows for n in r["notes"]]
    if notes:
        lines += ["\nnotes:", *(f"  {n}" for n in notes)]
    return "\n".join(lines)


def merge(saved: dict[str, Any], rows: list[dict[str, Any]], meta: dict[str, Any],
          words: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """``saved`` (a whole results file) with the cases matching ``words`` replaced by ``rows``.

    Each case's providers come from one run, so every ratio stays within its own run. Returns
    ``(rows, meta)``: the saved meta, its ``merged`` entry recording this run. A file from
    another device or other versions is not merged into (``ValueError``).
    """
    keys = ("device", "torch", "triton")
    if any(saved["meta"].get(k) != meta.get(k) for k in keys):
        raise ValueError(f"saved results are from {[saved['meta'].get(k) for k in keys]}, this "
                         f"run from {[meta.get(k) for k in keys]}: not merged")  # fmt: skip
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    merged: list[dict[str, Any]] = []
    placed: set[str] = set()
    for r in saved["rows"]:  # the saved order, each replaced case where it stood
        case = r["case"]
        if case not in by_case:
            merged.append(r)
        elif case not in placed:
            merged += by_case[case]
            placed.add(case)
    saved_cases = {r["case"] for r in saved["rows"]}
    merged += [r for r in rows if r["case"] not in saved_cases]
    out = dict(saved["meta"])
    out["merged"] = {
        **out.get("merged", {}),
        " ".join(words) + " cases": {
            "date": meta["date"],
            "command": meta["command"],
            "note": "these rows come from this later run (same device and versions); each "
            "row's ratios are within its own run",
        },
    }
    out["failures"] = [*saved["meta"].get("failures", []), *meta["failures"]]
    return merged, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile(mode='reduce-overhead') column",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="WORD",
        default=None,
        help="only the cases whose name holds one of these words (default: all)",
    )
    parser.add_argument(
        "--metrics", nargs="+", choices=METRICS, default=None, help="only these metrics"
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        metavar="NAME",
        default=None,
        help="only these providers (e.g. flashlite: the loop column alone, as bench_ab runs it)",
    )
    parser.add_argument("-v", action="store_true", help="print tracebacks of skipped metrics")
    parser.add_argument(
        "--replot", metavar="JSON", help="redraw the PNG of a results file, run nothing"
    )
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        out = plotting.save(
            figure(saved["rows"], f"flashlite per-call cost, {saved['meta']['device']}"),
            Path(args.replot).with_suffix(".png"),
        )
        print(f"wrote {out}")
        return 0
    global VERBOSE
    VERBOSE = args.v
    if not torch.cuda.is_available():
        print("bench_overhead needs CUDA (a GPU): nothing to time on this machine")
        return 2
    t0 = time.perf_counter()
    metrics = tuple(m for m in args.metrics or METRICS if not (args.no_compile and m == "compile"))
    rows, failures = run(metrics, args.cases, args.providers)
    name = device_name()
    meta = metadata(
        dtype="bfloat16 (softmax also float32)",
        command="python benchmarks/bench_overhead.py " + " ".join(argv or sys.argv[1:]),
        seconds=round(time.perf_counter() - t0, 1),
        metrics={
            "do_bench": "triton.testing.do_bench median, warmup=25 ms, rep=200 ms",
            "loop": f"wall clock of {LOOP_CALLS} calls + one synchronize, median of "
            f"{LOOP_ROUNDS} interleaved rounds after {LOOP_WARMUP} warm-up calls",
            "graph": f"do_bench median of one replay of a CUDA graph of {GRAPH_CALLS} calls, "
            f"/ {GRAPH_CALLS}",
            "compile": "torch.compile(mode='reduce-overhead', fullgraph=True), do_bench median",
        },
        targets={
            "must": MUST,
            "aim": AIM,
            "on": "loop",
            "decode append": f"loop <= the cuDNN kernel's do_bench + {DECODE_SLACK_US} µs",
        },
        cases=args.cases or "all",
        failures=failures,
    )
    saved_path = RESULTS / f"overhead-{device_slug()}.json"
    if args.cases and saved_path.exists():
        try:
            rows, meta = merge(json.loads(saved_path.read_text()), rows, meta, args.cases)
        except ValueError as err:
            print(f"{err}; writing this run alone")
    table = format_table(rows)
    paths = write_results(
        f"overhead-{device_slug()}",
        rows,
        meta,
        log=table,
        figure=figure(rows, f"flashlite per-call cost, {name}"),
    )
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({meta['seconds']} s)\n")
    print(table)
    if failures:
        print(f"\nFAILED: {len(failures)} wrong flashlite result(s):", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
