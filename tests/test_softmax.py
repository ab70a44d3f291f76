"""flashlite.softmax / log_softmax against an fp64 torch reference, on every kernel path.

Kernels run in Triton's interpreter on CPU, so the block tables are shrunk with monkeypatch to
reach the long-row paths (split, multi-tile loops, looping backward) with rows of a few dozen
elements. Each path fixture names the kernels it exercises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from conftest import TOL, maybe_compile

import flashlite
from flashlite.kernels import softmax as ksm

NEG_INF = -math.inf
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FNS = {"softmax": flashlite.softmax, "log_softmax": flashlite.log_softmax}
REFS = {"softmax": torch.softmax, "log_softmax": torch.log_softmax}

# path id -> (algorithm, block-table overrides). Rows of n elements take the path when
# next_pow2(n) > 16 for "split"; the looping paths tile every n > 8.
PATHS: dict[str, tuple[str, dict[str, int]]] = {
    # auto, row fits on chip: single-read forward, one-tile backward
    "single_read": ("auto", {}),
    # auto, row "too long" (SINGLE_READ_MAX=16): split forward with 8-column chunks and a
    # CHUNKS_PAD > n_chunks merge; backward takes the looping two-pass path with 8-wide tiles
    "split": ("auto", {"SINGLE_READ_MAX": 16, "SPLIT_CHUNK": 8, "LOOP_TILE": 8}),
    # online forward over 8-wide tiles (several tiles, ragged last one); one-tile backward
    "online": ("online", {"LOOP_TILE": 8}),
    # three_pass forward over 8-wide tiles; one-tile backward
    "three_pass": ("three_pass", {"LOOP_TILE": 8}),
}


@pytest.fixture(params=list(PATHS))
def algorithm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Shrink the block tables for the path and return the algorithm argument that reaches it."""
    algo, overrides = PATHS[request.param]
    for name, value in overrides.items():
        monkeypatch.setattr(ksm, name, value)
    return algo


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the kernels launched during the test, in order."""
    names: list[str] = []

    class Spy:
        def __init__(self, name: str, kernel: object) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: object) -> object:
            names.append(self.name)
            return self.kernel[grid]  # type: ignore[index]

    for name in dir(ksm):
        if name.startswith("_softmax_") and name.endswith("_kernel"):
            monkeypatch.setattr(ksm, name, Spy(name, getattr(ksm, name)))
    return names


def _reference(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    return REFS[op](x.double(), dim)


def _assert_matches(y: torch.Tensor, x: torch.Tensor, dim: int, op: str) -> None:
    assert y.dtype == x.dtype and y.shape == x.shape
    atol, rtol = TOL[x.dtype][:2]
    torch.testing.assert_close(y.double(), _reference(x, dim, op), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize(
    ("path", "n", "fwd", "bwd"),
    [
        ("single_read", 37, ["_softmax_single_read_fwd_kernel"], True),
        ("split", 37, ["_softmax_split_stats_kernel", "_softmax_split_write_kernel"], False),
        ("split", 9, ["_softmax_single_read_fwd_kernel"], True),  # short rows still fit
        ("online", 37, ["_softmax_online_fwd_kernel"], True),
        ("three_pass", 37, ["_softmax_online_fwd_kernel"], True),
    ],
)
def test_dispatch(
    path: str,
    n: int,
    fwd: list[str],
    bwd: bool,
    launched: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    algo, overrides = PATHS[path]
    for name, value in overrides.items():
        monkeypatch.setattr(ksm, name, value)
    x = torch.randn(2, n, requires_grad=True)
    flashlite.softmax(x, algorithm=algo).sum().backward()
    assert launched == [*fwd, "_softmax_bwd_kernel"]
    one_tile = triton_next_pow2(n) <= ksm.SINGLE_READ_MAX
    assert one_tile == bwd


def test_backward_keeps_a_row_on_chip_only_when_y_and_dy_both_fit() -> None:
    # the forward holds one row, the backward two (y and dy) as fp32 values: 16-bit rows of 64k
    # are one tile forward but loop backward; 32k rows stay one tile in both dtypes
    assert ksm.fits_single_read(65536, 2) and not ksm.fits_single_read(65536, 2, tensors=2)
    assert ksm.fits_single_read(32768, 4, tensors=2) and ksm.fits_single_read(32768, 2, 2)
    assert not ksm.fits_single_read(65536, 4) and not ksm.fits_single_read(65537, 2)
    assert not ksm.fits_single_read(131072, 1)


def test_single_read_packs_short_rows_per_element_size() -> None:
    # short rows share a program up to ELEMS_PER_PROGRAM elements (16-bit: 2048, fp32: 4096);
    # a row that long or longer has a program of its own
    assert ksm.single_read_config(1000, 2) == {"ROWS": 2, "BLOCK_N": 1024, "num_warps": 4}
    assert ksm.single_read_config(1000, 4) == {"ROWS": 4, "BLOCK_N": 1024, "num_warps": 8}
    assert ksm.single_read_config(3, 2)["ROWS"] == 512
    for elem in (2, 4):
        assert ksm.single_read_config(4096, elem)["ROWS"] == 1
        assert ksm.single_read_config(16384, elem) == {"ROWS": 1, "BLOCK_N": 16384,
                                                      "num_warps": 32}  # fmt: skip


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("n", [65536, 262144, 1 << 20, 3_000_000, 1 << 22])
def test_team_chunks_widen_for_rows_too_long_for_a_team(n: int, elem: int) -> None:
    # a team never passes TEAM_MAX_PROGRAMS programs (so it fits the GPU with room to spare):
    # longer rows take wider chunks with more warps, the same values per thread
    cfg = ksm.team_config(n, elem)
    assert cfg["n_chunks"] * cfg["BLOCK_N"] >= n > (cfg["n_chunks"] - 1) * cfg["BLOCK_N"]
    chunk, warps = ksm.TEAM_CHUNK_BYTES[elem], ksm.TEAM_WARPS[elem]
    assert cfg["BLOCK_N"] // cfg["num_warps"] == chunk // elem // warps
    if n * elem <= ksm.TEAM_MAX_PROGRAMS * chunk:
        assert cfg["BLOCK_N"] * elem == chunk
    else:
        assert cfg["n_chunks"] <= ksm.TEAM_MAX_PROGRAMS and cfg["num_warps"] <= 32


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


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


# --------------------------------------------------------------------------- gradients
def _grads(fn: Callable, x: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    xr = x.detach().clone().requires_grad_(True)
    fn(xr, dim).backward(dy)
    assert xr.grad is not None
    return xr.grad


def _assert_grad_close(dx: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, op: str) -> None:
    """fp32: close to the fp64 gradient. fp16/bf16: the saved output is rounded to the input
    dtype (as in torch), and log_softmax's ``dy − e^z Σdy`` multiplies that rounding by a row
    sum, so the bound is the flash-attention one: at most 2x torch's own error plus atol."""
    assert dx.dtype == x.dtype
    ref = _grads(REFS[op], x.double(), dy.double(), -1)
    atol, rtol = TOL[x.dtype][:2]
    if x.dtype == torch.float32:
        torch.testing.assert_close(dx.double(), ref, atol=atol, rtol=rtol)
        return
    torch_err = (_grads(REFS[op], x, dy, -1).double() - ref).abs().max().item()
    err = (dx.double() - ref).abs().max().item()
    assert err <= 2 * torch_err + atol, f"max error {err:.3g}, torch's {torch_err:.3g}"


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


