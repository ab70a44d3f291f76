"""attention_varlen with mask and score functions: packed sequences against fp64 per sequence
and against flex_attention on each alone, 16-bit inputs, compile and opcheck, document ids from
the offsets, rows with no key and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import maybe_compile
from flex_helpers import (
    VARLEN_K,
    VARLEN_Q,
    _assert_compiled_equals_eager,
    _assert_within_twice_torchs_error,
    _grads,
    _packed,
    _varlen_case,
    _varlen_reference,
)

import flashlite
from flashlite.masking import gallery


@pytest.mark.parametrize("name", ["causal+alibi", "prefix per sequence", "softcap, no mask",
                                  "window+relative bias"])  # fmt: skip
def test_varlen_with_mods_fp32(name: str) -> None:
    """attention_varlen with a score function and block tables, GQA, forward, backward and
    the LSE, against fp64 per sequence (the mods see sequence b as batch b)."""
    hq, hkv, d = 4, 2, 16
    lq, lk = VARLEN_Q, VARLEN_K
    mm, sm, per_sequence = _varlen_case(name, hq, lq, lk)
    cu_q, cu_k = _packed(lq), _packed(lk)
    bm = None
    if mm is not None:
        bm = flashlite.create_block_mask(mm, len(lq) if per_sequence else None, None, max(lq),
                                         max(lk), device="cpu", BLOCK_SIZE=16)  # fmt: skip
    q = torch.randn(sum(lq), hq, d, requires_grad=True)
    k, v = (torch.randn(sum(lk), hkv, d, requires_grad=True) for _ in range(2))
    out = flashlite.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), score_mod=sm,
                                     block_mask=bm, return_lse=True)  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _varlen_reference(*exact, cu_q, cu_k, mm, sm)
    go, gl = torch.randn_like(out[0]), torch.randn_like(out[1])
    gl[~torch.isfinite(ref[1])] = 0.0  # (rows with no key: their LSE is -inf either way)
    got = _grads(out, [q, k, v], go, gl)
    want = _grads((ref[0], torch.where(torch.isfinite(ref[1]), ref[1], 0.0)), exact,
                  go.double(), gl.double())  # fmt: skip
    torch.testing.assert_close(out[0].double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref[1], atol=2e-5, rtol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=3e-5, rtol=1e-5)


def test_varlen_with_mods_equals_flex_per_sequence_and_longer_max_seqlen() -> None:
    """Each packed sequence gives what flex_attention gives it alone (fp16: the same tiles),
    also when max_seqlen overstates the longest sequence (more tables, programs that leave)."""
    hq, d = 2, 16
    lq = [30, 7, 18]
    cu = _packed(lq)
    mm, sm = gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq))
    q, k, v = (torch.randn(sum(lq), hq, d, dtype=torch.float16) for _ in range(3))
    for max_len in (30, 50):
        bm = flashlite.create_block_mask(mm, None, None, max_len, max_len, device="cpu",
                                         BLOCK_SIZE=16)  # fmt: skip
        got = flashlite.attention_varlen(q, k, v, cu, cu, max_len, max_len, score_mod=sm,
                                         block_mask=bm)  # fmt: skip
        for b, n in enumerate(lq):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
            alone = flashlite.flex_attention(*one, score_mod=sm, block_mask=flashlite.
                                             create_block_mask(mm, None, None, n, n, device="cpu",
                                                               BLOCK_SIZE=16))  # fmt: skip
            torch.testing.assert_close(got[rows], alone[0].transpose(0, 1), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_with_mods_low_precision(dtype: torch.dtype) -> None:
    """16-bit varlen with a mask and a score function: within 2x torch's own error."""
    hq, d = 2, 16
    lq = [20, 33, 1]
    cu = _packed(lq)
    mm, sm = gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq))
    bm = flashlite.create_block_mask(mm, None, None, 33, 33, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(sum(lq), hq, d, dtype=dtype, requires_grad=True) for _ in range(3))
    o = flashlite.attention_varlen(q, k, v, cu, cu, 33, 33, score_mod=sm, block_mask=bm)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = _varlen_reference(*leaves, cu, cu, mm, sm)[0]
    low = _varlen_reference(q, k, v, cu, cu, mm, sm)[0]
    _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, dtype)


