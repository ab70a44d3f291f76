"""FP8 KV caches: e4m3 caches read by 16-bit queries, new keys quantised as they are appended,
and FP8 q, k, v through the split-KV decode kernel."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import flashlite
from flashlite import reference
from tests.conftest import TOL, maybe_compile

E4M3 = torch.float8_e4m3fn


def _cache(b=2, cap=64, hkv=2, d=16, per="head"):
    k, v = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    if per == "head":  # one factor per KV head, (Hkv,)
        ks, vs = (x.abs().amax(dim=(0, 1, 3)) / 448 for x in (k, v))
        view = (1, 1, hkv, 1)
    else:  # one per batch row and KV head, (B, Hkv)
        ks, vs = (x.abs().amax(dim=(1, 3)) / 448 for x in (k, v))
        view = (b, 1, hkv, 1)
    k8, v8 = (x / s.view(view) for x, s in ((k, ks), (v, vs)))
    return k8.to(E4M3), v8.to(E4M3), ks, vs, view


def _dequantised(x8, s, view):
    return x8.double() * s.double().view(view)


@pytest.mark.parametrize("per", ["head", "batch_head"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fp8_cache_append_and_decode(per: str, paged: bool) -> None:
    """New bf16 keys land in the cache as torch's own ``(x / descale).clamp(±448)`` e4m3
    rounding (bit for bit), and the step equals fp64 attention of the dequantised cache."""
    k8, v8, ks, vs, view = _cache(per=per)
    q = torch.randn(2, 2, 8, 16, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(2, 3, 2, 16, dtype=torch.bfloat16) * 3 for _ in range(2))
    lens = torch.tensor([17, 50], dtype=torch.int32)
    kc, vc, table = k8.clone(), v8.clone(), None
    if paged:  # pages of 16, shuffled
        table = torch.tensor([[3, 0, 6, 1], [2, 7, 5, 4]], dtype=torch.int32)
        kc, vc = (torch.empty(8, 16, 2, 16, dtype=E4M3) for _ in range(2))
        for b in range(2):
            for j in range(4):
                rows = slice(16 * j, 16 * j + 16)
                kc[table[b, j]], vc[table[b, j]] = k8[b, rows], v8[b, rows]
    with torch.no_grad():
        o = flashlite.attention_kvcache(
            q, kc, vc, cache_seqlens=lens, k_new=k_new, v_new=v_new, block_table=table,
            k_descale=ks, v_descale=vs,
        )  # fmt: skip
    if paged:  # back to one row per batch
        kc = torch.stack([kc[table[b]].reshape(64, 2, 16) for b in range(2)])
        vc = torch.stack([vc[table[b]].reshape(64, 2, 16) for b in range(2)])
    for b, n in enumerate(lens.tolist()):
        bv = view if per == "head" else (1, 1, 2, 1)
        kb, vb = (s if per == "head" else s[b] for s in (ks, vs))
        for new, cache, s in ((k_new, kc, kb), (v_new, vc, vb)):
            want = (new[b].float() / s.view(bv[1:])).clamp(-448, 448).to(E4M3)
            assert torch.equal(cache[b, n : n + 3].view(torch.uint8), want.view(torch.uint8))
        kd, vd = _dequantised(kc[b, : n + 3], kb, bv[1:]), _dequantised(vc[b, : n + 3], vb, bv[1:])
        one = [x[None].transpose(1, 2) for x in (q[b].double(), kd, vd)]
        ref = reference.attention(*one, causal=True, upcast=True).transpose(1, 2)[0]
        got = o[b].double()
        assert (got - ref).abs().max() <= 2 * TOL[torch.bfloat16].floor + 4e-3


def test_fp8_attention_through_the_split_kv_kernel() -> None:
    """FP8 q, k, v with ``num_splits``: the decode kernel widens them to bf16 (its result is
    at least as close to fp64 as the forward kernel's e4m3 probabilities)."""
    q, k, v = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    q8, sq = reference.quantize_e4m3(q, True, 2)
    (k8, sk), (v8, sv) = (reference.quantize_e4m3(x, True) for x in (k, v))
    with torch.no_grad():
        got = flashlite.attention(
            q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=True, num_splits=3
        )
    deq = [
        x.double() * s.double().repeat_interleave(x.shape[1] // 2, 1)[:, :, None, None]
        for x, s in ((q8, sq), (k8, sk), (v8, sv))
    ]
    ref = reference.attention(*deq, causal=True, upcast=True)
    assert got.dtype == torch.bfloat16
    assert (got.double() - ref).abs().max() <= 2 * TOL[torch.bfloat16].floor


def test_fp8_cache_compiles_and_passes_opcheck() -> None:
    k8, v8, ks, vs, _ = _cache(b=1, cap=32)
    q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32)

    def step(q, k8, v8, lens, ks, vs):
        return flashlite.attention_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=ks, v_descale=vs
        )

    with torch.no_grad():
        eager = step(q, k8, v8, lens, ks, vs)
        torch.testing.assert_close(maybe_compile(step, True)(q, k8, v8, lens, ks, vs), eager)
    ones = torch.ones(1, 2)
    fields = {"cache_seqlens": lens, "causal": True, "scale": 0.25, "validate": "off"}
    fields |= {"mask_tensors": [], "score_tensors": []}
    fields |= {"q_descale": ones, "k_descale": ks.expand(1, 2), "v_descale": vs.expand(1, 2)}
    # (test_schema left out: its checker multiplies the inputs, which torch's CPU kernels do
    # not do for e4m3)
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    opcheck(
        torch.ops.flashlite.attention_kvcache.default,
        (q, k8, v8, None, None),
        fields,
        test_utils=tests,
    )


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"k_descale": torch.ones(3)}, ValueError, r"k_descale must have shape \(1,\) or"),
        ({"v_descale": torch.ones(2, dtype=torch.float16)}, TypeError, "v_descale must be float32"),
        ({"cache": torch.float8_e5m2}, TypeError, "float8_e4m3fn only"),
        ({"q": torch.float32}, TypeError, "with 16-bit q, k_new, v_new"),
        ({"bf16_cache": True}, TypeError, "k_descale, v_descale: for torch.float8_e4m3fn"),
    ],
    ids=["shape", "dtype", "e5m2", "fp32_q", "bf16_cache"],
)
def test_fp8_cache_bad_input(change: dict, error: type, words: str) -> None:
    k8, v8, ks, vs, _ = _cache(b=1, cap=32)
    q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
    named = {"k_descale": ks, "v_descale": vs}
    if "cache" in change:
        k8, v8 = k8.float().to(change["cache"]), v8.float().to(change["cache"])
    elif "q" in change:
        q = q.to(change["q"])
    elif "bf16_cache" in change:
        k8, v8 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    else:
        named |= change
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(error, match=words), torch.no_grad():
        flashlite.attention_kvcache(q, k8, v8, cache_seqlens=lens, **named)


