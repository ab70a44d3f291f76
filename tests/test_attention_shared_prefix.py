"""flashlite.attention_shared_prefix: B requests decoding over one shared prompt prefix (cascade
attention: the prefix pass, the suffix pass through attention_kvcache, one merge).

Every case is checked against the fp64 reference over each request's concatenated keys
``[prefix ; own cache]`` (within twice PyTorch's own low-precision error plus the dtype's floor)
and against ``attention_kvcache`` over per-request caches holding a copy of the prefix; the
suffix cache is read back after the append.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import TOL

import flashlite
from flashlite.reference import attention as ref_attention

B, HQ, HKV, D, CAP = 3, 4, 2, 16, 48
#: the LSE's tolerance against fp64 (16-bit inputs: q·scale is rounded to the dtype first)
LSE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _inputs(dtype, n_prefix, nq, n_new, lengths, hq=HQ, hkv=HKV, seed=0):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed + 7 * n_prefix + nq)
    q = torch.randn(B, nq, hq, D, generator=gen).to(dtype)
    pk, pv = (torch.randn(n_prefix, hkv, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, CAP, hkv, D, generator=gen).to(dtype) for _ in range(2))
    new = [torch.randn(B, n_new, hkv, D, generator=gen).to(dtype) if n_new else None
           for _ in range(2)]  # fmt: skip
    sinks = torch.randn(hq, generator=gen) * 2
    return q, pk, pv, kc, vc, new, torch.tensor(lengths, dtype=torch.int32), sinks


def _appended(cache, new, lengths):  # noqa: ANN001, ANN202
    cache = cache.clone()
    if new is not None:
        for b, n in enumerate(lengths.tolist()):
            cache[b, n : n + new.shape[1]] = new[b]
    return cache


def _with_prefix(prefix, cache):  # noqa: ANN001, ANN202
    """Per-request caches ``(B, Np + CAP, Hkv, D)`` holding a copy of the prefix."""
    return torch.cat([prefix.expand(cache.shape[0], -1, -1, -1), cache], 1)


def _with_sinks(o, lse, sinks):  # noqa: ANN001, ANN202
    """gpt-oss's sink folded into finished (out (B, Nq, Hq, D), lse (B, Hq, Nq)), in fp64."""
    lse = lse.double()
    total = torch.logaddexp(lse, sinks.double().view(1, -1, 1))
    return o.double() * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1), total


def _reference(q, pk, pv, k_after, v_after, total, upcast, sinks, **mask):  # noqa: ANN001, ANN202
    """(out, lse): each request's queries against ``[prefix ; its first total[b] keys]``."""
    outs, lses = [], []
    for b, n in enumerate(total.tolist()):
        k, v = (torch.cat([p, c[b, :n]])[None].transpose(1, 2)
                for p, c in ((pk, k_after), (pv, v_after)))  # fmt: skip
        o, lse = ref_attention(q[b : b + 1].transpose(1, 2), k, v, upcast=upcast,
                               return_lse=True, **mask)  # fmt: skip
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    o, lse = torch.cat(outs), torch.cat(lses)
    return _with_sinks(o, lse, sinks) if sinks is not None else (o, lse)


