"""flashlite.softmax / log_softmax against an fp64 torch reference, on every kernel path.

Kernels run in Triton's interpreter on CPU, so the block tables are shrunk with monkeypatch to
reach the long-row paths (split, multi-tile loops, looping backward) with rows of a few dozen
elements. Each path fixture names the kernels it exercises.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import maybe_compile
from softmax_helpers import (
    DTYPES,
    FNS,
    NEG_INF,
    PATHS,
    REFS,
    _assert_grad_close,
    _assert_matches,
    _grads,
)

import flashlite
from flashlite.kernels import softmax as ksm


@pytest.fixture(params=list(PATHS))
def algorithm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Shrink the block tables for the path and return the algorithm argument that reaches it."""
    algo, overrides = PATHS[request.param]
    for name, value in overrides.items():
        monkeypatch.setattr(ksm, name, value)
    return algo


# --------------------------------------------------------------------------- accuracy
SHAPES = [
    (1, 1),  # one element
    (3, 1),  # length-1 rows: softmax is 1, log_softmax 0
    (5, 7),  # non-power-of-two, one ragged tile everywhere
    (3, 37),  # split: 5 chunks, ragged last; loops: 5 tiles, ragged last
    (2, 64),  # exact multiple of chunk and tile
    (4, 130),  # split: 17 chunks (CHUNKS_PAD 32)
]


# every shape and dtype eager; compiled for two shapes in fp32 and bf16 (the same graph
# otherwise: 72 compiled variants added ~25 s to CI)
@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize(
    ("shape", "dtype", "use_compile"),
    [*((s, d, False) for s in SHAPES for d in DTYPES),
     *((s, d, True) for s in [(1, 1), (4, 130)] for d in (torch.float32, torch.bfloat16))],
    ids=lambda v: ("compiled" if v else "eager") if isinstance(v, bool) else str(v),
)  # fmt: skip
def test_matches_reference(
    algorithm: str, shape: tuple[int, int], dtype: torch.dtype, op: str, use_compile: bool
) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    _assert_matches(maybe_compile(FNS[op], use_compile)(x, algorithm=algorithm), x, -1, op)


@pytest.mark.parametrize("op", list(FNS))
def test_zero_dim_tensor(op: str) -> None:
    x = torch.tensor(2.5, requires_grad=True)
    for dim in (0, -1):
        y = FNS[op](x, dim)
        assert y.shape == () and y.item() == REFS[op](x.detach(), dim).item()
    y.backward()
    assert x.grad is not None and x.grad.shape == () and x.grad.item() == 0.0


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize(
    ("shape", "dim"), [((0, 5), -1), ((3, 0), -1), ((3, 0), 0), ((2, 0, 4), 1)]
)
def test_empty(shape: tuple[int, ...], dim: int, op: str) -> None:
    x = torch.randn(shape, requires_grad=True)
    y = FNS[op](x, dim)
    assert y.shape == REFS[op](x.detach(), dim).shape == x.shape
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("algorithm", ["auto", "online"], indirect=False)
@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5)])
def test_every_dim(shape: tuple[int, ...], op: str, algorithm: str, use_compile: bool) -> None:
    x = torch.randn(shape)
    fn = maybe_compile(FNS[op], use_compile)
    for dim in range(-len(shape), len(shape)):
        _assert_matches(fn(x, dim, algorithm=algorithm), x, dim, op)


NON_CONTIGUOUS: dict[str, Callable[[], tuple[torch.Tensor, int]]] = {
    # rows along a strided column: stride_xn = 9
    "transposed": lambda: (torch.randn(9, 6).t(), -1),
    "transposed_dim0": lambda: (torch.randn(9, 6).t(), 0),
    "step_slice": lambda: (torch.randn(6, 40)[::2, 1::3], -1),
    "expanded_rows": lambda: (torch.randn(1, 11).expand(4, 11), -1),  # row stride 0
    "expanded_cols": lambda: (torch.randn(3, 1).expand(3, 12), -1),  # column stride 0
    # leading dims that cannot merge into one row index: the front-end copies
    "no_row_view": lambda: (torch.randn(4, 5, 6).transpose(0, 1), -1),
    "permuted_4d": lambda: (torch.randn(2, 3, 4, 5).permute(3, 1, 0, 2), 2),
}


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("case", list(NON_CONTIGUOUS))
def test_non_contiguous(algorithm: str, case: str, op: str, use_compile: bool) -> None:
    x, dim = NON_CONTIGUOUS[case]()
    _assert_matches(maybe_compile(FNS[op], use_compile)(x, dim, algorithm=algorithm), x, dim, op)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values(algorithm: str, dtype: torch.dtype, op: str) -> None:
    x = torch.randn(3, 37) * 1e4  # ±1e4 spread: most probabilities underflow to 0
    x[1] = 1e4 + torch.randn(37)  # close values around 1e4: x − m must stay exact
    x[2] = -1e4 + torch.randn(37)
    x = x.to(dtype)
    _assert_matches(FNS[op](x, algorithm=algorithm), x, -1, op)


