"""Attention sinks (gpt-oss): one more logit per head that joins every row's softmax and has no
value. Every attention path against ``reference.attention(..., sinks=)`` in fp64, forward and
backward (the sinks' gradient included, through the output and the LSE), with flash-attn's rule:
within 2x PyTorch's own low-precision error plus a floor."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TOL, maybe_compile

import flashlite
from flashlite import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run(fn, q, k, v, sinks, do, dlse):  # noqa: ANN001, ANN202
    """``(o, lse, dq, dk, dv, dsinks)`` of ``fn(q, k, v, sinks) -> (o, lse)``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = fn(*leaves)
    loss = (o.double() * do.double()).sum() + (lse.double() * dlse.double()).sum()
    loss.backward()
    return (o.detach(), lse.detach(), *(t.grad for t in leaves))


def _assert_close_to_fp64(fn, q, k, v, sinks, **ref_kw) -> None:  # noqa: ANN001
    """fn's outputs and gradients within 2x torch's low-precision error of fp64's (+ a floor)."""
    do = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    dlse = torch.randn(q.shape[:3], device=q.device)

    def ref(up: bool):  # noqa: ANN202
        return lambda q, k, v, s: reference.attention(q, k, v, upcast=up, return_lse=True,
                                                      sinks=s, **ref_kw)  # fmt: skip

    want = _run(ref(True), q.double(), k.double(), v.double(), sinks.double(), do, dlse)
    torch_lp = _run(ref(False), q, k, v, sinks, do, dlse)
    got = _run(fn, q, k, v, sinks, do, dlse)
    for name, g, w, t in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want, torch_lp,
                             strict=True):  # fmt: skip
        assert g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"NaN/inf in {name}"
        err = (g.double() - w).abs().max().item()
        torch_err = (t.double() - w).abs().max().item()
        floor = TOL[q.dtype].floor * max(1.0, w.abs().max().item())
        assert err <= 2 * torch_err + floor, (name, err, torch_err)


# (causal, window, softcap, Hq, Hkv, Nq, Nk): every mask, GQA, rows that see no key
CASES = {
    "plain": (False, None, None, 2, 2, 19, 37),
    "causal_gqa": (True, None, None, 4, 2, 33, 33),
    "causal_rows_see_nothing": (True, None, None, 2, 1, 40, 9),
    "window": (True, (6, 0), None, 2, 2, 35, 35),
    "softcap": (False, None, 3.0, 2, 2, 17, 40),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_with_sinks_forward_and_backward(case: str, dtype: torch.dtype) -> None:
    causal, window, softcap, hq, hkv, nq, nk = CASES[case]
    q = torch.randn(2, hq, nq, 16, dtype=dtype)
    k, v = (torch.randn(2, hkv, nk, 16, dtype=dtype) for _ in range(2))
    sinks = torch.randn(hq) * 2

    def fa(q, k, v, s):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                   sinks=s, return_lse=True)  # fmt: skip

    _assert_close_to_fp64(fa, q, k, v, sinks, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("split", [1, 3])
def test_decode_kernel_merges_the_sink_once(split: int) -> None:
    # few rows against many keys: the split-KV decode kernel; chunk 0 alone starts from the sink
    q = torch.randn(2, 4, 2, 16)
    k, v = (torch.randn(2, 2, 70, 16) for _ in range(2))
    sinks = torch.randn(4)
    lengths = torch.tensor([70, 23], dtype=torch.int32)

    def fa(q, k, v, s):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=True, seqlens_k=lengths, num_splits=split,
                                   sinks=s, return_lse=True)  # fmt: skip

    _assert_close_to_fp64(fa, q, k, v, sinks, causal=True, seqlens_k=lengths)


def test_sinks_layout_and_compiled(use_compile: bool) -> None:
    # "b n h d" views, bf16 sinks with bf16 inputs (their gradient keeps their dtype), compiled
    q = torch.randn(1, 21, 2, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 26, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(2, dtype=torch.bfloat16)
    call = maybe_compile(flashlite.attention, use_compile)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = call(*leaves[:3], causal=True, layout="b n h d", sinks=leaves[3], return_lse=True)
    (o.float().square().sum() + lse.sum()).backward()
    ref = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ro, rlse = reference.attention(*(t.transpose(1, 2) for t in ref[:3]), True, sinks=ref[3],
                                   return_lse=True)  # fmt: skip
    (ro.transpose(1, 2).square().sum() + rlse.sum()).backward()
    assert leaves[3].grad.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), ro.transpose(1, 2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse.float(), atol=1e-2, rtol=0)
    for a, b in zip(leaves, ref, strict=True):
        scale = max(1.0, b.grad.abs().max().item())
        torch.testing.assert_close(a.grad.double(), b.grad, atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck prefers fp64, which no kernel takes
def test_gradcheck_fp32_sinks_through_output_and_lse() -> None:
    q = torch.randn(1, 2, 9, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(2))
    sinks = torch.randn(2, requires_grad=True)

    def fn(q, k, v, s):  # noqa: ANN001, ANN202
        o, lse = flashlite.attention(q, k, v, causal=True, sinks=s, return_lse=True)
        return o, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-3, atol=2e-3, rtol=1e-2,
                                    fast_mode=True)  # fmt: skip


