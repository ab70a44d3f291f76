"""flashlite.attention's backward against fp64 autograd through reference.attention.

Rule (flash-attn's): each gradient's error against the fp64 one stays within 2x the error of
PyTorch's own math attention in the same low precision, plus a small floor (``TOL[dtype].floor``
scaled by the gradient's size). CPU runs the kernels in the interpreter with 16x16 tiles, so the
lengths below cover full, partial and several tiles.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, maybe_compile

import flashlite
from flashlite.kernels import configs as C
from flashlite.masking.masks import CAUSAL, describe
from flashlite.ops.attention import Request
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grads(fn, q, k, v, do, dlse=None):  # noqa: ANN001, ANN202
    """(dq, dk, dv) of ``fn(q, k, v) -> (o, lse)`` for upstream ``do`` (and ``dlse``)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v)
    loss = (o.float() * do.float()).sum()
    if dlse is not None:
        loss = loss + (lse.float() * dlse.float()).sum()
    loss.backward()
    return tuple(t.grad for t in (q, k, v))


def assert_grads_close(fn, q, k, v, *, causal=False, scale=None, with_lse=False) -> None:  # noqa: ANN001
    do = torch.randn(q.shape, dtype=q.dtype)
    dlse = torch.randn(q.shape[:3]) if with_lse else None

    def ref(up):  # noqa: ANN001, ANN202
        return lambda q, k, v: ref_attention(q, k, v, causal, scale, upcast=up, return_lse=True)

    want = _grads(ref(True), q.double(), k.double(), v.double(), do.double(), dlse)
    torch_lp = _grads(ref(False), q, k, v, do, dlse)
    got = _grads(fn, q, k, v, do, dlse)
    for name, g, w, t in zip("qkv", got, want, torch_lp, strict=True):
        assert g.dtype == q.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"NaN/inf in d{name}"
        err = (g.double() - w).abs().max().item()
        torch_err = (t.double() - w).abs().max().item()
        floor = TOL[q.dtype].floor * max(1.0, w.abs().max().item())
        assert err <= 2 * torch_err + floor, (name, err, torch_err)


def _fa(causal=False, scale=None, layout="b h n d", use_compile=False):  # noqa: ANN001, ANN202
    call = maybe_compile(flashlite.attention, use_compile)
    return lambda q, k, v: call(q, k, v, causal=causal, scale=scale, layout=layout,
                                return_lse=True)  # fmt: skip