@pytest.mark.parametrize("op", list(FNS))
def test_fp16_near_max(algorithm: str, op: str) -> None:
    top = torch.tensor(65504.0, dtype=torch.float16)
    # the largest fp16 values and their negatives (spacing 32 up there)
    x = torch.stack([top - 32 * torch.arange(37), -(top - 32 * torch.arange(37))]).to(torch.float16)
    y = FNS[op](x, algorithm=algorithm)
    assert torch.isfinite(y[0]).all() if op == "log_softmax" else not torch.isnan(y).any()
    _assert_matches(y, x, -1, op)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_some_neg_inf(algorithm: str, dtype: torch.dtype, op: str) -> None:
    x = torch.randn(4, 37)
    x[0, ::3] = NEG_INF
    x[1, :20] = NEG_INF  # whole leading chunks / tiles are -inf, later ones are not
    x[2, 17:] = NEG_INF  # whole trailing chunks / tiles are -inf
    x[3, 5] = NEG_INF
    x = x.to(dtype)
    y = FNS[op](x, algorithm=algorithm)
    masked = x == NEG_INF
    if op == "softmax":
        assert (y[masked] == 0).all()  # exact zeros, not tiny values
    else:
        assert (y[masked] == NEG_INF).all()
    assert not torch.isnan(y).any()
    _assert_matches(y, x, -1, op)


@pytest.mark.parametrize("op", list(FNS))
def test_all_neg_inf_row_is_nan_like_torch(algorithm: str, op: str) -> None:
    x = torch.randn(3, 37)
    x[1] = NEG_INF
    y = FNS[op](x, algorithm=algorithm)
    ref = REFS[op](x, -1)
    assert torch.isnan(ref[1]).all()  # torch's convention, for softmax and log_softmax alike
    assert torch.isnan(y[1]).all()
    _assert_matches(y[::2], x[::2], -1, op)  # other rows unaffected


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (3, 37)])
def test_backward(
    algorithm: str, shape: tuple[int, int], dtype: torch.dtype, op: str, use_compile: bool
) -> None:
    x = torch.randn(shape).to(dtype)
    dy = torch.randn(shape).to(dtype)
    fn = maybe_compile(FNS[op], use_compile)
    dx = _grads(lambda t, d: fn(t, d, algorithm=algorithm), x, dy, -1)
    _assert_grad_close(dx, x, dy, op)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_neg_inf(algorithm: str, dtype: torch.dtype, op: str) -> None:
    x = torch.randn(3, 37)
    x[0, ::3] = NEG_INF
    x[1, :20] = NEG_INF
    x, dy = x.to(dtype), torch.randn(3, 37).to(dtype)
    dx = _grads(lambda t, d: FNS[op](t, d, algorithm=algorithm), x, dy, -1)
    masked = x == NEG_INF
    # softmax: y = 0 there, so no gradient; log_softmax: e^z = 0, so dx = dy
    assert torch.equal(dx[masked], torch.zeros_like(dx[masked]) if op == "softmax" else dy[masked])
    _assert_grad_close(dx, x, dy, op)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize(("shape", "dim"), [((3, 37), -1), ((2, 37, 3), 1), ((4, 5, 6), 0)])
