"""Hostile KV caches: lengths and block tables read through their strides, pages of 512 keys
and pages that are not a multiple of the key tile, expanded caches, inputs that require grad,
and out-of-range lengths and pages named in the error.

Each case gives the right value (checked against torch or the fp64 reference) or raises a
clear error naming the argument; none may crash, read outside a tensor or return silent garbage.
Runs on CPU in the interpreter and, for the cases marked ``gpu``, on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from hostile_helpers import KV_B, KV_D, KV_HKV, _kv, _kv_reference, _pages

import flashlite
from flashlite.masking.masks import CAUSAL


@pytest.mark.parametrize("with_new", [False, True], ids=["read", "append"])
def test_kvcache_noncontiguous_cache_seqlens_are_read_through_their_stride(with_new) -> None:  # noqa: ANN001
    q, k, v = _kv()
    every = torch.tensor([5, 99, 17, 99, 33, 99, 60, 99], dtype=torch.int32)
    lens = every[::2]  # stride 2
    assert not lens.is_contiguous()
    new = [torch.randn(KV_B, 2, KV_HKV, KV_D) for _ in range(2)] if with_new else [None, None]
    want_k, want_v = k.clone(), v.clone()
    if with_new:
        for b, n in enumerate(lens.tolist()):
            want_k[b, n : n + 2], want_v[b, n : n + 2] = new[0][b], new[1][b]
    out = flashlite.attention_kvcache(q, k, v, cache_seqlens=lens, k_new=new[0], v_new=new[1])
    want = _kv_reference(q, want_k, want_v, lens + (2 if with_new else 0))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_kvcache_noncontiguous_block_table_is_read_through_its_strides() -> None:
    q, k, v = _kv()
    kp, vp, table = _pages(k, v, 16)
    table_t = table.t().contiguous().t()  # the same entries, stride(1) = B
    assert table_t.stride(1) != 1
    lens = torch.tensor([5, 64, 17, 40], dtype=torch.int32)
    out = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table_t)
    torch.testing.assert_close(out.double(), _kv_reference(q, k, v, lens), atol=1e-5, rtol=1e-5)


def test_kvcache_pages_of_512_keys_are_read_in_place() -> None:
    # flash-attn's paged cache uses multiples of 256: read in place, the append included
    q, k, v = _kv(cap=1024)
    kp, vp, table = _pages(k, v, 512)
    lens = torch.tensor([1, 600, 1000, 511], dtype=torch.int32)
    new = [torch.randn(KV_B, 2, KV_HKV, KV_D) for _ in range(2)]
    out = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                      k_new=new[0], v_new=new[1])  # fmt: skip
    for b, n in enumerate(lens.tolist()):
        k[b, n : n + 2], v[b, n : n + 2] = new[0][b], new[1][b]
        for i in range(2):  # written into the caller's pages
            page, slot = table[b, (n + i) // 512], (n + i) % 512
            assert torch.equal(kp[page, slot], new[0][b, i])
    torch.testing.assert_close(out.double(), _kv_reference(q, k, v, lens + 2), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="page size 100"):
        flashlite.attention_kvcache(q, kp[:, :100], vp[:, :100], cache_seqlens=lens,
                                    block_table=table)  # fmt: skip


@pytest.mark.parametrize("page", [48, 192, 512])
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_kvcache_pages_that_are_not_a_multiple_of_the_key_tile(page, block_n) -> None:  # noqa: ANN001
    # a 128-key tile (the GPU's) over pages of 192 keys spans two pages: each row must read its
    # own table entry (one read per tile took the first page's for the whole tile)
    from flashlite.kernels.configs import DecodeConfig
    from flashlite.ops.attention import attention_decode_fwd

    cap = 3 * page
    q, k, v = _kv(cap=cap)
    kp, vp, table = _pages(k, v, page)
    lens = torch.tensor([cap - 5, page + 7, 1, cap], dtype=torch.int32)
    out, _, _ = attention_decode_fwd(q.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                     lens, CAUSAL, KV_D**-0.5, block_table=table,
                                     config=DecodeConfig(16, block_n, 4, 1))  # fmt: skip
    want = _kv_reference(q, k, v, lens)
    torch.testing.assert_close(out.transpose(1, 2).double(), want, atol=1e-5, rtol=1e-5)


def test_kvcache_expanded_caches_are_read_but_refused_with_k_new() -> None:
    q, k, v = _kv()
    lens = torch.tensor([5, 64, 17, 40], dtype=torch.int32)
    shared_k, shared_v = (t[:1].expand(KV_B, -1, -1, -1) for t in (k, v))  # stride 0 on B
    out = flashlite.attention_kvcache(q, shared_k, shared_v, cache_seqlens=lens)
    want = _kv_reference(q, shared_k.contiguous(), shared_v.contiguous(), lens)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    new = [torch.randn(KV_B, 1, KV_HKV, KV_D) for _ in range(2)]
    lens = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    before = k.clone()
    with pytest.raises(ValueError, match="k_cache .* share memory"):
        flashlite.attention_kvcache(q, shared_k, v, cache_seqlens=lens, k_new=new[0],
                                    v_new=new[1])  # fmt: skip
    with pytest.raises(ValueError, match="same memory"):
        flashlite.attention_kvcache(q, k, k, cache_seqlens=lens, k_new=new[0], v_new=new[1])
    assert torch.equal(k, before)  # refused before anything was written


def test_kvcache_is_forward_only_and_says_so_at_the_backward() -> None:
    # inputs that require grad: the forward computes (as no_grad would) and appends; a backward
    # that reaches the outputs raises, naming the inputs (eager and compiled: test_peer_contract)
    q, k, v = _kv()
    lens = torch.tensor([5, 6, 17, 40], dtype=torch.int32)
    for name in ("q", "k_new", "v_cache"):
        new = [torch.randn(KV_B, 1, KV_HKV, KV_D) for _ in range(2)]
        caches = {"k_cache": k.clone(), "v_cache": v.clone()}
        with torch.no_grad():
            want = flashlite.attention_kvcache(
                q,
                caches["k_cache"].clone(),
                caches["v_cache"].clone(),
                cache_seqlens=lens,
                k_new=new[0],
                v_new=new[1],
            )
        args = {"q": q.clone(), "k_new": new[0], "v_new": new[1], **caches}
        args[name].requires_grad_()
        q_in, k_in, v_in = (args.pop(a) for a in ("q", "k_cache", "v_cache"))
        out = flashlite.attention_kvcache(q_in, k_in, v_in, cache_seqlens=lens, **args)
        assert torch.equal(out, want) and out.requires_grad
        with pytest.raises(RuntimeError, match=f"attention_kvcache is forward-only.* {name},"):
            out.sum().backward()
    with torch.no_grad():  # decoding: no graph at all
        out = flashlite.attention_kvcache(q.clone().requires_grad_(), k, v, cache_seqlens=lens)
    assert not out.requires_grad


def test_kvcache_negative_cache_seqlens_message_quotes_the_value() -> None:
    q, k, v = _kv()
    new = [torch.randn(KV_B, 1, KV_HKV, KV_D) for _ in range(2)]
    lens = torch.tensor([4, -1, 4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -1"):
        flashlite.attention_kvcache(q, k, v, cache_seqlens=lens, k_new=new[0], v_new=new[1])
    with pytest.raises(ValueError, match=r"capacity\); got cache_seqlens\[2\] = 64, Nnew = 1"):
        flashlite.attention_kvcache(q, k, v, cache_seqlens=torch.tensor([4, 4, 64, 4],
                                    dtype=torch.int32), k_new=new[0], v_new=new[1])  # fmt: skip
    kp, vp, table = _pages(k, v, 16)
    table[2, 1] = 99
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] = 99"):
        flashlite.attention_kvcache(q, kp, vp, cache_seqlens=torch.tensor([4, 4, 20, 4],
                                    dtype=torch.int32), block_table=table)  # fmt: skip


@pytest.mark.gpu
def test_gpu_kvcache_noncontiguous_lengths_and_table_and_big_pages() -> None:
    q, k, v = (t.cuda() for t in _kv(cap=1024))
    kp, vp, table = (t.cuda() for t in _pages(k.cpu(), v.cpu(), 512))
    every = torch.tensor([1, 9, 600, 9, 1000, 9, 511, 9], dtype=torch.int32, device="cuda")
    lens = every[::2]
    table_t = table.t().contiguous().t()
    out = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table_t)
    torch.testing.assert_close(out.double(), _kv_reference(q, k, v, lens), atol=1e-4, rtol=1e-4)