def rand(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq,nk", [(1, 1), (17, 17), (40, 23), (23, 40), (1, 37), (37, 1)], ids=lambda x: str(x)
)
def test_lengths_and_causal(nq: int, nk: int, causal: bool, use_compile: bool) -> None:
    # Nq != Nk: the causal diagonal is bottom-right; Nq > Nk leaves rows that see no key
    q, k, v = rand(1, 2, nq, 32), rand(1, 2, nk, 32), rand(1, 2, nk, 32)
    assert_grads_close(_fa(causal, use_compile=use_compile), q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dtypes_and_lse_gradient(dtype: torch.dtype, causal: bool, use_compile: bool) -> None:
    q = rand(2, 2, 21, 16, dtype=dtype)
    k, v = rand(2, 2, 30, 16, dtype=dtype), rand(2, 2, 30, 16, dtype=dtype)
    fn = _fa(causal, use_compile=use_compile)
    assert_grads_close(fn, q, k, v, causal=causal, with_lse=True)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
def test_gqa_mqa_sum_over_the_group(hq: int, hkv: int) -> None:
    q, k, v = rand(2, hq, 19, 16), rand(2, hkv, 26, 16), rand(2, hkv, 26, 16)
    assert_grads_close(_fa(True), q, k, v, causal=True)


@pytest.mark.parametrize("d", [1, 16, 40, 59, 128, 256])
def test_head_dims(d: int) -> None:
    q, k, v = rand(1, 1, 20, d), rand(1, 1, 17, d), rand(1, 1, 17, d)
    assert_grads_close(_fa(True), q, k, v, causal=True)


def test_scale() -> None:
    q, k, v = (rand(1, 2, 18, 16, dtype=torch.float32) for _ in range(3))
    assert_grads_close(_fa(False, 0.3), q, k, v, scale=0.3, with_lse=True)


def test_layout_b_n_h_d_packed_qkv() -> None:
    qkv = rand(2, 21, 3, 4, 16).requires_grad_()
    q, k, v = qkv.unbind(2)
    out = flashlite.attention(q, k, v, layout="b n h d", causal=True)
    do = torch.randn_like(out)
    (out.float() * do.float()).sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape  # back in the packed buffer
    qd = qkv.detach().double().requires_grad_()
    qq, kk, vv = (t.transpose(1, 2) for t in qd.unbind(2))
    ref = ref_attention(qq, kk, vv, True, upcast=True).transpose(1, 2)
    (ref * do.double()).sum().backward()
    assert qd.grad is not None
    assert (qkv.grad.double() - qd.grad).abs().max().item() < 1e-2


def test_rows_that_see_no_key_get_zero_gradient() -> None:
    q = rand(1, 1, 40, 16, dtype=torch.float32).requires_grad_()
    k, v = rand(1, 1, 8, 16, dtype=torch.float32), rand(1, 1, 8, 16, dtype=torch.float32)
    out, lse = flashlite.attention(q, k, v, causal=True, return_lse=True)
    # the LSE of those rows is -inf: their gradient is defined only through the output
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert (q.grad[0, 0, :32] == 0).all()  # rows i < 32 see no key


def test_non_contiguous_grad_output() -> None:
    q, k, v = rand(1, 2, 33, 32), rand(1, 2, 33, 32), rand(1, 2, 33, 32)
    fn = _fa(True)
    do = torch.randn(1, 2, 32, 66, dtype=q.dtype).transpose(-1, -2)[:, :, :33]
    assert not do.is_contiguous()
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o, _ = fn(qs, ks, vs)
    o.backward(do)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_attention(qd, kd, vd, True, upcast=True).backward(do.double())
    for g, w in ((qs.grad, qd.grad), (ks.grad, kd.grad), (vs.grad, vd.grad)):
        assert g is not None and w is not None
        assert (g.double() - w).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_descriptor_loads(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # BwdConfig.use_desc: the loops' tiles through TMA descriptors (the interpreter runs them on
    # CPU tensors), ragged lengths and GQA, against the same fp64 rule
    from flashlite.ops.attention.backends.triton import bwd as ops

    made: list[object] = []

    def descriptor(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(args[0])
        return real(*args, **kwargs)

    real = ops.TensorDescriptor
    monkeypatch.setattr(ops, "TensorDescriptor", descriptor)
    cfg = C.CPU_BWD_CONFIG._replace(use_desc=True)
    # (D = 32: Triton 3.4's interpreter wants every stride but the last a multiple of 16)
    q = rand(1, 4, 37, 32, dtype=dtype)
    k, v = rand(1, 2, 29, 32, dtype=dtype), rand(1, 2, 29, 32, dtype=dtype)
    assert_grads_close(lambda q, k, v: _WithConfig.apply(q, k, v, cfg), q, k, v, causal=True,
                       with_lse=True)  # fmt: skip
    assert len(made) >= 4  # Qs and dO for dK/dV, K and V for dQ


class _WithConfig(torch.autograd.Function):
    """flashlite's forward and a backward with a pinned config (autograd's plumbing only)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg):  # noqa: ANN001, ANN205
        o, lse = flashlite.attention(q, k, v, causal=True, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cfg = cfg
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):  # noqa: ANN001, ANN205
        from flashlite.ops.attention import attention_bwd

        q, k, v, o, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dq, dk, dv = attention_bwd(
            do, q, k, v, o, lse, dlse, Request.of_mask(CAUSAL, scale), config=ctx.cfg
        )
        return dq, dk, dv, None


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck prefers fp64, which no kernel takes
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_fp32_through_output_and_lse(causal: bool) -> None:
    # fp32 is the widest dtype the kernels take: finite differences with eps 1e-3 against the
    # analytic backward (fast mode: one random projection), GQA and Nq != Nk included
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 7, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 1, 9, 8, generator=gen).requires_grad_() for _ in range(2))

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=causal, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


@pytest.mark.parametrize("kind", ["plain", "window", "varlen"])
def test_eager_autograd_skips_the_dispatcher_and_matches_the_op(kind: str) -> None:
    """In eager autograd the front-end records its own autograd function (no custom-op
    dispatcher: host time on every training call); the op, taken under a dispatch mode, gives
    the same output, LSE and gradients (through O and the LSE), and a second derivative is
    refused with the op's own message."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(0)
    if kind == "varlen":
        q, k, v = (torch.randn(11, 2, 16, generator=gen).requires_grad_() for _ in range(3))
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)

        def run(*t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return flashlite.attention_varlen(*t, cu, cu, 7, 7, causal=True, return_lse=True)
    else:
        q = torch.randn(1, 2, 9, 16, generator=gen).requires_grad_()
        k, v = (torch.randn(1, 1, 12, 16, generator=gen).requires_grad_() for _ in range(2))
        window = (3, 0) if kind == "window" else None

        def run(*t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return flashlite.attention(*t, causal=True, window=window, return_lse=True)

    def nodes(t: torch.Tensor) -> set[str]:  # the names of t's graph, down to the leaves
        seen, todo = set(), [t.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None:
                seen.add(type(fn).__name__)
                todo.extend(f for f, _ in fn.next_functions)
        return seen

    do = torch.randn(q.shape, generator=gen)
    o, lse = run(q, k, v)
    assert "AttentionFwdFunctionBackward" in nodes(o)
    with FlopCounterMode(display=False):  # a dispatch mode watches: the custom op's path
        o_op, lse_op = run(q, k, v)
    assert "AttentionFwdFunctionBackward" not in nodes(o_op)
    torch.testing.assert_close((o, lse), (o_op, lse_op), atol=0, rtol=0)
    fast, slow = (torch.autograd.grad(outs, (q, k, v), (do, torch.ones_like(lse)),
                                      retain_graph=True)  # through O and the LSE
                  for outs in ((o, lse), (o_op, lse_op)))  # fmt: skip
    torch.testing.assert_close(fast, slow, atol=0, rtol=0)
    (dq,) = torch.autograd.grad(lse.sum(), q, retain_graph=True)  # the LSE alone: O's grad None
    (dq_op,) = torch.autograd.grad(lse_op.sum(), q)
    torch.testing.assert_close(dq, dq_op, atol=0, rtol=0)
    (g,) = torch.autograd.grad(o, q, do, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        g.sum().backward()


def test_backward_after_a_no_grad_forward_is_torchs_error() -> None:
    q, k, v = (rand(1, 1, 8, 16, dtype=torch.float32).requires_grad_() for _ in range(3))
    with torch.no_grad():
        out = flashlite.attention(q, k, v)
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_gradients_of_another_shape_or_dtype_are_refused() -> None:
    q, k, v = (rand(1, 2, 8, 16, dtype=torch.float32).requires_grad_() for _ in range(3))
    out = flashlite.attention(q, k, v)
    with pytest.raises(RuntimeError, match="shape"):  # autograd's own check
        out.backward(torch.ones(1, 2, 8, 15))
    # the op called directly: a clear error, not an out-of-bounds read
    o, lse = flashlite.attention(q.detach(), k.detach(), v.detach(), return_lse=True)
    bwd = torch.ops.flashlite.attention_bwd
    args = (q.detach(), k.detach(), v.detach(), o, lse)
    with pytest.raises(ValueError, match="do must match"):
        bwd(torch.ones_like(o).half(), *args, None, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="do must match"):
        bwd(torch.ones(1, 2, 7, 16), *args, None, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="dlse must match"):
        bwd(torch.ones_like(o), *args, torch.ones(1, 2, 9), causal=False, scale=0.25)


# --------------------------------------------------------------------------- GPU (compiled kernels)
def _gpu_case(q, k, v, causal, config=None):  # noqa: ANN001, ANN202
    """Largest gradient error of flashlite (optionally with a pinned backward config) and of
    PyTorch's own low-precision math attention, both against fp32 math on the GPU."""
    from flashlite.ops.attention import attention_bwd

    do = torch.randn_like(q)

    def grads(fn, *ts):  # noqa: ANN001, ANN202
        ts = [t.detach().clone().requires_grad_() for t in ts]
        fn(*ts).backward(do.to(ts[0].dtype))
        return [t.grad for t in ts]

    want = grads(lambda a, b, c: ref_attention(a, b, c, causal), q.float(), k.float(), v.float())
    torch_lp = grads(lambda a, b, c: ref_attention(a, b, c, causal), q, k, v)
    if config is None:
        got = grads(lambda a, b, c: flashlite.attention(a, b, c, causal=causal), q, k, v)
    else:
        o, lse = flashlite.attention(q, k, v, causal=causal, return_lse=True)
        got = attention_bwd(
            do,
            q,
            k,
            v,
            o,
            lse,
            None,
            Request.of_mask(describe(causal), q.shape[-1] ** -0.5),
            config=config,
        )
    for g, w, t in zip(got, want, torch_lp, strict=True):
        assert torch.isfinite(g).all()
        err = (g.float() - w).abs().max().item()
        torch_err = (t.float() - w).abs().max().item()
        assert err <= 2 * torch_err + TOL[q.dtype].floor * max(1.0, w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq,nk,d,hq,hkv",
    [
        (4096, 4096, 64, 2, 2),
        (2000, 3001, 128, 4, 2),
        (3001, 1000, 96, 2, 1),
        (16384, 16384, 128, 1, 1),
        (1024, 1024, 256, 2, 2),
    ],  # fmt: skip
)
def test_gpu_long(dtype, causal, nq, nk, d, hq, hkv) -> None:  # noqa: ANN001
    q = torch.randn(1, hq, nq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, hkv, nk, d, device="cuda", dtype=dtype) for _ in range(2))
    _gpu_case(q, k, v, causal)


def _backward_configs() -> list[C.BwdConfig]:
    return sorted({C.GPU_BWD_CONFIG, C.GPU_BWD_SMALL_CONFIG, C.CPU_BWD_CONFIG,
                   *C.HOPPER_BWD_CONFIGS.values()})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", _backward_configs(), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_backward_config(config: C.BwdConfig, d: int) -> None:
    # every config the library can pick, where it picks it: the big tiles for 16-bit inputs up
    # to D = 128, the small ones everywhere; ragged lengths, Nq != Nk, GQA, causal
    small = config in (C.GPU_BWD_SMALL_CONFIG, C.CPU_BWD_CONFIG)
    for dtype in (torch.bfloat16, torch.float32):
        if not small and (dtype == torch.float32 or d > 128):
            continue
        q = torch.randn(1, 2, 300, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, 1, 257, d, device="cuda", dtype=dtype) for _ in range(2))
        _gpu_case(q, k, v, True, config)


# --------------------------------------------------------------------------- fused Hopper backward
def test_fused_hopper_backward_only_takes_plain_backwards(monkeypatch: pytest.MonkeyPatch) -> None:
    # soft caps, per-batch lengths and pinned configs keep the Triton kernels even where the
    # fused Gluon kernel would run, and a plain window takes the fused flex kernel over its
    # band (the tables backend); a plain one (causal as a window too) asks for it, and a
    # launch that declines leaves the Triton kernels' answer
    import flashlite.ops.attention.bwd as ops
    from flashlite.ops.attention import attention_fwd

    calls, folded = [], []
    monkeypatch.setattr(ops, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(ops.planner, "hopper_bwd_applies", lambda *a: True)  # (the window's gate)
    monkeypatch.setattr(ops.hopper, "run_bwd", lambda *a: calls.append(a) or False)
    monkeypatch.setattr(ops, "window_bwd", lambda *a: folded.append(a[-1]) or a[1:4])
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    o, lse, _ = attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25))
    do = torch.randn_like(o)
    seqlens = torch.tensor([30], dtype=torch.int32)
    for mask, kwargs in ((describe(True, (8, 0)), {}), (describe(True, None, 5.0), {}),
                         (describe(True, (8, 0), 5.0), {}),
                         (CAUSAL, {"seqlens_k": seqlens}),
                         (describe(True, (8, 0)), {"seqlens_k": seqlens}),
                         (CAUSAL, {"config": C.CPU_BWD_CONFIG})):  # fmt: skip
        fields = {n: kwargs.pop(n) for n in list(kwargs) if n in Request._fields}
        ops.attention_bwd(
            do, q, k, v, o, lse, None, Request.of_mask(mask, 0.25, **fields), **kwargs
        )
    assert calls == [] and folded == [(128, 128)]  # the fused kernel's tiles
    want = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25), config=C.CPU_BWD_CONFIG
    )
    got = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    # causal written as a window is the same plan: decided once, at the first call
    again = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(describe(False, (-1, 0)), 0.25)
    )
    assert [c[-2] for c in calls] == [True]  # IS_CAUSAL reaches the launch
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