# --------------------------------------------------------------------------- GPU only
# Real block tables (no monkeypatch): auto splits rows of next_pow2(n) > 32768 into 8192-column
# chunks; the backward loops over 4096-wide tiles. One CPU case keeps the default tables tested.
# On CPU (the interpreter, ~2 s a case) auto only: online and three_pass loop over the same
# tiles as in the small-tile tests above.
LONG = [
    pytest.param("cpu", 65536 + 13, "auto", id="cpu-65549-auto"),
    *(pytest.param("cuda", n, algo, id=f"cuda-{n}-{algo}", marks=pytest.mark.gpu)
      for n in (65536, 262144, 262144 + 13) for algo in ("auto", "online", "three_pass")),
]  # fmt: skip


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("device", "n", "algo"), LONG)
def test_long_rows(device: str, n: int, dtype: torch.dtype, algo: str, op: str) -> None:
    x = (torch.randn(3, n, device=device) * 4).to(dtype).requires_grad_(True)
    y = FNS[op](x, algorithm=algo)
    atol, rtol = TOL[dtype][:2]
    torch.testing.assert_close(y.double(), REFS[op](x.detach().double(), -1), atol=atol, rtol=rtol)
    dy = torch.randn_like(y)
    y.backward(dy)  # long rows take the looping backward
    _assert_grad_close(x.grad, x.detach(), dy, op)


