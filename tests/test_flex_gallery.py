"""flex_attention over the gallery's masks and score functions against the fp64 reference:
forward and backward, 16-bit inputs, gradcheck, rows with no key or a +inf key, the built-ins
written by hand as masks, compile and opcheck."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in jit functions' globals)
from conftest import maybe_compile
from flex_helpers import (
    GALLERY,
    D,
    N,
    _assert_compiled_equals_eager,
    _assert_within_twice_torchs_error,
    _block_mask,
    _gallery,
    _ids,
    assert_fp32_against_fp64,
)

import flashlite
from flashlite import reference
from flashlite.masking import gallery, mods


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_forward_backward_fp32(name: str) -> None:
    """Each gallery mod, GQA, through the output and the LSE, against fp64."""
    b, hq, hkv = 2, 4, 2
    mm, sm = _gallery(hq, b)[name]
    q = torch.randn(b, hq, N, D, requires_grad=True)
    k, v = (torch.randn(b, hkv, N, D, requires_grad=True) for _ in range(2))
    out = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=_block_mask(mm, b),
                                   return_lse=True)  # fmt: skip
    assert_fp32_against_fp64(out, [q, k, v], mask_mod=mm, score_mod=sm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["document_causal", "alibi"])
def test_low_precision_within_twice_torchs_error(name: str, dtype: torch.dtype) -> None:
    """16-bit inputs (bf16 through the interpreter's fp32 dots): the error against fp64 is at
    most 2x that of the same math in torch at the input precision, plus the table's floor."""
    b, h = 1, 2
    mm, sm = _gallery(h, b)[name]
    q, k, v = (torch.randn(b, h, N, D, dtype=dtype, requires_grad=True) for _ in range(3))
    o = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=_block_mask(mm, b))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = reference.attention(*leaves, mask_mod=mm, score_mod=sm)
    low = reference.attention(q, k, v, mask_mod=mm, score_mod=sm)
    _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, dtype)


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck prefers fp64, which no kernel takes
def test_gradcheck_fp32_document_alibi() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 40
    ids = torch.tensor([0] * 13 + [1] * 20 + [2] * 7, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, n, n,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    sm = gallery.alibi(gallery.alibi_slopes(2))
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen).requires_grad_() for _ in range(3))

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


def test_empty_tiles_are_never_read() -> None:
    """Keys in empty tiles are never loaded: NaN there does not reach the output."""
    ids = torch.tensor([0] * 32 + [1] * 32, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document(ids), None, None, 64, 64, device="cpu",
                                     BLOCK_SIZE=32)  # fmt: skip
    assert bm.classes().flatten().tolist() == [2, 0, 0, 2]
    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    k[:, :, 32:], v[:, :, 32:] = math.nan, math.nan  # document 1's keys
    o = flashlite.flex_attention(q, k, v, block_mask=bm)
    assert torch.isfinite(o[:, :, :32]).all()
    ref = reference.attention(q[:, :, :32].double(), k[:, :, :32].double(), v[:, :, :32].double())
    torch.testing.assert_close(o[:, :, :32].double(), ref, atol=2e-5, rtol=1e-5)


