"""softmax over long rows: the default tables' split and looping paths, the team and prefetch
kernels (one chunk per row on the CPU, many rows on a GPU), and offsets past int32."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL
from softmax_helpers import DTYPES, FNS, NEG_INF, REFS, _assert_grad_close, _assert_matches

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
