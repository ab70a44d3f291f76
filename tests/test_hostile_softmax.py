"""Hostile calls of softmax's backward: a dy of another shape or on another device, and the
backward differentiated again (double and triple backward).

Each case gives the right value (checked against torch or the fp64 reference) or raises a
clear error naming the argument; none may crash, read outside a tensor or return silent garbage.
Runs on CPU in the interpreter and, for the cases marked ``gpu``, on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL

import flashlite


def test_softmax_bwd_op_with_dy_of_another_shape_raises() -> None:
    y = flashlite.softmax(torch.randn(3, 5), -1)
    for dy in (torch.randn(3, 4), torch.randn(15), torch.randn(3, 5, 1)):
        with pytest.raises(ValueError, match="dy must have the shape"):
            torch.ops.flashlite.softmax_bwd(y, dy, -1, False)
    with pytest.raises(IndexError, match="dim=2"):
        torch.ops.flashlite.softmax_bwd(y, torch.randn(3, 5), 2, False)


def test_softmax_bwd_body_with_dy_on_another_device_raises() -> None:
    # the body's quick test for the usual dy compares devices by kind and index: a meta dy
    # (index -1, as a CPU tensor's) must not pass it
    from flashlite.ops.softmax import _softmax_backward

    y = flashlite.softmax(torch.randn(3, 5), -1)
    with pytest.raises(ValueError, match="dy must be on y's device"):
        _softmax_backward(y, torch.empty(3, 5, device="meta"), 1, False)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_double_backward_matches_torch(log, dim, dtype) -> None:  # noqa: ANN001
    # create_graph=True through the backward, then its gradients in x and in dy, against
    # torch's own double backward in fp64 on the same (rounded) inputs
    x, dy, w = (torch.randn(5, 7).to(dtype) for _ in range(3))

    def second(f, x, dy):  # noqa: ANN001, ANN202
        x, dy = x.clone().requires_grad_(), dy.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x, dim), x, dy, create_graph=True)
        return torch.autograd.grad((g * w.to(g.dtype)).sum(), (x, dy))

    ours = second(flashlite.log_softmax if log else flashlite.softmax, x, dy)
    want = second(torch.log_softmax if log else torch.softmax, x.double(), dy.double())
    tol = TOL[dtype]
    for got, ref in zip(ours, want, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, atol=4 * tol.atol, rtol=4 * tol.rtol)


def test_softmax_triple_backward_runs() -> None:
    # the second derivative is torch ops: differentiable again
    x = torch.randn(4, 6, requires_grad=True)
    (g,) = torch.autograd.grad(flashlite.softmax(x, -1)[:, 0].sum(), x, create_graph=True)
    (h,) = torch.autograd.grad((g * g).sum(), x, create_graph=True)
    (t,) = torch.autograd.grad(h.sum(), x)
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(torch.softmax(x64, -1)[:, 0].sum(), x64, create_graph=True)
    (h64,) = torch.autograd.grad((g64 * g64).sum(), x64, create_graph=True)
    (t64,) = torch.autograd.grad(h64.sum(), x64)
    torch.testing.assert_close(t.double(), t64, atol=1e-5, rtol=1e-4)