def test_fused_hopper_backward_is_only_chosen_where_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flashlite.kernels.attention import hopper_bwd as KHB
    from flashlite.ops.attention import HOPPER_ENV, hopper_bwd_applies

    cpu = rand(1, 2, 64, 128)
    assert not hopper_bwd_applies(*(cpu,) * 6)
    if not torch.cuda.is_available():
        return
    dev = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert not hopper_bwd_applies(*(dev.float(),) * 6)  # fp32
    assert not hopper_bwd_applies(*(dev[..., :96].contiguous(),) * 6)  # no such head dim
    runs_here = torch.cuda.get_device_capability()[0] == 9 and KHB.available()
    assert hopper_bwd_applies(*(dev,) * 6) == runs_here
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not hopper_bwd_applies(*(dev,) * 6)  # its dQ sums in no fixed order
    monkeypatch.undo()
    monkeypatch.setenv(HOPPER_ENV, "0")
    assert not hopper_bwd_applies(*(dev,) * 6)


def test_fused_hopper_backward_that_fails_to_build_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a Triton whose Gluon differs: one warning, then the Triton kernels give the answer
    import warnings

    import flashlite.ops.attention.bwd as ops
    from flashlite.ops.attention import attention_fwd

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute")

    monkeypatch.setattr(ops, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(ops.hopper, "plan_bwd_hopper", broken)
    monkeypatch.setattr(ops.hopper, "bwd_failed", set())
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    o, lse, _ = attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25))
    do = torch.randn_like(o)
    want = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25), config=C.CPU_BWD_CONFIG
    )
    with pytest.warns(RuntimeWarning, match="fused attention backward kernel failed"):
        got = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    assert not [w for w in seen if "fused Hopper" in str(w.message)]  # no second warning
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


