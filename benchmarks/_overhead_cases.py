"""bench_overhead's cases: each shape's inputs, providers, fp64 reference and the check of an
output against it.

:func:`cases` lists every case the script times (its docstring's table); each ``*_case`` builder
makes one :class:`Case` on the GPU. :func:`check` judges a provider's output against the case's
reference (a wrong one raises :class:`WrongResultError` and is never timed). The imports are the
public names every flashlite tree that ``bench_ab.py`` compares has, so this module runs against
an older tree too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashlite
from flashlite import reference
from flashlite.ops import softmax as S

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
    time plus ``_overhead_report.DECODE_SLACK_US``."""
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
