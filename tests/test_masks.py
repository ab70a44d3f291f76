"""flashlite.masks: the jit helpers and their torch twins agree, and mean what the docs say."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashlite import _backend
from flashlite.masks import (
    key_range,
    query_range,
    torch_key_range,
    torch_query_range,
    torch_visible,
    visible,
    visible_t,
)
from flashlite.ops.attention import _tuned_kernel


@triton.jit
def _masks_kernel(RANGE, SEEN, seq_q, seq_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    full_hi, hi = key_range(pid * BLOCK_M, seq_q, seq_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    tl.store(RANGE + 2 * pid + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, full_hi, hi))
    if pid == 0:
        rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
        seen = visible(rows, cols, seq_q, seq_k, IS_CAUSAL)
        tl.store(SEEN + rows[:, None] * COLS + cols[None, :], seen.to(tl.int8))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (40, 13), (13, 40), (5, 64), (64, 5)])
def test_helpers_match_their_twins(nq: int, nk: int, causal: bool) -> None:
    dev = _backend.compute_device(torch.device("cpu"))
    bm, bn = 16, 8
    n_blocks = triton.cdiv(nq, bm)
    ranges = torch.empty(n_blocks, 2, dtype=torch.int32, device=dev)
    seen = torch.empty(64, 64, dtype=torch.int8, device=dev)
    _masks_kernel[(n_blocks,)](ranges, seen, nq, nk, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=causal,
                               ROWS=64, COLS=64)  # fmt: skip
    for block in range(n_blocks):
        want = torch_key_range(block * bm, bm, bn, nq, nk, causal)
        assert tuple(ranges[block].tolist()) == want
    rows = torch.arange(64, device=dev)
    twin = torch_visible(nq, nk, causal, rows=rows)  # (64, Nk)
    assert torch.equal(seen[:, :nk].bool(), twin) and not seen[:, nk:].any()


@pytest.mark.parametrize("nq,nk", [(7, 7), (10, 4), (4, 10), (1, 33)])
def test_key_range_covers_exactly_the_visible_keys(nq: int, nk: int) -> None:
    mask = torch_visible(nq, nk, True)
    assert torch.equal(mask.sum(1), (torch.arange(nq) + nk - nq + 1).clamp(0, nk))
    for bm, bn in ((1, 1), (4, 2), (16, 16)):
        for start in range(0, nq, bm):
            full_hi, hi = torch_key_range(start, bm, bn, nq, nk, True)
            block = mask[start : start + bm]
            assert full_hi % bn == 0 and 0 <= full_hi <= hi <= nk
            assert block[:, :full_hi].all()  # unmasked tiles: every row sees every key
            assert not block[:, hi:].any()  # keys from hi on are never needed


def test_autotuning_is_per_length_bucket_not_per_length() -> None:
    # a decoding or varlen loop over 100 lengths gets a handful of autotuners, not 100
    tuners = {id(_tuned_kernel(1, nk)) for nk in range(100, 200)}
    assert len(tuners) <= 2
    assert _tuned_kernel(1, 129) is _tuned_kernel(1, 255)


@triton.jit
def _query_range_kernel(OUT, SEEN_T, seq_q, seq_k, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, ROWS: tl.constexpr,
                        COLS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    lo, full_lo = query_range(pid * BLOCK_N, seq_q, seq_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    tl.store(OUT + 2 * pid + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, lo, full_lo))
    if pid == 0:
        cols, rows = tl.arange(0, COLS), tl.arange(0, ROWS)
        seen = visible_t(cols, rows, seq_q, seq_k, IS_CAUSAL)
        tl.store(SEEN_T + cols[:, None] * ROWS + rows[None, :], seen.to(tl.int8))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (40, 13), (13, 40), (64, 64), (5, 64), (64, 5)])
def test_query_range_matches_its_twin_and_covers_exactly_the_visible_queries(
    nq: int, nk: int, causal: bool
) -> None:
    dev = _backend.compute_device(torch.device("cpu"))
    bm, bn = 16, 8
    n_blocks = triton.cdiv(nk, bn)
    out = torch.empty(n_blocks, 2, dtype=torch.int32, device=dev)
    seen_t = torch.empty(64, 64, dtype=torch.int8, device=dev)
    _query_range_kernel[(n_blocks,)](out, seen_t, nq, nk, BLOCK_M=bm, BLOCK_N=bn,
                                     IS_CAUSAL=causal, ROWS=64, COLS=64)  # fmt: skip
    mask = torch_visible(nq, nk, causal)
    for block in range(n_blocks):
        lo, full_lo = torch_query_range(block * bn, bm, bn, nq, nk, causal)
        assert tuple(out[block].tolist()) == (lo, full_lo)
        assert lo % bm == 0 and full_lo % bm == 0 and lo <= full_lo
        keys = mask[:, block * bn : (block + 1) * bn]
        assert not keys[:lo].any()  # nothing seen is skipped
        assert keys[full_lo:].all()  # the unmasked loop: every row sees every key
    # visible_t is visible transposed
    twin = torch_visible(nq, nk, causal, rows=torch.arange(64, device=dev))  # (64, Nk)
    assert torch.equal(seen_t[:nk].bool(), twin.T) and not seen_t[nk:].any()