_SM90_BWD_BUILD = """
import inspect, os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from flashlite.kernels.attention import hopper_bwd as H
from flashlite.ops.attention.backends import common_gluon as CG

d, causal = int(sys.argv[1]), sys.argv[2] == "1"
x = torch.empty(2, 4, 256, d, dtype=torch.bfloat16)
acc = torch.empty(2, 4, 256, d, dtype=torch.float32)
fn = H._attention_bwd_hopper_kernel
names = list(fn.arg_names)
descs = [CG.descriptor(x, H.BLOCK_M, d), CG.descriptor(x, H.BLOCK_M, d),
         CG.descriptor(x, H.BLOCK_N, d), CG.descriptor(x, H.BLOCK_N, d),
         CG.descriptor(acc, H.BLOCK_M, d // 2)]
sig = {n: mangle_type(t) for n, t in zip(names[:5], descs)}
sig.update(LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16", sm_scale="fp32")
consts = dict(STAGES=H.STAGES, GROUP_H=H.CAUSAL_GROUP_H, IS_CAUSAL=causal, LISTED=False,
              MASK_MOD=None, N_MASK_BUF=0, SCORE_MOD=None, SCORE_GRAD=None, N_SCORE_BUF=0,
              HAS_SCORE=False)
if sys.argv[4] == "1":  # block tables, a document-causal mask and ALiBi (flex_attention's call)
    from flashlite.masking import gallery
    mask = gallery.document_causal(torch.zeros(1, 256, dtype=torch.int32))
    score = gallery.alibi(gallery.alibi_slopes(4))
    tables = names[names.index("FULL_NUM"):names.index("MB0")]
    buffers = names[names.index("MB0"):names.index("SB3") + 1]
    sig.update({n: ("*i32" if n.isupper() else "i32") for n in tables})
    sig.update(dict(zip(buffers, ["*i32", "i32", "i32", "i32", "*fp32", "i32", "i32", "i32"])))
    consts.update(LISTED=True, MASK_MOD=mask.fn, N_MASK_BUF=2, SCORE_MOD=score.fn,
                  SCORE_GRAD=score.grad_fn, N_SCORE_BUF=1, HAS_SCORE=True)
# a constexpr not named above takes its default: never built as a runtime integer
consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts},
          **consts}
assert all(v is not inspect.Parameter.empty for v in consts.values()), consts
sig.update({n: "i32" for n in names if n not in sig and n not in consts})
sig.update(dict.fromkeys(consts, "constexpr"))
src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
from triton.backends.nvidia.compiler import get_ptxas

path = os.path.join(sys.argv[3], "k.ptx")
open(path, "w").write(k.asm["ptx"])
out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                     capture_output=True, text=True)
print("SHARED", k.metadata.shared)
print(out.stdout + out.stderr)
"""