def test_varlen_with_mods_compiles_fullgraph_and_passes_opcheck() -> None:
    """The varlen offsets reach the flex ops as tensors: fullgraph compile equals eager, and
    the ops' schema, fake and autograd hold with them (opcheck)."""
    from torch.library import opcheck

    from flashlite.ops.attention.flex import FLEX_FWD, table_request

    hq, d = 2, 16
    lq = [12, 21, 4]
    cu = _packed(lq)
    sm = gallery.alibi(gallery.alibi_slopes(hq))
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 21, 21, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip

    def step(q, k, v, cu):  # noqa: ANN001, ANN202
        return flashlite.attention_varlen(q, k, v, cu, cu, 21, 21, score_mod=sm, block_mask=bm)

    q, k, v = (torch.randn(sum(lq), hq, d, requires_grad=True) for _ in range(3))
    _assert_compiled_equals_eager(step, maybe_compile(step, True), q, k, v, cu)

    qc, kc, vc = (t.detach().unsqueeze(0).transpose(1, 2).requires_grad_() for t in (q, k, v))
    request = table_request(bm, d**-0.5, sm, cu_seqlens_q=cu, cu_seqlens_k=cu)
    fields, named = FLEX_FWD.fields.flat(request)
    opcheck(torch.ops.flashlite.flex_attention_fwd.default, (qc, kc, vc, *fields), named)
    o, lse = torch.ops.flashlite.flex_attention_fwd.default(qc, kc, vc, *fields, **named)
    grads = (torch.randn_like(o), qc.detach(), kc.detach(), vc.detach(), o.detach())
    opcheck(
        torch.ops.flashlite.flex_attention_bwd.default,
        (*grads, lse.detach(), torch.randn_like(lse), *fields),
        named,
    )


def test_document_ids_from_varlen_offsets_give_varlen_causal() -> None:
    """The packed sequences of attention_varlen as documents of one sequence: flex_attention
    with document_causal over the ids document_ids makes from the offsets equals
    attention_varlen(causal=True), sequences of 0 and 1 tokens included."""
    lengths = [23, 1, 0, 40, 9]
    cu, total = _packed(lengths), sum(lengths)
    ids = gallery.document_ids(cu)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, torch.repeat_interleave(torch.arange(5), torch.tensor(lengths)).int())
    assert torch.equal(gallery.document_ids(cu, total + 2)[-2:], torch.tensor([5, 5]).int())
    q = torch.randn(total, 4, 16)
    k, v = (torch.randn(total, 2, 16) for _ in range(2))
    want = flashlite.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, total, total,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    got = flashlite.flex_attention(q[None], k[None], v[None], block_mask=bm, layout="b n h d")
    torch.testing.assert_close(got[0], want, atol=2e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="cu_seqlens"):
        gallery.document_ids(cu.float())
    with pytest.raises(TypeError, match="cu_seqlens"):
        gallery.document_ids(cu[None])
    with pytest.raises(ValueError, match="total"):
        gallery.document_ids(cu, -1)


def test_varlen_rows_with_no_key_give_zero_and_minus_inf() -> None:
    """A window of 0 (each query sees its own position only): queries past a shorter
    sequence's keys see nothing, so their output is 0 and their LSE −inf; the rest match fp64."""
    hq, d = 2, 16
    lq, lk = [40, 9], [31, 17]  # rows 31..39 of the first sequence have no key
    cu_q, cu_k = _packed(lq), _packed(lk)
    mm = gallery.sliding_window(0)
    bm = flashlite.create_block_mask(mm, None, None, 40, 31, device="cpu", BLOCK_SIZE=16)
    q = torch.randn(sum(lq), hq, d)
    k, v = (torch.randn(sum(lk), hq, d) for _ in range(2))
    o, lse = flashlite.attention_varlen(q, k, v, cu_q, cu_k, 40, 31, block_mask=bm,
                                        return_lse=True)  # fmt: skip
    empty = torch.zeros(sum(lq), dtype=torch.bool)
    empty[31:40] = True
    assert (o[empty] == 0).all() and (lse[:, empty] == -math.inf).all()
    ref, ref_lse = _varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, mm, None)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, ~empty].double(), ref_lse[:, ~empty], atol=2e-5, rtol=1e-5)


def test_varlen_with_mods_bad_input() -> None:
    hq, d = 2, 16
    cu = _packed([10, 6])
    q, k, v = (torch.randn(16, hq, d) for _ in range(3))
    sm = gallery.alibi(gallery.alibi_slopes(hq))
    for kw, words in (({"causal": True}, "without causal"), ({"window": (4, 0)}, "window"),
                      ({"softcap": 5.0}, "softcap")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, score_mod=sm, **kw)
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="Q_LEN, KV_LEN"):
        flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, block_mask=bm)
    bm = flashlite.create_block_mask(gallery.causal(), 3, None, 10, 10, device="cpu")
    with pytest.raises(ValueError, match="B=3"):
        flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, block_mask=bm)
