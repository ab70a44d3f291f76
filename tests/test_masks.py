"""flashlite.masking.masks: the jit helpers and their torch twins agree, and mean what the docs
say."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashlite import _backend
from flashlite.masking.masks import (
    CAUSAL,
    NO_MASK,
    KernelMask,
    Mask,
    describe,
    key_range,
    query_range,
    torch_key_range,
    torch_query_range,
    torch_visible,
    visible,
    visible_t,
    window_bounds,
)
from flashlite.ops.attention.backends.triton.config import tuned_kernel
from flashlite.reference import attention as ref_attention

#: (causal, window) pairs every helper is checked on: none, causal, and windows of each shape
MASKS = [(False, None), (True, None), (False, (3, 1)), (False, (0, 0)), (False, (-1, 2)),
         (False, (5, -1)), (True, (2, 7)), (False, (20, 20))]  # fmt: skip


def _mask_id(m: tuple[bool, tuple[int, int] | None]) -> str:
    return ("causal" if m[0] else "full") + ("" if m[1] is None else f"-w{m[1][0]}_{m[1][1]}")


@triton.jit
def _store_range(PTR, lo, full_lo, full_hi, hi):
    # the four bounds of a block, side by side
    i = tl.arange(0, 4)
    tl.store(
        PTR + i, tl.where(i == 0, lo, tl.where(i == 1, full_lo, tl.where(i == 2, full_hi, hi)))
    )


@triton.jit
def _masks_kernel(RANGE, SEEN, seq_q, seq_k, left, right, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  ROWS: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = key_range(pid * BLOCK_M, seq_q, seq_k, left, right, BLOCK_M,
                                         BLOCK_N, IS_CAUSAL, WINDOW)  # fmt: skip
    _store_range(RANGE + 4 * pid, lo, full_lo, full_hi, hi)
    if pid == 0:
        rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
        seen = visible(rows, cols, seq_q, seq_k, left, right, IS_CAUSAL, WINDOW)
        tl.store(SEEN + rows[:, None] * COLS + cols[None, :], seen.to(tl.int8))


@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (40, 13), (13, 40), (5, 64), (64, 5)])
def test_helpers_match_their_twins(nq: int, nk: int, mask: tuple) -> None:
    causal, window = mask
    dev = _backend.compute_device(torch.device("cpu"))
    bm, bn = 16, 8
    n_blocks = triton.cdiv(nq, bm)
    ranges = torch.empty(n_blocks, 4, dtype=torch.int32, device=dev)
    seen = torch.empty(64, 64, dtype=torch.int8, device=dev)
    km = describe(causal, window).kernel(nq, nk)
    _masks_kernel[(n_blocks,)](ranges, seen, nq, nk, km.left, km.right, BLOCK_M=bm, BLOCK_N=bn,
                               IS_CAUSAL=km.IS_CAUSAL, WINDOW=km.WINDOW, ROWS=64,
                               COLS=64)  # fmt: skip
    for block in range(n_blocks):
        want = torch_key_range(block * bm, bm, bn, nq, nk, describe(causal, window))
        assert tuple(ranges[block].tolist()) == want
    # (rows past Nq only exist in a ragged last block: an unlimited side is a finite bound
    # there, past every real row's keys)
    twin = torch_visible(nq, nk, causal, window=window, device=dev)  # (Nq, Nk)
    assert torch.equal(seen[:nq, :nk].bool(), twin) and not seen[:, nk:].any()


@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("nq,nk", [(7, 7), (10, 4), (4, 10), (1, 33), (33, 1), (50, 37)])
def test_key_range_covers_exactly_the_visible_keys(nq: int, nk: int, mask: tuple) -> None:
    causal, window = mask
    described = describe(causal, window)
    seen = torch_visible(nq, nk, causal, window=window)
    for bm, bn in ((1, 1), (4, 2), (16, 16), (16, 4)):
        for start in range(0, nq, bm):
            lo, full_lo, full_hi, hi = torch_key_range(start, bm, bn, nq, nk, described)
            block = seen[start : start + bm]
            assert lo % bn == 0 and full_lo % bn == 0 and full_hi % bn == 0
            assert 0 <= lo <= full_lo <= full_hi <= hi <= nk
            assert block[:, full_lo:full_hi].all()  # unmasked tiles: every row sees every key
            assert not block[:, :lo].any() and not block[:, hi:].any()  # skipped: never seen
    if window is None and causal:
        assert torch.equal(seen.sum(1), (torch.arange(nq) + nk - nq + 1).clamp(0, nk))


def test_autotuning_is_per_length_bucket_not_per_length() -> None:
    # a decoding or varlen loop over 100 lengths gets a handful of autotuners, not 100
    tuners = {id(tuned_kernel(1, nk)) for nk in range(100, 200)}
    assert len(tuners) <= 2
    assert tuned_kernel(1, 129) is tuned_kernel(1, 255)


@triton.jit
def _query_range_kernel(OUT, SEEN_T, seq_q, seq_k, left, right, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                        ROWS: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = query_range(pid * BLOCK_N, seq_q, seq_k, left, right, BLOCK_M,
                                           BLOCK_N, IS_CAUSAL, WINDOW)  # fmt: skip
    _store_range(OUT + 4 * pid, lo, full_lo, full_hi, hi)
    if pid == 0:
        cols, rows = tl.arange(0, COLS), tl.arange(0, ROWS)
        seen = visible_t(cols, rows, seq_q, seq_k, left, right, IS_CAUSAL, WINDOW)
        tl.store(SEEN_T + cols[:, None] * ROWS + rows[None, :], seen.to(tl.int8))


@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("nq,nk", [(1, 1), (40, 13), (13, 40), (64, 64), (5, 64), (64, 5)])
def test_query_range_matches_its_twin_and_covers_exactly_the_visible_queries(
    nq: int, nk: int, mask: tuple
) -> None:
    causal, window = mask
    dev = _backend.compute_device(torch.device("cpu"))
    bm, bn = 16, 8
    n_blocks = triton.cdiv(nk, bn)
    out = torch.empty(n_blocks, 4, dtype=torch.int32, device=dev)
    seen_t = torch.empty(64, 64, dtype=torch.int8, device=dev)
    km = describe(causal, window).kernel(nq, nk)
    _query_range_kernel[(n_blocks,)](out, seen_t, nq, nk, km.left, km.right, BLOCK_M=bm,
                                     BLOCK_N=bn, IS_CAUSAL=km.IS_CAUSAL, WINDOW=km.WINDOW,
                                     ROWS=64, COLS=64)  # fmt: skip
    seen = torch_visible(nq, nk, causal, window=window)
    for block in range(n_blocks):
        lo, full_lo, full_hi, hi = torch_query_range(block * bn, bm, bn, nq, nk,
                                                     describe(causal, window))  # fmt: skip
        assert tuple(out[block].tolist()) == (lo, full_lo, full_hi, hi)
        assert lo % bm == 0 and all(x % bm == 0 or x == nq for x in (full_lo, full_hi))
        assert 0 <= lo <= full_lo <= full_hi <= hi <= nq
        keys = seen[:, block * bn : (block + 1) * bn]
        assert not keys[:lo].any() and not keys[hi:].any()  # nothing seen is skipped
        assert keys[full_lo:full_hi].all()  # the unmasked loop: every row sees every key
    # visible_t is visible transposed
    twin = torch_visible(nq, nk, causal, window=window, device=dev)  # (Nq, Nk)
    assert torch.equal(seen_t[:nk, :nq].bool(), twin.T) and not seen_t[nk:].any()


# --------------------------------------------------------------------------- windows (issue 11)
WINDOWS = [(-1, -1), (-1, 0), (0, -1), (0, 0), (2, 0), (0, 2), (3, 1), (1, 3), (20, 20)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 9), (9, 5), (1, 6)])
def test_window_mask_is_flash_attns(
    nq: int, nk: int, window: tuple[int, int], causal: bool
) -> None:
    # query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: unlimited);
    # causal makes right 0
    left, right = window[0], 0 if causal else window[1]
    want = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            d = i + nk - nq
            want[i, j] = (left == -1 or j >= d - left) and (right == -1 or j <= d + right)
    assert torch.equal(torch_visible(nq, nk, causal, window=window), want)


def test_window_of_causal_and_unlimited() -> None:
    for nq, nk in ((6, 6), (4, 9), (9, 4)):
        assert torch.equal(
            torch_visible(nq, nk, False, window=(-1, 0)), torch_visible(nq, nk, True)
        )
        assert torch.equal(torch_visible(nq, nk, False, window=(-1, -1)),
                           torch_visible(nq, nk, False))  # fmt: skip
    assert window_bounds(None, True) == (-1, 0) and window_bounds((4, 7), True) == (4, 0)


@pytest.mark.parametrize("bad", [(-2, 0), (0, -5)])
def test_window_below_minus_one_is_refused(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="-1 for unlimited"):
        window_bounds(bad, False)


@pytest.mark.parametrize("bad", [3, (1, 2, 3), (1.0, 2), (True, 0), "ab"])
def test_window_that_is_not_a_pair_of_ints_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match="pair of ints"):
        window_bounds(bad, False)  # type: ignore[arg-type]


def test_reference_window_and_softcap_against_a_row_by_row_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=gen, dtype=torch.float64) * 3 for n in (6, 9, 9))
    window, cap, scale = (2, 1), 1.5, 0.5
    o, lse = ref_attention(q, k, v, False, scale, window=window, softcap=cap, return_lse=True)
    seen = torch_visible(6, 9, False, window=window)
    for i in range(6):
        s = cap * torch.tanh((q[0, 0, i] @ k[0, 0].T) * scale / cap)
        s = s[seen[i]]
        p = torch.softmax(s, 0)
        assert torch.allclose(o[0, 0, i], p @ v[0, 0][seen[i]])
        assert torch.allclose(lse[0, 0, i].double(), torch.logsumexp(s, 0), atol=1e-6)


def test_reference_rows_outside_every_window_give_zero() -> None:
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=torch.float64) for _ in range(3))
    o, lse = ref_attention(q, k[:, :, :3], v[:, :, :3], window=(0, 0), return_lse=True)
    # Nq = 8, Nk = 3: query i sees only key i - 5, so rows 0..4 see nothing
    assert (o[0, 0, :5] == 0).all() and torch.isinf(lse[0, 0, :5]).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[0, 0, 5:]).all()


def test_mask_gallery_example_runs_and_draws_the_ranges(capsys: pytest.CaptureFixture) -> None:
    # examples/masks.py (docs/how-it-works/attention.md §5): every seen pair is drawn '#' or '+',
    # skipped tiles are blank, and the CLI form runs
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "masks.py"
    spec = importlib.util.spec_from_file_location("masks_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pic = example.draw(12, 16, False, (3, 3), 4, 4).splitlines()
    assert pic[0] == "  0 |.+++####....    |"
    for causal, window in [(True, None), (False, (4, 0)), (False, (-1, 2)), (False, None)]:
        seen = torch_visible(12, 16, causal, window=window)
        rows = [r for r in example.draw(12, 16, causal, window, 4, 4).splitlines() if "|" in r]
        drawn = torch.tensor([[c in "#+" for c in r.split("|")[1]] for r in rows])
        assert torch.equal(drawn, seen)
    assert example.main(["--nq", "5", "--nk", "7", "--window", "2", "0"]) == 0
    assert "window=[2, 0]" in capsys.readouterr().out


def test_describe_normalises_the_public_mask_once() -> None:
    """``masks.describe`` turns causal, window and softcap into the :class:`Mask` the ops carry:
    None for an unlimited side or no cap (no −1 / 0.0 sentinels), causal's right side 0."""
    assert describe(False) == Mask(False) == NO_MASK
    assert describe(True) == Mask(True, None, 0, None) == CAUSAL
    assert describe(False, (3, -1), 2) == Mask(False, 3, None, 2.0)
    assert describe(True, (5, 7)).right == 0
    assert describe(False, (-1, 0)) == Mask(False, None, 0)
    # an op's request in its normal form gives the same masks: the old sentinels (−1 sides,
    # a 0.0 cap) mean none, and a plain causal call (no window arguments) is causal's mask
    from flashlite.ops.attention.request import Request

    assert Request.make(False, 1.0, -1, -1, 0.0).mask == Mask(False)
    assert Request.make(True, 1.0, None, None, None).mask == CAUSAL
    assert Request.make(True, 1.0, 4, None, 2.0).mask == Mask(True, 4, 0, 2.0)
    with pytest.raises(TypeError, match="softcap"):
        describe(False, None, "big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="softcap"):
        describe(False, None, -1.0)
    with pytest.raises(ValueError, match="window"):
        describe(False, (-2, 0))


def test_mask_kernel_arguments() -> None:
    """``Mask.kernel``: no mask and causal keep their own code paths (the window ``(-1, 0)``
    is causal's), any other window sets ``WINDOW`` with an unlimited side a bound past both
    lengths; the cap travels as a runtime value beside its flag."""
    nq, nk = 10, 20
    far = nq + nk
    cases = [
        (NO_MASK, (False, False, 0, 0, False, 0.0)),
        (CAUSAL, (True, False, 0, 0, False, 0.0)),
        (describe(False, (-1, 0)), (True, False, 0, 0, False, 0.0)),
        (describe(True, None, 3), (True, False, 0, 0, True, 3.0)),
        (describe(False, (-1, -1), 3.0), (False, False, 0, 0, True, 3.0)),
        (describe(True, (5, 7)), (False, True, 5, 0, False, 0.0)),
        (describe(False, (3, -1)), (False, True, 3, far, False, 0.0)),
        (describe(False, (-1, 2)), (False, True, far, 2, False, 0.0)),
        (describe(False, (0, 0), 1.5), (False, True, 0, 0, True, 1.5)),
    ]
    for mask, want in cases:
        km = mask.kernel(nq, nk)
        assert isinstance(km, KernelMask) and km == want, mask
        # the plain paths (planned once per kind of tensors): no window but causal's, no cap
        assert mask.plain == (not km.WINDOW and not km.SOFTCAP) and mask.is_causal == km.IS_CAUSAL
    assert CAUSAL.kernel(nq, nk).constexprs() == {"IS_CAUSAL": True, "WINDOW": False,
                                                  "SOFTCAP": False}  # fmt: skip


def test_attention_op_schemas_take_optional_arguments_not_sentinels() -> None:
    import flashlite  # noqa: F401  (registers the ops)

    for name in ("attention_fwd", "attention_bwd", "attention_kvcache"):
        schema = str(getattr(torch.ops.flashlite, name).default._schema)
        for arg in ("window_left", "window_right", "softcap", "num_splits", "max_seqlen_q"):
            if f" {arg}" in schema:
                assert f"? {arg}" in schema, (name, arg, schema)
        assert "=-1" not in schema and "=0" not in schema, schema


def test_a_moved_call_keeps_its_mask() -> None:
    # CPU tensors in a GPU process: the body's arguments are moved one by one, tuples element by
    # element; a Mask (a named tuple) must stay a Mask, a plain tuple a tuple
    from flashlite.ops.common import moved

    mask = describe(True, (4, 0), 5.0)
    got = moved(mask, torch.device("meta"))
    assert type(got) is Mask and got == mask
    pair = moved((torch.ones(2), 3), torch.device("meta"))
    assert type(pair) is tuple and pair[0].device.type == "meta" and pair[1] == 3