@pytest.mark.parametrize("listed", [False, True], ids=["plain", "flex"])
def test_fused_hopper_backward_builds_for_sm90(listed: bool, tmp_path) -> None:  # noqa: ANN001
    # No GPU needed: Triton compiles the Gluon kernel for sm_90a and its ptxas reports. A code
    # change that breaks the build, outgrows shared memory or makes ptxas serialise the async
    # products (warnings C7513/C7514) fails here. (Its few spilled scalars depend on the Triton
    # version's compiler: 80 bytes with the 3.6 the H200 runs.) ``listed``: flex_attention's
    # variant over block tables, with a document-causal mask and ALiBi.
    import os
    import subprocess
    import sys

    from flashlite.kernels.attention import hopper_bwd as KHB

    if not KHB.available():
        pytest.skip("this Triton has no usable Gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    cmd = [sys.executable, "-c", _SM90_BWD_BUILD, "128", str(int(not listed)), str(tmp_path),
           str(int(listed))]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout
    assert "C7513" not in report and "C7514" not in report, report
    shared = int(report.split("SHARED", 1)[1].split()[0])
    assert shared <= 227 * 1024, shared  # an sm_90 block's most


def _needs_fused_hopper_backward() -> None:
    from flashlite.kernels.attention import hopper_bwd as KHB

    if torch.cuda.get_device_capability()[0] != 9 or not KHB.available():
        pytest.skip("the fused Gluon backward runs on sm_90 with Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,hq,hkv,layout", [
    (1024, 1024, 4, 2, "b h n d"),  # GQA
    (1000, 3001, 4, 1, "b h n d"),  # odd lengths (partial tiles, TMA padding), MQA
    (3001, 1000, 2, 2, "b h n d"),  # Nq > Nk: causal rows that see no key
    (129, 129, 2, 2, "b n h d"),  # transformers' layout (strided heads), one row past a block
    (1, 300, 2, 2, "b h n d"),  # one query row
])  # fmt: skip
def test_gpu_fused_hopper_backward(dtype, causal, d, nq, nk, hq, hkv, layout) -> None:  # noqa: ANN001
    # through the autograd op, with an LSE gradient too: within 2x PyTorch's own error
    from flashlite.ops.attention import hopper_bwd_applies

    _needs_fused_hopper_backward()
    shape = (lambda h, n: (2, h, n, d)) if layout == "b h n d" else (lambda h, n: (2, n, h, d))
    q = torch.randn(*shape(hq, nq), device="cuda", dtype=dtype)
    k, v = (torch.randn(*shape(hkv, nk), device="cuda", dtype=dtype) for _ in range(2))
    views = [t if layout == "b h n d" else t.transpose(1, 2) for t in (q, k, v)]
    assert hopper_bwd_applies(views[0], *views[1:], views[0], views[1], views[2])
    do = torch.randn_like(views[0])
    dlse = torch.randn(views[0].shape[:3], device="cuda")

    def grads(fn, *ts):  # noqa: ANN001, ANN202
        ts = [t.detach().clone().requires_grad_() for t in ts]
        o, lse = fn(*ts)
        # rows that see no key have LSE −inf: their gradient comes through the output only
        seen = torch.isfinite(lse)
        ((o.float() * do.float()).sum() + (lse.float() * dlse)[seen].sum()).backward()
        return [t.grad for t in ts]

    def ref(a, b, c):  # noqa: ANN001, ANN202
        return ref_attention(a, b, c, causal, return_lse=True)

    want = grads(ref, *(t.float() for t in views))
    torch_lp = grads(ref, *views)
    got = grads(lambda a, b, c: flashlite.attention(a, b, c, causal=causal, return_lse=True),
                *views)  # fmt: skip
    for g, w, t in zip(got, want, torch_lp, strict=True):
        assert torch.isfinite(g).all()
        err = (g.float() - w).abs().max().item()
        torch_err = (t.float().nan_to_num() - w).abs().max().item()
        assert err <= 2 * torch_err + TOL[dtype].floor * max(1.0, w.abs().max().item())


@pytest.mark.gpu
def test_gpu_deterministic_mode_keeps_the_triton_backward() -> None:
    # torch.use_deterministic_algorithms: the fused kernel's dQ sums in no fixed order, so the
    # two Triton kernels run, and two runs agree bit for bit
    from flashlite.ops.attention import attention_bwd, bwd_config

    _needs_fused_hopper_backward()
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    o, lse = flashlite.attention(q, k, v, causal=True, return_lse=True)
    do = torch.randn_like(o)
    pinned = attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5),
                           config=bwd_config(q.device, q.dtype, 128, True))  # fmt: skip
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [
            attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5))
            for _ in range(2)
        ]
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b, p in zip(*runs, pinned, strict=True):
        assert torch.equal(a, b) and torch.equal(a, p)
    fused = attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5))
    for f, p in zip(fused, pinned, strict=True):  # the fused one is close, not equal
        assert (f.float() - p.float()).abs().max() <= 2e-2 * p.float().abs().max()
