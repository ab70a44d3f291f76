"""The front-ends as torch custom ops: registration, fakes, autograd, torch.compile.

Correctness under ``torch.compile`` is covered by the ``use_compile`` parametrisation of the
softmax and attention tests; this file checks the op machinery itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.library import opcheck

import flashlite

OPS = ("attention_fwd", "attention_bwd", "softmax_fwd", "softmax_bwd")


def _inputs(op: str, device: str, requires_grad: bool = False) -> tuple[tuple, dict]:
    """An op's arguments: positional, and by name (attention's request fields)."""
    if op.startswith("attention"):  # b h n d views, one of them strided (b n h d storage)
        q = torch.randn(2, 19, 4, 32, device=device).transpose(1, 2)
        k, v = (torch.randn(2, 2, 23, 32, device=device) for _ in range(2))
        fields = {"causal": True, "scale": 0.2}
        if op == "attention_fwd":
            return (q.requires_grad_(requires_grad), k, v), fields
        o, lse = flashlite.attention(q, k, v, causal=True, scale=0.2, return_lse=True)
        return (torch.randn_like(o), q, k, v, o, lse, torch.randn_like(lse)), fields
    x = torch.randn(3, 5, 37, device=device, requires_grad=requires_grad)
    if op == "softmax_fwd":
        return (x, 1, "auto", False), {}
    return (torch.softmax(x.detach(), 1), torch.randn_like(x.detach()), 1, True), {}


@pytest.mark.parametrize("op", OPS)
def test_registered_with_a_fake(op: str) -> None:
    packet = getattr(torch.ops.flashlite, op)
    assert packet.default.namespace == "flashlite"
    # the fake allocates exactly what the kernel writes (shape, dtype, strides)
    args, named = _inputs(op, "cpu")
    real = packet.default(*args, **named)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = packet.default(*fake_args, **named)
    for r, f in zip(*(t if isinstance(t, tuple) else (t,) for t in (real, fake)), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op: str, device: str) -> None:
    # schema, fake tensor, autograd registration and AOT dispatch (static and dynamic shapes)
    grad = op in ("softmax_fwd", "attention_fwd")
    opcheck(getattr(torch.ops.flashlite, op).default, *_inputs(op, device, grad))


CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda x: flashlite.softmax(x, -1),
    "log_softmax": lambda x: flashlite.log_softmax(x * 2, 1, algorithm="online"),
    "attention": lambda x: flashlite.attention(x, x, x, causal=True, layout="b n h d"),
    "attention_lse": lambda x: flashlite.attention(x, x, x, scale=0.5, return_lse=True)[1],
}


def _input(name: str, n: int = 24, requires_grad: bool = False) -> torch.Tensor:
    shape = (1, n, 2, 16) if name.startswith("attention") else (3, n)
    return torch.randn(shape, requires_grad=requires_grad)


@pytest.mark.parametrize("name", list(CALLS))
def test_no_graph_breaks(name: str) -> None:
    explained = torch._dynamo.explain(CALLS[name])(_input(name))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_compiled_forward_and_backward_fullgraph_dynamic(name: str) -> None:
    fn = CALLS[name]
    compiled = torch.compile(lambda x: fn(x).square().sum(), fullgraph=True, dynamic=True)
    for n in (24, 37, 100):  # new lengths reuse the dynamic graph
        x = _input(name, n, requires_grad=True)
        compiled(x).backward()
        xr = x.detach().double().requires_grad_()
        ref = {"softmax": lambda t: torch.softmax(t, -1),
               "log_softmax": lambda t: torch.log_softmax(t * 2, 1)}[name]  # fmt: skip
        ref(xr).square().sum().backward()
        assert x.grad is not None and xr.grad is not None
        torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["attention", "attention_lse"])
def test_compiled_attention_fullgraph_dynamic(name: str) -> None:
    compiled = torch.compile(CALLS[name], fullgraph=True, dynamic=True)
    for n in (24, 37, 100):
        x = _input(name, n)
        torch.testing.assert_close(compiled(x), CALLS[name](x), atol=0, rtol=0)


def test_compiled_attention_forward_and_backward() -> None:
    fn = CALLS["attention"]
    compiled = torch.compile(lambda x: fn(x).square().sum(), fullgraph=True, dynamic=True)
    for n in (24, 37):
        x = _input("attention", n, requires_grad=True)
        compiled(x).backward()
        xr = x.detach().clone().requires_grad_()
        fn(xr).square().sum().backward()
        assert x.grad is not None and xr.grad is not None
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_watchers_see_the_op() -> None:
    # eager calls skip torch's dispatcher only when nothing could tell the difference: under a
    # dispatch mode (FakeTensorMode, FlopCounterMode, traffic counting) the op is what runs
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, q = torch.randn(3, 10), torch.randn(1, 1, 5, 16)
    with Watch():
        flashlite.softmax(x)
        flashlite.attention(q, q, q)
    assert any("flashlite.softmax_fwd" in s for s in seen)
    assert any("flashlite.attention_fwd" in s for s in seen)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = flashlite.attention(*(torch.empty(2, 3, 7, 16) for _ in range(3)))
    assert out.shape == (2, 3, 7, 16)


def test_bodies_run_on_the_compute_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU tensors in a process that compiles its kernels run on the GPU: every tensor argument
    # moves there once, keyword arguments pass through, returned tensors come back
    from flashlite import _backend
    from flashlite.ops.common import on_compute_device

    seen: list[object] = []

    @on_compute_device
    def body(a: torch.Tensor, b: torch.Tensor | None, n: int, *, tag: str) -> tuple:
        seen.extend([a.device.type, b, n, tag])
        return torch.ones(2), None, n  # (meta tensors hold no data to copy back: a CPU one)

    # a stand-in: "meta" plays the GPU the kernels run on
    monkeypatch.setattr(_backend, "compute_device", lambda device: torch.device("meta"))
    out, none, n = body(torch.zeros(3), None, 7, tag="t")
    assert seen == ["meta", None, 7, "t"]
    assert out.device.type == "cpu" and out.tolist() == [1.0, 1.0] and none is None and n == 7
