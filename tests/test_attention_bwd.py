"""flashlite.attention's backward against fp64 autograd through reference.attention.

Rule (flash-attn's): each gradient's error against the fp64 one stays within 2x the error of
PyTorch's own math attention in the same low precision, plus a small floor (``TOL[dtype].floor``
scaled by the gradient's size). CPU runs the kernels in the interpreter with 16x16 tiles, so the
lengths below cover full, partial and several tiles.
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import DTYPES, rand
from conftest import TOL, maybe_compile

import flashlite
from flashlite.kernels import configs as C
from flashlite.masking.masks import CAUSAL
from flashlite.ops.attention import Request
from flashlite.reference import attention as ref_attention


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