def test_backward_sum_gives_expanded_grad(
    algorithm: str, shape: tuple[int, ...], dim: int, op: str
) -> None:
    x = torch.randn(shape)
    xr = x.clone().requires_grad_(True)
    FNS[op](xr, dim, algorithm=algorithm).sum().backward()  # dy: ones with every stride 0
    xd = x.double().requires_grad_(True)
    REFS[op](xd, dim).sum().backward()
    assert xr.grad is not None and xd.grad is not None
    torch.testing.assert_close(xr.grad.double(), xd.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", list(FNS))
def test_eager_autograd_skips_the_dispatcher_and_matches_the_op(op: str) -> None:
    """In eager autograd the front-end records its own autograd function (no custom-op
    dispatcher: host time); the op, taken under a dispatch mode, gives the same gradient, and a
    second derivative goes through the op's registered double backward (torch's own values)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(4, 37, requires_grad=True)
    dy = torch.randn(4, 37)
    y = FNS[op](x, -1)
    assert type(y.grad_fn).__name__ == "SoftmaxFwdFunctionBackward"
    (fast,) = torch.autograd.grad(y, x, dy)
    with FlopCounterMode(display=False):  # a dispatch mode watches: the custom op's path
        y_op = FNS[op](x, -1)
    assert "SoftmaxFwdFunction" not in type(y_op.grad_fn).__name__
    (slow,) = torch.autograd.grad(y_op, x, dy)
    torch.testing.assert_close(y, y_op, atol=0, rtol=0)
    torch.testing.assert_close(fast, slow, atol=0, rtol=0)
    (g,) = torch.autograd.grad(FNS[op](x, -1), x, dy, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(REFS[op](x64, -1), x64, dy.double(), create_graph=True)
    (gg64,) = torch.autograd.grad(g64.sum(), x64)
    torch.testing.assert_close(gg.double(), gg64, atol=1e-5, rtol=1e-5)


def test_backward_non_contiguous(algorithm: str) -> None:
    x = torch.randn(37, 4).t()  # strided rows
    dy = torch.randn(8, 37)[::2]  # strided dy
    for op, fn in FNS.items():
        dx = _grads(lambda t, d, f=fn: f(t, d, algorithm=algorithm), x, dy, -1)
        ref = _grads(REFS[op], x.double(), dy.double(), -1)
        torch.testing.assert_close(dx.double(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- properties
def test_rows_sum_to_one(algorithm: str) -> None:
    x = torch.randn(6, 37) * 5
    y = flashlite.softmax(x, algorithm=algorithm)
    torch.testing.assert_close(y.sum(-1), torch.ones(6), atol=1e-6, rtol=0)
    assert (y >= 0).all()
    lse = torch.logsumexp(flashlite.log_softmax(x, algorithm=algorithm).double(), -1)
    torch.testing.assert_close(lse, torch.zeros(6, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("shift", [-1024.0, 3.0, 4096.0])
def test_shift_invariance(algorithm: str, shift: float, op: str) -> None:
    # eighths in [-8, 8) stay exact after the shift, so both inputs hold the same logits
    x = torch.randint(-64, 64, (4, 37)).float() / 8
    y, y_shifted = (FNS[op](t, algorithm=algorithm) for t in (x, x + shift))
    if op == "log_softmax":
        torch.testing.assert_close(y_shifted, y, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(y_shifted, y, atol=1e-7, rtol=1e-5)


def test_log_softmax_is_log_of_softmax(algorithm: str) -> None:
    x = torch.randn(4, 37) * 4
    y = flashlite.softmax(x, algorithm=algorithm)
    z = flashlite.log_softmax(x, algorithm=algorithm)
    torch.testing.assert_close(z.exp(), y, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("fn", list(FNS.values()), ids=list(FNS))
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": torch.arange(4)}, TypeError, r"^x has dtype torch\.int64"),
        ({"x": torch.ones(4, dtype=torch.bool)}, TypeError, r"^x has dtype torch\.bool"),
        ({"x": torch.ones(4, dtype=torch.float64)}, TypeError, r"^x has dtype torch\.float64"),
        ({"x": [1.0, 2.0]}, TypeError, r"^x must be a torch\.Tensor, got list"),
        ({"x": torch.ones(2, 3), "dim": 2}, IndexError, r"^dim=2 is out of range"),
        ({"x": torch.ones(2, 3), "dim": -3}, IndexError, r"^dim=-3 is out of range"),
        ({"x": torch.tensor(1.0), "dim": 1}, IndexError, r"^dim=1 is out of range"),
        ({"x": torch.ones(2, 3), "dim": 1.0}, TypeError, r"^dim must be an int, got float"),
        ({"x": torch.ones(2, 3), "dim": True}, TypeError, r"^dim must be an int, got bool"),
        ({"x": torch.ones(2, 3), "dim": None}, TypeError, r"^dim must be an int"),
        ({"x": torch.ones(2, 3), "algorithm": "fast"}, ValueError, r"^algorithm='fast'"),
        ({"x": torch.ones(2, 3), "algorithm": "split"}, ValueError, r"^algorithm='split'"),
        ({"x": torch.ones(2, 3, device="meta")}, ValueError, r"^x is on device meta"),
    ],
)
def test_bad_input(fn: Callable, kwargs: dict, error: type[Exception], match: str) -> None:
    kwargs = dict(kwargs)
    x = kwargs.pop("x")
    with pytest.raises(error, match=match):
        fn(x, **kwargs)
