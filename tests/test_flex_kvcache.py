"""attention_kvcache with mask and score functions: decoding against fp64 (GQA, appends, split
keys, paged caches), a window as a mask, rows with no key, bad mods, opcheck and compile."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in jit functions' globals)
from conftest import TOL
from flex_helpers import _kvcache_reference

import flashlite
from flashlite.masking import gallery, mods


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("paged,splits", [(False, 1), (False, 3), (True, 2)])
@pytest.mark.parametrize("mods_", ["mask", "mask+alibi", "relative bias"])
def test_kvcache_decode_with_a_mask_function(dtype: torch.dtype, paged: bool, splits: int,
                                             mods_: str) -> None:  # fmt: skip
    """Document-causal decoding with GQA, an append and split keys, contiguous or paged: the
    mask function sees each query's position in its sequence and its query head; so does a
    score function (ALiBi, a relative-bias table), with the mask or without."""
    gen = torch.Generator().manual_seed(3)
    bsz, cap, hq, hkv, d, nq = 2, 96, 4, 2, 32, 3
    kc, vc = (torch.randn(bsz, cap, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(bsz, nq, hq, d, generator=gen).to(dtype)
    kn, vn = (torch.randn(bsz, nq, hkv, d, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([40, 70], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(bsz, cap, 3, seed=1))
    sm = None
    if mods_ == "mask+alibi":
        sm = gallery.alibi(gallery.alibi_slopes(hq))
    elif mods_ == "relative bias":
        mm, sm = None, gallery.relative_bias(torch.randn(hq, 21, generator=gen))
    table = None
    k_arg, v_arg = kc.clone(), vc.clone()
    if paged:  # pages of 16 keys, shuffled
        per, page = cap // 16, 16
        table = torch.randperm(bsz * per, generator=gen).view(bsz, per).to(torch.int32)
        k_arg = torch.empty(bsz * per, page, hkv, d, dtype=dtype)
        v_arg = torch.empty_like(k_arg)
        for b in range(bsz):
            for j in range(per):
                k_arg[table[b, j]] = kc[b, j * page : (j + 1) * page]
                v_arg[table[b, j]] = vc[b, j * page : (j + 1) * page]
    o, lse = flashlite.attention_kvcache(q, k_arg, v_arg, cache_seqlens=lens, k_new=kn,
                                         v_new=vn, block_table=table, mask_mod=mm,
                                         score_mod=sm, num_splits=splits,
                                         return_lse=True)  # fmt: skip
    for b, n in enumerate(lens.tolist()):  # the reference's caches hold the new keys too
        kc[b, n : n + nq], vc[b, n : n + nq] = kn[b], vn[b]
    ref = _kvcache_reference(q, kc, vc, lens + nq, mm, sm=sm)
    tol = TOL[dtype]
    torch.testing.assert_close(o.double(), ref, atol=tol.atol, rtol=tol.rtol)
    assert torch.isfinite(lse).all()


def test_kvcache_window_as_a_mask_function_matches_the_built_in() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 4, 32, generator=gen)
    kc, vc = (torch.randn(2, 80, 2, 32, generator=gen) for _ in range(2))
    lens = torch.tensor([77, 30], dtype=torch.int32)
    ours = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens,
                                       mask_mod=gallery.sliding_window(20))  # fmt: skip
    builtin = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, window=(20, 0))
    torch.testing.assert_close(ours, builtin, atol=1e-6, rtol=1e-6)


def test_kvcache_rows_with_no_key_and_bad_mask_functions() -> None:
    @triton.jit
    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    q = torch.randn(1, 1, 2, 16)
    kc, vc = (torch.randn(1, 40, 1, 16) for _ in range(2))
    lens = torch.tensor([33], dtype=torch.int32)
    o, lse = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=2,
                                         mask_mod=mods.mask_mod(nothing),
                                         return_lse=True)  # fmt: skip
    assert (o == 0).all() and (lse == -math.inf).all()
    with pytest.raises(TypeError, match="mask_mod"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, mask_mod=lambda *a: True)
    with pytest.raises(TypeError, match="score_mod"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, score_mod=lambda s, *a: s)
    with pytest.raises(ValueError, match="without softcap"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, softcap=5.0,
                                    score_mod=gallery.tanh_softcap(5.0))  # fmt: skip
    # a score function that turns −inf finite leaves the pairs causal masked, masked
    sm = gallery.tanh_softcap(3.0)
    o, lse = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, score_mod=sm,
                                         return_lse=True)  # fmt: skip
    ref = _kvcache_reference(q, kc, vc, lens, None, sm=sm)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_kvcache_op_with_a_mask_function_passes_opcheck() -> None:
    from torch.library import opcheck

    from flashlite.masking.mod_args import spec_mod

    q = torch.randn(2, 1, 4, 16)
    kc, vc = (torch.randn(2, 40, 2, 16) for _ in range(2))
    new = [torch.randn(2, 1, 2, 16) for _ in range(2)]
    lens = torch.tensor([7, 30], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(2, 40, 3, seed=1))
    sm = gallery.alibi(gallery.alibi_slopes(4))
    for score in (None, sm):
        (m_spec, m_tensors, m_nums), (s_spec, s_tensors, s_nums) = spec_mod(mm), spec_mod(score)
        args = (q, kc, vc, *new, m_tensors, s_tensors)
        fields = {"cache_seqlens": lens, "causal": True, "scale": 0.25, "num_splits": 2}
        fields |= {"mask_mod": m_spec, "mask_nums": m_nums}
        if score is not None:
            fields |= {"score_mod": s_spec, "score_nums": s_nums}
        opcheck(torch.ops.flashlite.attention_kvcache.default, args, fields)


def test_kvcache_with_a_mask_function_compiles_fullgraph() -> None:
    q = torch.randn(2, 1, 4, 16)
    kc, vc = (torch.randn(2, 40, 2, 16) for _ in range(2))
    lens = torch.tensor([33, 12], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(2, 40, 3, seed=1))
    sm = gallery.alibi(gallery.alibi_slopes(4))

    def step(q, kc, vc, lens):  # noqa: ANN001, ANN202
        return flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, mask_mod=mm,
                                           score_mod=sm)  # fmt: skip

    assert torch.equal(torch.compile(step, fullgraph=True)(q, kc, vc, lens), step(q, kc, vc, lens))