def test_row_with_no_key_gives_zero_and_minus_inf() -> None:
    @triton.jit
    def odd_rows_see_nothing(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx <= q_idx)

    mm = mods.mask_mod(odd_rows_see_nothing)
    bm = flashlite.create_block_mask(mm, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    o, lse = flashlite.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert (o[:, :, 1::2] == 0).all() and (lse[:, :, 1::2] == -math.inf).all()
    ro = reference.attention(q.double(), k.double(), v.double(), mask_mod=mm)
    torch.testing.assert_close(o.double(), ro, atol=2e-5, rtol=1e-5)
    (o.sum() + lse[:, :, ::2].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_plus_inf_key_and_huge_scores_follow_logsumexp(dtype: torch.dtype, alibi: bool) -> None:
    """A +inf key: the rows whose score against it is +inf get LSE +inf and output NaN (as
    torch.logsumexp and torch's attention), the others stay finite and right; scores in the
    tens of thousands (fp32) lose nothing to the online softmax."""
    sm = gallery.alibi(gallery.alibi_slopes(2)) if alibi else None
    q = torch.randn(1, 2, 3, 8).to(dtype)
    k, v = torch.randn(1, 2, 40, 8).to(dtype), torch.randn(1, 2, 40, 8).to(dtype)
    q[..., 0] = torch.tensor([1.0, -1.0, 0.5]).to(dtype)
    k[0, :, 17, 0] = math.inf
    out, lse = flashlite.flex_attention(q, k, v, score_mod=sm, return_lse=True)
    want = reference.attention(q.double(), k.double(), v.double(), score_mod=sm,
                               return_lse=True)[1]  # fmt: skip
    plus = want == math.inf
    assert plus[..., 0].all() and not plus[..., 1].any()
    assert (lse[plus] == math.inf).all() and out[plus].isnan().all()
    assert out[~plus].isfinite().all()
    torch.testing.assert_close(lse[~plus].double(), want[~plus].double(), atol=2e-2, rtol=2e-2)
    q, k = (torch.randn(1, 2, N, 16) * 300 for _ in range(2))
    v = torch.randn(1, 2, N, 16)
    bm = _block_mask(gallery.causal(), 1)
    o, lse = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)
    ro, rl = reference.attention(q.double(), k.double(), v.double(), mask_mod=gallery.causal(),
                                 score_mod=sm, return_lse=True)  # fmt: skip
    torch.testing.assert_close(o.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl.double(), atol=1e-2, rtol=1e-6)


def test_hand_written_causal_and_window_match_the_built_ins() -> None:
    """A mask written by hand gives the built-in paths' results (bit for bit is a GPU test:
    the two kernels order their arithmetic differently)."""
    q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
    for mm, kw in ((gallery.causal(), {"causal": True}),
                   (gallery.sliding_window(17), {"causal": True, "window": (17, 0)})):  # fmt: skip
        o = flashlite.flex_attention(q, k, v, block_mask=_block_mask(mm, 1))
        torch.testing.assert_close(o, flashlite.attention(q, k, v, **kw), atol=2e-6, rtol=1e-5)


def test_causal_lower_right_is_the_built_in_causal_and_causal_is_top_left() -> None:
    """``attention(causal=True)`` is bottom-right aligned: ``gallery.causal_lower_right(Nq,
    Nk)`` gives it for any lengths, ``gallery.causal()`` (top-left) only when Nq == Nk."""
    for nq, nk in ((20, 64), (40, 40)):
        q = torch.randn(1, 2, nq, 16)
        k, v = (torch.randn(1, 2, nk, 16) for _ in range(2))
        want = flashlite.attention(q, k, v, causal=True)
        for mm, agrees in ((gallery.causal_lower_right(nq, nk), True),
                           (gallery.causal(), nq == nk)):  # fmt: skip
            bm = flashlite.create_block_mask(mm, None, None, nq, nk, device="cpu", BLOCK_SIZE=16)
            got = flashlite.flex_attention(q, k, v, block_mask=bm)
            assert torch.allclose(got, want, atol=2e-6, rtol=1e-5) == agrees, (mm.name, nq, nk)
    with pytest.raises(ValueError, match="n_k must be an int >= 1, got 0"):
        gallery.causal_lower_right(4, 0)


def test_no_block_mask_is_dense_attention_and_layouts_agree() -> None:
    q = torch.randn(2, 3, 50, 4, D)[:, :, :, 1]  # non-contiguous (B, N, H, D): b n h d
    k, v = (torch.randn(2, 45, 1, D) for _ in range(2))
    o = flashlite.flex_attention(q, k, v, layout="b n h d")
    want = flashlite.attention(q, k, v, layout="b n h d")
    assert o.shape == q.shape
    torch.testing.assert_close(o, want, atol=2e-6, rtol=1e-5)


def test_compiled_matches_eager_without_recompiling_per_length() -> None:
    """fullgraph compile; new lengths are new table shapes, not new graphs (dynamic shapes)."""
    sm = gallery.alibi(gallery.alibi_slopes(2))

    def step(q, k, v, bm):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm)

    compiled = maybe_compile(step, True)
    for n in (40, 56, 72):
        bm = flashlite.create_block_mask(gallery.causal(), None, None, n, n, device="cpu",
                                         BLOCK_SIZE=16)  # fmt: skip
        q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
        _assert_compiled_equals_eager(step, compiled, q, k, v, bm)


def test_opcheck() -> None:
    from torch.library import opcheck

    from flashlite.ops.attention.flex import FLEX_FWD, table_request

    mm, sm = gallery.document_causal(_ids(1, 40)), gallery.tanh_softcap(4.0)
    bm = flashlite.create_block_mask(mm, 1, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, 40, 16, requires_grad=True) for _ in range(2))
    fields, named = FLEX_FWD.fields.flat(table_request(bm, 0.25, sm))
    opcheck(torch.ops.flashlite.flex_attention_fwd.default, (q, k, v, *fields), named)
    o, lse = torch.ops.flashlite.flex_attention_fwd.default(q, k, v, *fields, **named)
    grads = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach())
    opcheck(
        torch.ops.flashlite.flex_attention_bwd.default,
        (*grads, torch.randn_like(lse), *fields),
        named,
    )