def test_sink_state_edge_cases() -> None:
    q = torch.randn(1, 2, 12, 16)
    k, v = (torch.randn(1, 2, 5, 16) for _ in range(2))
    # a row that sees no key (causal, Nq > Nk): output 0 and LSE = its sink, not −inf
    sinks = torch.tensor([0.5, -3.0])
    o, lse = flashlite.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    blind = slice(0, 7)  # rows i < Nq − Nk see no key
    assert torch.equal(o[:, :, blind], torch.zeros_like(o[:, :, blind]))
    torch.testing.assert_close(lse[:, :, blind], sinks.view(1, 2, 1).expand(1, 2, 7))
    # a sink of −inf is no sink at all
    none = torch.full((2,), -math.inf)
    got, got_lse = flashlite.attention(q, k, v, sinks=none, return_lse=True)
    want, want_lse = flashlite.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=0)
    # a huge sink takes all the probability: output ~0, LSE = the sink
    big = torch.full((2,), 1e4)
    o, lse = flashlite.attention(q, k, v, sinks=big, return_lse=True)
    assert o.abs().max().item() < 1e-30
    torch.testing.assert_close(lse, torch.full_like(lse, 1e4))
    # no key at all
    empty = torch.randn(1, 2, 0, 16)
    o, lse = flashlite.attention(q, empty, empty, sinks=sinks, return_lse=True)
    assert not o.any() and torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 12))


def test_varlen_with_sinks() -> None:
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 4 if i == 0 else 2, 16, requires_grad=True) for i in range(3))
    sinks = torch.randn(4, requires_grad=True)
    o, lse = flashlite.attention_varlen(q, k, v, cu, cu, 21, 21, causal=True, sinks=sinks,
                                        return_lse=True)  # fmt: skip
    outs, lses = [], []
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    for a, b in ((0, 9), (9, 30)):
        one = [t[a:b].transpose(0, 1).unsqueeze(0) for t in ref[:3]]
        ro, rl = reference.attention(*one, True, sinks=ref[3], return_lse=True)
        outs.append(ro[0].transpose(0, 1))
        lses.append(rl[0])
    ro, rlse = torch.cat(outs), torch.cat(lses, -1)
    torch.testing.assert_close(o.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rlse.float(), atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ro)
    ((o * w.float()).sum() + lse.sum()).backward()
    ((ro * w).sum() + rlse.sum()).backward()
    for a, b in zip((q, k, v, sinks), ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_kvcache_with_sinks(paged: bool, split: int) -> None:
    b, hq, hkv, d, cap = 3, 4, 2, 16, 48
    q = torch.randn(b, 2, hq, d)
    k_new, v_new = (torch.randn(b, 2, hkv, d) for _ in range(2))
    lens = torch.tensor([5, 0, 40], dtype=torch.int32)
    sinks = torch.randn(hq)
    k_flat, v_flat = (torch.randn(b, cap, hkv, d) for _ in range(2))
    kw = {}
    if paged:  # pages of 16 keys, batch rows' pages shuffled across the pool
        order = torch.randperm(b * cap // 16)
        k_cache = k_flat.reshape(-1, 16, hkv, d)[order.argsort()].clone()
        v_cache = v_flat.reshape(-1, 16, hkv, d)[order.argsort()].clone()
        kw["block_table"] = order.view(b, cap // 16).to(torch.int32)
    else:
        k_cache, v_cache = k_flat.clone(), v_flat.clone()
    o, lse = flashlite.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new,
                                         v_new=v_new, num_splits=split, sinks=sinks,
                                         return_lse=True, **kw)  # fmt: skip
    for i, n in enumerate(lens.tolist()):  # what the append wrote, for the reference
        k_flat[i, n : n + 2], v_flat[i, n : n + 2] = k_new[i], v_new[i]
    ro, rlse = reference.attention(*(t.transpose(1, 2).double() for t in (q, k_flat, v_flat)),
                                   True, sinks=sinks.double(), seqlens_k=lens + 2,
                                   return_lse=True)  # fmt: skip
    torch.testing.assert_close(o.transpose(1, 2).double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rlse.float(), atol=1e-5, rtol=1e-5)


def test_kvcache_repeat_call_reads_the_new_sinks() -> None:
    # a second call of a kind seen before skips its checks: it must still read this call's sinks
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = (torch.randn(2, 30, 2, 16) for _ in range(2))
    lens = torch.tensor([30, 12], dtype=torch.int32)
    outs = []
    for sinks in (torch.zeros(4), torch.full((4,), 3.0), torch.zeros(4)):
        o = flashlite.attention_kvcache(q, k_cache, v_cache, cache_seqlens=lens, sinks=sinks)
        ro = reference.attention(*(t.transpose(1, 2).double() for t in (q, k_cache, v_cache)),
                                 True, sinks=sinks.double(), seqlens_k=lens)  # fmt: skip
        torch.testing.assert_close(o.transpose(1, 2).double(), ro, atol=1e-5, rtol=1e-5)
        outs.append(o)
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_opcheck_with_sinks() -> None:
    from torch.library import opcheck

    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 11, 16) for _ in range(2))
    sinks = torch.randn(2, requires_grad=True)
    fields = {"causal": True, "scale": 0.25}
    opcheck(torch.ops.flashlite.attention_fwd.default, (q, k, v), {"sinks": sinks, **fields})
    o, lse = torch.ops.flashlite.attention_fwd.default(q, k, v, sinks=sinks, **fields)
    grads = (torch.randn_like(o), q.detach(), k, v, o.detach(), lse.detach(), torch.randn_like(lse))
    opcheck(torch.ops.flashlite.attention_bwd.default, grads, {"sinks": sinks.detach(), **fields})


