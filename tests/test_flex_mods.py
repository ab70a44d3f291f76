"""Mask and score functions: malformed ones and those returning the wrong kind are refused,
calls past what their buffers hold are refused, and a name registered again gets its own plan."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import flashlite
from flashlite import reference
from flashlite.masking import gallery, mods


@triton.jit
def _three_args(b, h, q_idx):
    return q_idx >= 0


@triton.jit
def _needs_table(score, b, h, q_idx, kv_idx, table):
    return score + tl.load(table + h)


def test_bad_mods_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="mask_mod must be a @triton.jit function"):
        flashlite.create_block_mask(lambda b, h, q: q >= 0, None, None, 8, 8, device="cpu")
    # a gallery maker passed without calling it
    with pytest.raises(TypeError, match=r"got function.*did you mean `gallery\.causal\(\)`\?"):
        flashlite.create_block_mask(gallery.causal, None, None, 8, 8, device="cpu")
    with pytest.raises(TypeError, match=r"did you mean `gallery\.sliding_window\(window\)`\?"):
        flashlite.create_block_mask(gallery.sliding_window, None, None, 8, 8, device="cpu")
    with pytest.raises(TypeError, match=r"score_mod .*did you mean `gallery\.tanh_softcap\(cap\)`"):
        q = torch.randn(1, 1, 16, 16)
        flashlite.flex_attention(q, q, q, score_mod=gallery.tanh_softcap)
    with pytest.raises(TypeError, match="takes 3 arguments.*must take 4"):
        mods.mask_mod(_three_args)
    with pytest.raises(TypeError, match="takes 6 arguments; with 0 buffers it must take 5"):
        mods.score_mod(_needs_table)
    with pytest.raises(TypeError, match="buffer 0 must be a tensor, int or float"):
        mods.score_mod(_needs_table, "table")
    with pytest.raises(ValueError, match="at most 4"):
        mods.mask_mod(_three_args, 1, 2, 3, 4, 5)
    q = torch.randn(1, 2, 16, 16, requires_grad=True)
    sm = mods.score_mod(_needs_table, torch.zeros(2))  # no derivative: forward only
    o = flashlite.flex_attention(q, q, q, score_mod=sm)
    with pytest.raises(NotImplementedError, match="has no derivative"):
        o.sum().backward()


@triton.jit
def _int_mask(b, h, q_idx, kv_idx):
    return q_idx - kv_idx  # (an int: which keys are seen is unclear)


@triton.jit
def _float_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) * 1.0


@triton.jit
def _bool_score(score, b, h, q_idx, kv_idx):
    return score > 0


@triton.jit
def _int_score(score, b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def test_mods_returning_the_wrong_kind_are_refused() -> None:
    """A mask must give bools and a score function a floating-point score: their twins are
    tried on one position when the mod is made, so an int or float mask (which failed to
    compile, or was read as nonzero = seen) and a bool or int score are TypeErrors."""
    for fn in (_int_mask, _float_mask):
        with pytest.raises(TypeError, match=r"must return a bool tensor.*returned torch\."):
            mods.mask_mod(fn, name=f"tests.flex.{fn.__name__}")
    for fn in (_bool_score, _int_score):
        with pytest.raises(TypeError, match=r"must return a floating-point score"):
            mods.score_mod(fn, name=f"tests.flex.{fn.__name__}")
    with pytest.raises(TypeError, match="must return a bool tensor"):  # (a bare function too)
        flashlite.create_block_mask(_float_mask, None, None, 8, 8, device="cpu")


def test_mods_refuse_calls_past_what_their_buffers_hold() -> None:
    """The gallery's mods say how many batches, heads and positions their buffers hold
    (``limits``): document ids, ALiBi slopes and relative tables; a call with more is a
    ValueError naming the mod, where the kernels would have read past the buffer, and so are
    tables shared across batches (B=None) for ids that differ per batch. Ids of shape (N,)
    serve every batch; a mod without limits is trusted."""
    q = torch.randn(3, 4, 40, 16)
    ids = gallery.random_documents(2, 40, 3)
    docs = gallery.document_causal(ids)
    assert docs.limits == (2, None, 40) and gallery.document(ids[0]).limits == (None, None, 40)
    with pytest.raises(ValueError, match=r"document_causal has buffer entries for 2 batches, "
                                         r"the call has 3"):  # fmt: skip
        flashlite.create_block_mask(docs, 3, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    shared = flashlite.create_block_mask(docs, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="entries for 2 batches, the call has 3"):
        flashlite.flex_attention(q, q, q, block_mask=shared)
    # (tables built with B=None hold batch 0's tiles: wrong for per-batch ids, even at B=2)
    with pytest.raises(ValueError, match=r"built with B=None .* entries for 2 batches and may "
                                         r"differ between them: build it with B=2"):  # fmt: skip
        flashlite.flex_attention(q[:2], q[:2], q[:2], block_mask=shared)
    short = gallery.document_causal(gallery.random_documents(2, 20, 3))
    with pytest.raises(ValueError, match="entries for 20 positions, the call has 40"):
        flashlite.create_block_mask(short, 2, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    every = flashlite.create_block_mask(gallery.document_causal(ids[0]), None, None, 40, 40,
                                        device="cpu", BLOCK_SIZE=16)  # fmt: skip
    assert flashlite.flex_attention(q, q, q, block_mask=every).isfinite().all()
    for sm in (gallery.alibi(gallery.alibi_slopes(3)), gallery.relative_bias(torch.randn(3, 9))):
        with pytest.raises(ValueError, match=f"{sm.name} has buffer entries for 3 query heads, "
                                             "the call has 4"):  # fmt: skip
            flashlite.flex_attention(q, q, q, score_mod=sm)
    cu = torch.tensor([0, 30, 60, 90], dtype=torch.int32)
    packed = torch.randn(90, 4, 16)
    two = flashlite.create_block_mask(gallery.document_causal(gallery.random_documents(2, 30, 2)),
                                      2, None, 30, 30, device="cpu", BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match="entries for 2 batches, the call has 3"):
        flashlite.attention_varlen(packed, packed, packed, cu, cu, 30, 30, block_mask=two)
    cache = torch.randn(2, 50, 4, 16)
    lens = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="entries for 2 query heads, the call has 4"):
        flashlite.attention_kvcache(q[:2, :, :1].transpose(1, 2), cache, cache, cache_seqlens=lens,
                                    score_mod=gallery.alibi(gallery.alibi_slopes(2)))  # fmt: skip
    with pytest.raises(ValueError, match="entries for 30 positions, the call has 50"):
        flashlite.attention_kvcache(q[:2, :, :1].transpose(1, 2), cache, cache, cache_seqlens=lens,
                                    mask_mod=gallery.document_causal(
                                        gallery.random_documents(2, 30, 2)))  # fmt: skip
    for bad in ((0, None, None), [1, 2, 3], (1, 2), (None, True, None)):
        with pytest.raises(ValueError, match="limits must be a tuple"):
            mods.mask_mod(gallery._causal, limits=bad, name="tests.flex.limited")
    trusted = mods.mask_mod(gallery._document_causal, ids, 40, torch_fn=gallery._document_causal_t,
                            name="tests.flex.trusted")  # fmt: skip
    assert trusted.limits == (None, None, None)


def test_plans_follow_a_name_registered_again_and_serve_later_calls() -> None:
    """A call of a planned kind makes no new plan; a score function registered again under its
    name (a notebook cell run again) gets its own plan, never the old function's."""
    from flashlite.ops.attention.backends.tables import args as FA

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=32)  # fmt: skip

    @triton.jit
    def bias(score, b, h, q_idx, kv_idx):
        return score + 1.0

    first = mods.score_mod(bias, name="tests.flex.redefined")
    out1 = flashlite.flex_attention(q, k, v, score_mod=first, block_mask=bm)
    planned = len(FA.fwd_plans)
    again = flashlite.flex_attention(q.clone(), k.clone(), v.clone(), score_mod=first,
                                     block_mask=bm)  # fmt: skip
    assert len(FA.fwd_plans) == planned and torch.equal(again, out1)

    @triton.jit
    def bias2(score, b, h, q_idx, kv_idx):
        return score + (kv_idx == 0) * 4.0  # favours the first key

    second = mods.score_mod(bias2, name="tests.flex.redefined")
    out2 = flashlite.flex_attention(q, k, v, score_mod=second, block_mask=bm)
    want = reference.attention(*(t.double() for t in (q, k, v)), mask_mod=gallery.causal(),
                               score_mod=second)  # fmt: skip
    torch.testing.assert_close(out2.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out2, out1)