CASES = [
    # (Np, Nq, Nnew, lengths already cached, causal, window, softcap, sinks)
    (23, 1, 0, [15, 0, 48], True, None, None, False),  # decode, an empty and a full cache
    (23, 1, 1, [15, 0, 47], True, None, None, True),  # decode with append, sinks
    (37, 4, 4, [1, 20, 44], True, (60, 0), None, False),  # window: shared span + exact edge
    (1, 3, 0, [0, 5, 48], True, None, None, True),  # Np = 1; rows that see no key: the sink
    (23, 3, 1, [0, 12, 47], True, None, 5.0, False),  # Nq > Nnew + 1: causal cuts the prefix
    (29, 2, 2, [5, 30, 0], False, (7, 3), 3.0, True),  # two-sided window, softcap, sinks
]
RUNS = [(torch.float32, case, 3) for case in CASES] + [
    (dtype, CASES[i], None) for dtype in (torch.float16, torch.bfloat16) for i in (1, 2, 5)
]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-np{r[1][0]}-nq{r[1][1]}-{r[1][3]}")
def test_matches_reference_and_kvcache(run: tuple) -> None:
    dtype, (n_prefix, nq, n_new, lengths, causal, window, softcap, with_sinks), splits = run
    q, pk, pv, kc, vc, new, seqlens, sinks = _inputs(dtype, n_prefix, nq, n_new, lengths)
    sinks = sinks if with_sinks else None
    kw = {"causal": causal, "window": window, "softcap": softcap}
    k_out, v_out = kc.clone(), vc.clone()
    out, lse = flashlite.attention_shared_prefix(
        q, pk, pv, k_out, v_out, cache_seqlens=seqlens, k_new=new[0], v_new=new[1], sinks=sinks,
        num_splits=splits, return_lse=True, **kw,
    )  # fmt: skip
    k_want, v_want = _appended(kc, new[0], seqlens), _appended(vc, new[1], seqlens)
    assert torch.equal(k_out, k_want) and torch.equal(v_out, v_want)  # the append, read back
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, HQ, nq)
    total = seqlens + n_new
    want, want_lse = _reference(q, pk, pv, k_want, v_want, total, True, sinks, **kw)
    torch_lp = _reference(q, pk, pv, k_want, v_want, total, False, sinks, **kw)[0]
    err = (out.double() - want).abs().max().item()
    torch_err = (torch_lp.double() - want).abs().max().item()
    assert err <= 2 * torch_err + TOL[dtype].floor, (err, torch_err)
    seen = want_lse.isfinite()
    assert torch.equal(seen, lse.isfinite())
    assert (lse.double() - want_lse)[seen].abs().max() <= LSE_TOL[dtype]
    # attention_kvcache over per-request caches holding a copy of the prefix
    k_cat, v_cat = _with_prefix(pk, kc), _with_prefix(pv, vc)
    peer, peer_lse = flashlite.attention_kvcache(
        q, k_cat, v_cat, cache_seqlens=seqlens + n_prefix, k_new=new[0], v_new=new[1],
        return_lse=True, **kw,
    )  # fmt: skip
    if sinks is not None:
        peer, peer_lse = _with_sinks(peer, peer_lse, sinks)
    torch.testing.assert_close(out.double(), peer.double(), atol=2 * TOL[dtype].floor, rtol=0)
    assert (lse.double() - peer_lse.double())[seen].abs().max() <= LSE_TOL[dtype]


