"""Which kernels softmax launches on each path, forward and backward, and the block tables
behind the choice: a row kept on chip, short rows packed per program, team chunks widened."""

from __future__ import annotations

import pytest
import torch
from softmax_helpers import PATHS

import flashlite
from flashlite.kernels import softmax as ksm


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