def test_kvcache_op_with_sinks_passes_opcheck_and_compiles() -> None:
    from torch.library import opcheck

    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16) for _ in range(2))
    new = [torch.randn(2, 1, 2, 16) for _ in range(2)]
    lens = torch.tensor([7, 30], dtype=torch.int32)
    sinks = torch.randn(4)
    args = (q, k_cache.clone(), v_cache.clone(), *new, [], [])
    fields = {"cache_seqlens": lens, "sinks": sinks, "causal": True, "scale": 0.25}
    opcheck(torch.ops.flashlite.attention_kvcache.default, args, {"num_splits": 2, **fields})

    def step(q, kc, vc, kn, vn, s):  # noqa: ANN001, ANN202
        return flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn,
                                           sinks=s)  # fmt: skip

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    eager = step(q, *caches[0], *new, sinks)
    compiled = torch.compile(step, fullgraph=True)(q, *caches[1], *new, sinks)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
    assert torch.equal(caches[0][0], caches[1][0])


def test_bad_sinks_raise_and_write_nothing() -> None:
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        flashlite.attention(q, q, q, sinks=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(2,\)"):
        flashlite.attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
        flashlite.attention(q, q, q, sinks=torch.zeros(1, 2))
    with pytest.raises(TypeError, match="sinks must have dtype torch.float32 or q's"):
        flashlite.attention(q, q, q, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must have dtype"):
        flashlite.attention(q, q, q, sinks=torch.zeros(2, dtype=torch.int32))
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="sinks must be on q's device"):
        flashlite.attention(q, q, q, sinks=meta)
    flat = q.transpose(1, 2)[0]
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
        flashlite.attention_varlen(flat, flat, flat, cu, cu, 4, 4, sinks=torch.zeros(5))
    # the cache is left as it was: every check comes before the append
    k_cache, v_cache = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    new = torch.ones(1, 1, 2, 16)
    lens = torch.zeros(1, dtype=torch.int32)
    for bad, err in ((torch.zeros(3), ValueError), (torch.zeros(2, dtype=torch.int64), TypeError)):
        with pytest.raises(err, match="sinks"):
            flashlite.attention_kvcache(q.transpose(1, 2)[:, :1], k_cache, v_cache,
                                        cache_seqlens=lens, k_new=new, v_new=new,
                                        sinks=bad)  # fmt: skip
        assert not k_cache.any() and not v_cache.any()
    # sinks that require grad: decoding computes (forward only) and a backward says so
    out = flashlite.attention_kvcache(
        q.transpose(1, 2)[:, :1],
        k_cache,
        v_cache,
        cache_seqlens=lens,
        k_new=new,
        v_new=new,
        sinks=torch.zeros(2, requires_grad=True),
    )
    assert k_cache.any()  # appended
    with pytest.raises(RuntimeError, match="forward-only.* through sinks,"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_sinks_every_kernel(causal: bool, d: int) -> None:
    """On the GPU: the Hopper (Gluon) forward and fused backward (bf16, plain masks), the
    Triton kernels (window, fp32) and the split-KV decode kernel, each against fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = "cuda"
    sinks = torch.randn(8, device=dev) * 2
    for dtype, window, nq, nk in ((torch.bfloat16, None, 1024, 1024),
                                   (torch.float16, (100, 0) if causal else None, 777, 1000),
                                   (torch.float32, None, 300, 513)):  # fmt: skip
        q = torch.randn(2, 8, nq, d, device=dev, dtype=dtype)
        k, v = (torch.randn(2, 4, nk, d, device=dev, dtype=dtype) for _ in range(2))

        def fa(q, k, v, s, window=window):  # noqa: ANN001, ANN202
            return flashlite.attention(q, k, v, causal=causal, window=window, sinks=s,
                                       return_lse=True)  # fmt: skip

        _assert_close_to_fp64(fa, q, k, v, sinks, causal=causal, window=window)
    q = torch.randn(4, 8, 1, d, device=dev, dtype=torch.bfloat16)  # decode: splits
    k, v = (torch.randn(4, 4, 20000, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    o, lse = flashlite.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    ro, rlse = reference.attention(q.double(), k.double(), v.double(), True,
                                   sinks=sinks.double(), return_lse=True)  # fmt: skip
    torch.testing.assert_close(o.double(), ro, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, rlse.float(), atol=1e-3, rtol=1e-3)