def _team_rows(n_rows: int, n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows with the nasty cases: huge values, -inf entries, one row all -inf (NaN, as torch)."""
    x = torch.randn(n_rows, n, device=device) * 4
    x[1, ::3] = NEG_INF
    x[2, min(5, n - 1)] = 1e4
    x[3] = NEG_INF
    return x.to(dtype)


@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 37, 1000])
def test_team_kernel_with_one_chunk_per_row(n: int, dtype: torch.dtype, op: str) -> None:
    # The interpreter runs programs one after another, so the team kernel runs on CPU only with
    # one program per row (it waits for no other program); three teams take turns over 8 rows.
    from flashlite.ops.softmax import softmax_fwd

    x = _team_rows(8, n, dtype, "cpu")
    y = torch.empty_like(x)
    softmax_fwd(x, y, op == "log_softmax", "team")
    atol, rtol = TOL[dtype][:2]
    want = REFS[op](x.double(), -1)
    torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol, equal_nan=True)


def test_team_kernel_refuses_chunked_rows_on_cpu() -> None:
    from flashlite.ops.softmax import softmax_fwd

    x = torch.randn(2, 65536)
    with pytest.raises(ValueError, match="need a CUDA device"):
        softmax_fwd(x, torch.empty_like(x), False, "team")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [65536 + 13, 262144])
def test_team_kernel_on_many_rows(n: int, dtype: torch.dtype, op: str) -> None:
    # more rows than teams: each team takes several rows in turn, every row shared by several
    # programs
    from flashlite.ops.softmax import softmax_fwd

    x = _team_rows(4096 * 1024 // n * 8, n, dtype, "cuda")
    y = torch.empty_like(x)
    softmax_fwd(x, y, op == "log_softmax", "team")
    atol, rtol = TOL[dtype][:2]
    want = REFS[op](x.double(), -1)
    torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_rows", "n", "pad"),
    [(1, 65536, 0), (997, 65536, 0), (301, 262144, 0), (64, 65536 + 8, 0), (40, 40000, 24),
     (5, 8, 0)],
)  # fmt: skip
def test_prefetch_kernel(n_rows: int, n: int, pad: int, dtype: torch.dtype, op: str) -> None:
    # The Gluon team kernel that prefetches the next row into shared memory: one row, more
    # rows than teams (an odd count), a ragged last chunk, rows strided (pad columns between
    # rows), a row shorter than one chunk; twice, since the kernel leaves its counters at zero
    # for the next launch.
    from flashlite.ops.prefetch import prefetch_applies
    from flashlite.ops.softmax import softmax_fwd

    base = _team_rows(max(n_rows, 4), n + pad, dtype, "cuda")[:n_rows]
    x = base[:, :n]
    y = torch.full_like(x, 7.0)
    if not prefetch_applies(x, y):
        pytest.skip("the prefetch kernel needs Gluon on a CUDA sm_80+ device")
    atol, rtol = TOL[dtype][:2]
    want = REFS[op](x.double(), -1)
    for _ in range(2):
        softmax_fwd(x, y, op == "log_softmax", "prefetch")
        torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(FNS))
def test_prefetch_kernel_through_the_op_and_compiled(op: str) -> None:
    # auto takes the prefetch kernel for these rows on a GPU with Gluon: the custom op passes
    # opcheck there, and torch.compile(fullgraph) gives the eager result
    from torch.library import opcheck

    from flashlite.ops.prefetch import prefetch_applies

    x = torch.randn(6, 65536, device="cuda", dtype=torch.bfloat16) * 3
    if not prefetch_applies(x, x):
        pytest.skip("the prefetch kernel needs Gluon on a CUDA sm_80+ device")
    log = op == "log_softmax"
    opcheck(torch.ops.flashlite.softmax_fwd.default, (x.requires_grad_(), 1, "auto", log))
    eager = FNS[op](x)
    compiled = torch.compile(FNS[op], fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    _assert_matches(eager, x.detach(), -1, op)


def test_prefetch_kernel_is_gpu_only() -> None:
    from flashlite.ops.prefetch import prefetch_applies
    from flashlite.ops.softmax import softmax_fwd

    x = torch.randn(2, 65536)
    assert not prefetch_applies(x, x)
    with pytest.raises(ValueError, match="prefetch kernel needs a GPU"):
        softmax_fwd(x, torch.empty_like(x), False, "prefetch")


# Offsets past 2^31: x lives in a 4 GiB buffer of which only a few rows are touched. On the CPU
# the untouched pages are never committed (and the interpreter runs the real int64 arithmetic),
# so these are cheap there too.
BIG_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def _big_buffer(numel: int, device: str) -> torch.Tensor:
    if device == "cuda" and torch.cuda.mem_get_info()[0] < 9 * 2**30:
        pytest.skip("needs ~9 GiB of free GPU memory")
    try:
        return torch.empty(numel, device=device, dtype=torch.bfloat16)
    except RuntimeError as exc:  # CPU without overcommit
        pytest.skip(f"cannot allocate a 4 GiB buffer: {exc}")


@pytest.mark.parametrize("device", BIG_DEVICES)
@pytest.mark.parametrize("algo", ["auto", "online", "three_pass"])
def test_column_offsets_past_int32(algo: str, device: str) -> None:
    # x = base.t(): column stride 2^15, so (n_cols − 1)·stride_n = 2^31 needs 64-bit offsets
    n_cols, stride = 2**16 + 1, 2**15
    base = _big_buffer(n_cols * stride, device).view(n_cols, stride)
    x = base.t()[:2]
    x.copy_(torch.randn(2, n_cols, device=device))
    assert (n_cols - 1) * x.stride(1) >= 2**31
    atol, rtol = TOL[torch.bfloat16][:2]
    for op, fn in FNS.items():
        y = fn(x, algorithm=algo)
        torch.testing.assert_close(y.double(), REFS[op](x.double(), -1), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", BIG_DEVICES)
def test_row_offsets_past_int32(device: str) -> None:
    # rows 2^30 elements apart: row 2 starts at element 2^31
    base = _big_buffer(2**31 + 4096, device)
    x = base.as_strided((3, 4096), (2**30, 1))
    x.copy_(torch.randn(3, 4096, device=device))
    atol, rtol = TOL[torch.bfloat16][:2]
    for algo in ("auto", "online", "three_pass"):
        for op, fn in FNS.items():
            y = fn(x, algorithm=algo)
            torch.testing.assert_close(y.double(), REFS[op](x.double(), -1), atol=atol, rtol=rtol)