@pytest.mark.gpu
def test_fp8_cache_on_the_gpu() -> None:
    """The compiled decode and append kernels, paged with pages of 64, against the CPU's."""
    k8, v8, ks, vs, view = _cache(b=4, cap=1024, hkv=8, d=128)
    q = torch.randn(4, 1, 32, 128, dtype=torch.bfloat16)
    lens = torch.tensor([1, 300, 777, 1000], dtype=torch.int32)
    k_new, v_new = (torch.randn(4, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    outs = []
    for dev in ("cpu", "cuda"):
        args = [x.to(dev) for x in (q, k8.clone(), v8.clone(), lens, k_new, v_new, ks, vs)]
        with torch.no_grad():
            o = flashlite.attention_kvcache(
                args[0], args[1], args[2], cache_seqlens=args[3], k_new=args[4], v_new=args[5],
                k_descale=args[6], v_descale=args[7],
            )  # fmt: skip
        outs.append((o.cpu(), args[1].cpu()))
    assert torch.equal(outs[0][1].view(torch.uint8), outs[1][1].view(torch.uint8))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, (10, 0)], ids=["causal", "window_edge"])
def test_fp8_shared_prefix(window: tuple[int, int] | None) -> None:
    """An e4m3 prefix and caches with one factor per KV head: the same result as
    attention_kvcache over each request's ``[prefix ; cache]``, and the same appended bytes
    (a window whose edge cuts into the prefix takes the torch path, which dequantises)."""
    b, hkv, d, n_prefix, cap = 2, 2, 16, 40, 32
    prefix_k, prefix_v = (torch.randn(n_prefix, hkv, d).to(E4M3) for _ in range(2))
    k_cache, v_cache = (torch.randn(b, cap, hkv, d).to(E4M3) for _ in range(2))
    ks, vs = torch.rand(hkv) + 0.5, torch.rand(hkv) + 0.5
    q = torch.randn(b, 1, 8, d, dtype=torch.bfloat16)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    k_new, v_new = (torch.randn(b, 1, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    full_k, full_v = (
        torch.cat([p[None].expand(b, -1, -1, -1), c], 1)
        for p, c in ((prefix_k, k_cache), (prefix_v, v_cache))
    )
    common = {"k_new": k_new, "v_new": v_new, "k_descale": ks, "v_descale": vs, "window": window}
    with torch.no_grad():
        got = flashlite.attention_shared_prefix(
            q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens=lens, **common
        )
        want = flashlite.attention_kvcache(
            q, full_k, full_v, cache_seqlens=lens + n_prefix, **common
        )
    assert torch.equal(k_cache.view(torch.uint8), full_k[:, n_prefix:].view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
    with pytest.raises(ValueError, match="k_descale must have shape"), torch.no_grad():
        flashlite.attention_shared_prefix(
            q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens=lens,
            k_descale=torch.ones(b, hkv).add(1), v_descale=vs,
        )  # fmt: skip


@pytest.mark.gpu
def test_fp8_cache_step_makes_no_host_sync_and_graphs_capture_it() -> None:
    """The default call (device validation, append, decode) syncs nothing, so a CUDA graph
    captures it; its replay appends and attends as the eager call does."""
    k8, v8, ks, vs, _ = _cache(b=2, cap=256, hkv=2, d=64)
    k8, v8, ks, vs = (x.cuda() for x in (k8, v8, ks, vs))
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    lens = torch.tensor([10, 200], dtype=torch.int32, device="cuda")

    def step(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return flashlite.attention_kvcache(
            q, kc, vc, cache_seqlens=lens, k_new=k_new, v_new=v_new, k_descale=ks, v_descale=vs
        )

    with torch.no_grad():
        eager_k, eager_v = k8.clone(), v8.clone()
        want = step(eager_k, eager_v)  # (warm-up: plans made, kernels compiled)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(k8.clone(), v8.clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph_k, graph_v = k8.clone(), v8.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(graph_k, graph_v)
        graph_k.copy_(k8)
        graph_v.copy_(v8)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(graph_k.view(torch.uint8), eager_k.view(torch.uint8))
    torch.testing.assert_close(out, want)


def test_fp8_cache_kind_kept_and_factors_read_each_call() -> None:
    """A second FP8 step of the same kind skips the argument checks (its plan is kept) but
    reads this call's factors; factors with a bf16 cache are refused on that path too."""
    from flashlite.ops.attention import kvcache as KV

    k8, v8, ks, vs, _ = _cache(b=2, cap=64)
    q = torch.randn(2, 1, 8, 16, dtype=torch.bfloat16)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    with torch.no_grad():
        first = flashlite.attention_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=ks, v_descale=vs
        )
        kept = len(KV.checked_kvcache)
        again = flashlite.attention_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=ks, v_descale=vs
        )
        doubled = flashlite.attention_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=ks, v_descale=2 * vs
        )
        bf16 = (k8.float() * ks.view(1, 1, -1, 1)).to(torch.bfloat16)
        flashlite.attention_kvcache(q, bf16, bf16, cache_seqlens=lens)  # (a bf16 kind, kept)
        with pytest.raises(TypeError, match="for torch.float8_e4m3fn caches"):
            flashlite.attention_kvcache(q, bf16, bf16, cache_seqlens=lens, k_descale=ks)
    assert kept >= 1 and torch.equal(again, first)
    torch.testing.assert_close(doubled, 2 * first, atol=1e-2, rtol=1e-2)
