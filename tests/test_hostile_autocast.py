"""Cross-entropy and linear cross-entropy under autocast: logits from an autocast product and
plain fp32 logits, fp32 losses and fp32 leaf gradients, eagerly and compiled.

Each case gives the right value (checked against torch or the fp64 reference) or raises a
clear error naming the argument; none may crash, read outside a tensor or return silent garbage.
Runs on CPU in the interpreter and, for the cases marked ``gpu``, on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL
from hostile_helpers import _ce_inputs, _ce_ref

import flashlite


def _autocast_linear_case(device: str, dtype: torch.dtype, reduction: str, use_bias: bool,
                          vocab: int | None, compiled: bool = False) -> None:  # fmt: skip
    # fp32 leaves under autocast: the products in `dtype`, the loss fp32, the gradients fp32 and
    # those of fp64 products of the operands rounded to `dtype`
    _, hidden, weight, bias, t, _ = _ce_inputs(seed=13, device=device)
    leaves = [a.clone().requires_grad_() for a in (hidden, weight, bias)]

    def step(h, w, b):  # noqa: ANN001, ANN202
        with torch.autocast(device, dtype=dtype):
            return flashlite.linear_cross_entropy(h, w, t, bias=b if use_bias else None,
                                                  reduction=reduction, label_smoothing=0.1,
                                                  z_loss=1e-3, chunk_size=4,
                                                  vocab_chunk_size=vocab)  # fmt: skip

    loss = (torch.compile(step, fullgraph=True) if compiled else step)(*leaves)
    assert loss.dtype == torch.float32
    # the products ran in `dtype`: the loss of the operands cast to it, without autocast
    cast = flashlite.linear_cross_entropy(hidden.to(dtype), weight.to(dtype), t,
                                          bias=bias.to(dtype) if use_bias else None,
                                          reduction=reduction, label_smoothing=0.1, z_loss=1e-3,
                                          chunk_size=4, vocab_chunk_size=vocab)  # fmt: skip
    torch.testing.assert_close(loss.detach(), cast, atol=1e-6, rtol=1e-6)
    upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    (loss * upstream.to(device)).sum().backward()
    refs = [a.to(dtype).double().requires_grad_() for a in (hidden, weight, bias)]
    logits = refs[0] @ refs[1].t() + (refs[2] if use_bias else 0.0)
    want = _ce_ref(logits, t, reduction=reduction, eps=0.1, z=1e-3)
    (want * upstream.double().to(device)).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), want, atol=4 * tol.atol, rtol=4 * tol.rtol)
    for leaf, ref in zip(leaves if use_bias else leaves[:2], refs, strict=False):
        assert leaf.grad.dtype == torch.float32
        scale = max(1.0, ref.grad.abs().max().item())
        torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=4 * tol.atol * scale,
                                   rtol=4 * tol.rtol)  # fmt: skip
    assert use_bias or leaves[2].grad is None


@pytest.mark.parametrize("vocab", [None, 16], ids=["whole-rows", "vocab-slices"])
@pytest.mark.parametrize("use_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_under_cpu_autocast_gives_fp32_loss_and_fp32_leaf_gradients(
    reduction: str, use_bias: bool, vocab: int | None
) -> None:
    _autocast_linear_case("cpu", torch.bfloat16, reduction, use_bias, vocab)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_under_cpu_autocast_compiles(reduction: str) -> None:
    _autocast_linear_case("cpu", torch.bfloat16, reduction, True, None, compiled=True)


def _autocast_ce_case(device: str, dtype: torch.dtype, v: int, compiled: bool = False) -> None:
    # logits from an autocast product (in `dtype`) and plain fp32 logits, both under autocast
    x, hidden, weight, _, t, _ = _ce_inputs(v=v, seed=17, device=device)
    leaves = [a.clone().requires_grad_() for a in (hidden, weight, x)]

    def step(h, w, x):  # noqa: ANN001, ANN202
        with torch.autocast(device, dtype=dtype):
            logits = h @ w.t()
            a = flashlite.cross_entropy(logits, t, label_smoothing=0.1)
            b = flashlite.cross_entropy(x, t, z_loss=1e-3, reduction="none")
        return logits.dtype, a, b

    logits_dtype, a, b = (torch.compile(step, fullgraph=True) if compiled else step)(*leaves)
    assert logits_dtype == dtype and a.dtype == b.dtype == torch.float32
    (a + b.sum()).backward()
    refs = [a.to(dtype).double().requires_grad_() for a in (hidden, weight)]
    ref_x = x.double().requires_grad_()
    want_a = _ce_ref(refs[0] @ refs[1].t(), t, eps=0.1)
    want_b = _ce_ref(ref_x, t, z=1e-3, reduction="none")
    (want_a + want_b.sum()).backward()
    low, fp32 = TOL[dtype], TOL[torch.float32]
    torch.testing.assert_close(a.double(), want_a, atol=4 * low.atol, rtol=4 * low.rtol)
    # the fp32 logits stay fp32: fp32's tolerance
    torch.testing.assert_close(b.double(), want_b, atol=fp32.atol, rtol=fp32.rtol)
    torch.testing.assert_close(leaves[2].grad.double(), ref_x.grad, atol=fp32.atol,
                               rtol=fp32.rtol)  # fmt: skip
    for leaf, ref in zip(leaves[:2], refs, strict=True):
        assert leaf.grad.dtype == torch.float32
        torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=4 * low.atol,
                                   rtol=4 * low.rtol)  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cross_entropy_under_cpu_autocast_takes_autocast_logits_and_plain_fp32_logits(
    compiled: bool,
) -> None:
    _autocast_ce_case("cpu", torch.bfloat16, 40, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_linear_and_plain_cross_entropy_under_cuda_autocast(dtype: torch.dtype) -> None:
    for reduction in ("mean", "none"):
        for use_bias in (False, True):
            _autocast_linear_case("cuda", dtype, reduction, use_bias, None)
        _autocast_linear_case("cuda", dtype, reduction, True, 16)
    _autocast_linear_case("cuda", dtype, "mean", True, None, compiled=True)
    for v in (40, 16384):  # the Triton kernel and, for 16k, the Gluon one where it runs
        _autocast_ce_case("cuda", dtype, v)