def test_rows_that_see_no_key_give_zero_and_the_sink() -> None:
    """Np = 1, Nq = 3, an empty suffix: query i sits at 1 − 3 + i, so rows 0 and 1 see nothing
    (out 0, LSE the sink, or −inf without one); row 2 sees the prefix's one key."""
    q, pk, pv, kc, vc, _, seqlens, sinks = _inputs(torch.float32, 1, 3, 0, [0, 0, 0])
    for s in (sinks, None):
        out, lse = flashlite.attention_shared_prefix(q, pk, pv, kc, vc, cache_seqlens=seqlens,
                                                     sinks=s, return_lse=True)  # fmt: skip
        assert not out[:, :2].any() and out[:, 2].abs().sum() > 0
        empty = lse[:, :, :2]
        if s is None:
            assert torch.isneginf(empty).all()
        else:
            torch.testing.assert_close(empty, s.view(1, HQ, 1).expand_as(empty), atol=1e-6, rtol=0)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_paged_suffix_equals_contiguous(heads: tuple[int, int]) -> None:
    """A paged suffix cache (pages of 16, shuffled, spare pages of noise) gives the contiguous
    cache's result, and the append lands in the right pages; return_lse=False returns out."""
    hq, hkv = heads
    q, pk, pv, kc, vc, new, seqlens, _ = _inputs(torch.float16, 19, 2, 2, [30, 0, 46], hq, hkv)
    want = flashlite.attention_shared_prefix(q, pk, pv, kc.clone(), vc.clone(),
                                             cache_seqlens=seqlens, k_new=new[0],
                                             v_new=new[1])  # fmt: skip
    per = CAP // 16
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(B * per + 2, generator=gen)[: B * per].view(B, per).to(torch.int32)
    kp, vp = (torch.randn(B * per + 2, 16, hkv, D, generator=gen).to(q.dtype) for _ in range(2))
    for pages, cache in ((kp, kc), (vp, vc)):
        pages[table.long()] = cache.view(B, per, 16, hkv, D)
    got = flashlite.attention_shared_prefix(q, pk, pv, kp, vp, cache_seqlens=seqlens,
                                            k_new=new[0], v_new=new[1],
                                            block_table=table)  # fmt: skip
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    unpaged = kp[table.long()].view(B, CAP, hkv, D)
    assert torch.equal(unpaged, _appended(kc, new[0], seqlens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_kernel_equals_its_torch_twin(dtype: torch.dtype) -> None:
    """The Triton merge against merge_torch (stats.merge_attention): strided partials, rows one
    part or both parts saw nothing."""
    from flashlite.ops.attention.shared_prefix import merge_kernel, merge_torch

    gen = torch.Generator().manual_seed(5)
    b, nq, h, d = 2, 3, 4, 24
    o_a = torch.randn(h, b, nq, d, generator=gen).to(dtype).transpose(0, 1)  # (strided)
    o_b = torch.randn(b, nq, h, d, generator=gen).to(dtype).transpose(1, 2)
    lse_a, lse_b = (torch.randn(b, h, nq, generator=gen) * 20 for _ in range(2))
    lse_a[0, 1, 2] = -math.inf
    lse_a[1, 3, 0] = lse_b[1, 3, 0] = -math.inf
    o_a[0, 1, 2] = o_a[1, 3, 0] = o_b[1, 3, 0] = 0.0
    parts = [(o_a, lse_a), (o_b, lse_b)]
    o, lse = merge_kernel(*parts, torch.empty(b, nq, h, d, dtype=dtype))
    want_o, want_lse = merge_torch([(t.double(), lse) for t, lse in parts])
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(o.transpose(1, 2).double(), want_o, atol=TOL[dtype].floor, rtol=0)
    assert not o[1, 0, 3].any()
    assert torch.isneginf(lse[1, 3, 0])


@pytest.mark.parametrize("nq,n_new,window", [(1, 0, None), (3, 1, None), (4, 4, (20, 0)),
                                             (2, 2, (7, 3)), (3, 0, (0, -1))])  # fmt: skip
def test_spans_split_the_prefix_exactly(nq: int, n_new: int, window: tuple | None) -> None:
    """The shared span holds exactly the prefix keys every row sees (any length in range), and
    the exact path's spans everything else some row sees."""
    from flashlite.masking.masks import describe
    from flashlite.ops.attention.shared_prefix import _spans

    n_prefix, cap = 31, 24
    for causal in (True, False):
        mask = describe(causal, window)
        bulk, edges = _spans(n_prefix, nq, n_new, cap, mask)
        left, right = mask.left, mask.right
        seen = {j: set() for j in range(n_prefix)}
        rows = list(itertools.product(range(n_new, cap + 1), range(nq)))
        for c, i in rows:
            p = n_prefix + c - nq + i
            for j in range(n_prefix):
                if (left is None or j >= p - left) and (right is None or j <= p + right):
                    seen[j].add((c, i))
        in_edges = {j for a, e in edges for j in range(a, e)}
        for j, who in seen.items():
            assert (len(who) == len(rows)) == (bulk[0] <= j < bulk[1]), (j, bulk)
            assert (0 < len(who) < len(rows)) == (j in in_edges), (j, edges)


def test_bad_arguments_raise_and_write_nothing() -> None:
    q, pk, pv, kc, vc, new, seqlens, sinks = _inputs(torch.float32, 9, 1, 1, [4, 0, 40])
    k0, v0 = kc.clone(), vc.clone()
    meta = {"device": "meta"}
    two = {"q": q[:2], "cache_seqlens": seqlens[:2], "k_new": new[0][:2], "v_new": new[1][:2]}
    bad = [
        ({"sinks": torch.zeros(HQ + 1)}, ValueError, r"sinks must have shape \(Hq,\)"),
        ({"sinks": torch.zeros(HQ, dtype=torch.float64)}, TypeError, "sinks must have dtype"),
        ({"sinks": torch.zeros(HQ, **meta)}, ValueError, "sinks must be on q's device"),
        ({"sinks": [0.0] * HQ}, TypeError, "sinks must be a torch.Tensor"),
        ({"prefix_k": torch.zeros(9, HKV + 1, D)}, ValueError, "prefix_k must be"),
        ({"prefix_v": torch.zeros(9, HKV, D + 1)}, ValueError, "prefix_v must be"),
        ({"prefix_k": torch.zeros(1, 9, HKV, D)}, ValueError, "prefix_k must be"),
        ({"prefix_v": torch.zeros(8, HKV, D)}, ValueError, "prefix_k and prefix_v"),
        ({"prefix_v": pv.double()}, TypeError, "prefix_v has dtype"),
        ({"prefix_k": pk.to(**meta)}, ValueError, "prefix_k must be on q's device"),
        ({"prefix_k": pk.tolist()}, TypeError, "prefix_k must be a torch.Tensor"),
        ({"cache_seqlens": seqlens[:2]}, ValueError, "cache_seqlens"),
        ({"k_new": new[0][:2], "v_new": new[1][:2]}, ValueError, "k_new and v_new"),
        ({"q": q[:2]}, ValueError, r"cache_seqlens must be a \(B,\) tensor with B=2"),
        (two, ValueError, r"q's B=2, the caches' B=3"),  # (2 requests, 3 caches)
        ({"q": torch.zeros(B, 1, 3, D)}, ValueError, "multiple"),
        ({"num_splits": 0}, ValueError, "num_splits"),
    ]
    for change, error, match in bad:
        args = {"q": q, "prefix_k": pk, "prefix_v": pv, "sinks": sinks, "k_new": new[0],
                "v_new": new[1], "cache_seqlens": seqlens} | change  # fmt: skip
        with pytest.raises(error, match=match):
            flashlite.attention_shared_prefix(
                args.pop("q"), args.pop("prefix_k"), args.pop("prefix_v"), kc, vc, **args
            )
        assert torch.equal(kc, k0) and torch.equal(vc, v0), change  # nothing written


def test_compiles_like_eager() -> None:
    """Under torch.compile (the ops traced, the merge's torch twin in the graph) one decode
    step gives eager's result and writes the same caches."""
    q, pk, pv, kc, vc, new, seqlens, sinks = _inputs(torch.float32, 13, 2, 2, [3, 0, 40])

    def step(q, kc, vc):  # noqa: ANN001, ANN202
        return flashlite.attention_shared_prefix(q, pk, pv, kc, vc, cache_seqlens=seqlens,
                                                 k_new=new[0], v_new=new[1], sinks=sinks,
                                                 window=(30, 0))  # fmt: skip

    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    eager = step(q, *caches[0])
    compiled = torch.compile(step, fullgraph=True)(q, *caches[1])
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 256], ids=lambda p: f"page{p}" if p else "contiguous")
def test_gpu_matches_kvcache_over_copies(page_size: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bsz, n_prefix, cap, hq, hkv, d = 4, 4096, 1024, 32, 8, 128
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(bsz, 1, hq, d, device=dev, dtype=dt)
    pk, pv = (torch.randn(n_prefix, hkv, d, device=dev, dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(bsz, cap, hkv, d, device=dev, dtype=dt) for _ in range(2))
    kn, vn = (torch.randn(bsz, 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    seqlens = torch.tensor([1000, 0, 513, 1023], dtype=torch.int32, device=dev)
    sinks = torch.randn(hq, device=dev)
    k_cat, v_cat = _with_prefix(pk, kc), _with_prefix(pv, vc)
    want, want_lse = flashlite.attention_kvcache(q, k_cat, v_cat, cache_seqlens=seqlens + n_prefix,
                                                 k_new=kn, v_new=vn, return_lse=True)  # fmt: skip
    want, want_lse = _with_sinks(want, want_lse, sinks)
    table = None
    if page_size:
        per = cap // page_size
        table = torch.randperm(bsz * per, device=dev).view(bsz, per).to(torch.int32)
        pages = [torch.empty(bsz * per, page_size, hkv, d, device=dev, dtype=dt) for _ in range(2)]
        for p, c in zip(pages, (kc, vc), strict=True):
            p[table.long()] = c.view(bsz, per, page_size, hkv, d)
        kc, vc = pages
    out, lse = flashlite.attention_shared_prefix(q, pk, pv, kc, vc, cache_seqlens=seqlens,
                                                 k_new=kn, v_new=vn, block_table=table,
                                                 sinks=sinks, return_lse=True)  # fmt: skip
    assert (out.double() - want).abs().max().item() <= 2e-2
    assert (lse.double() - want_lse).abs().max().item() <= 5e-2
    k_back = kc[table.long()].view(bsz, cap, hkv, d) if page_size else kc
    assert torch.equal(k_back, k_cat[:, n_prefix:])
