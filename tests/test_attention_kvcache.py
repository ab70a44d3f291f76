"""flashlite.attention_kvcache (issue 11, must 4): decoding against a contiguous or paged KV
cache, new keys appended in place, keys split across programs (flash-decoding).

Every case is checked against the fp64 reference on each batch's keys alone (within twice
PyTorch's own low-precision error plus the dtype's floor), and the cache is read back after the
append.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TOL

import flashlite
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, HQ, HKV, D, CAP = 3, 4, 2, 32, 96


def _reference(q, k_cache, v_cache, lengths, upcast, **kw):  # noqa: ANN001, ANN202
    """(B, Nq, Hq, D): each batch's queries against its first ``lengths[b]`` cached keys."""
    outs = []
    for b, n in enumerate(lengths.tolist()):
        one = [t[b : b + 1, :m].transpose(1, 2) for t, m in ((q, q.shape[1]), (k_cache, n),
                                                             (v_cache, n))]  # fmt: skip
        outs.append(ref_attention(*one, upcast=upcast, **kw).transpose(1, 2))
    return torch.cat(outs)


def _case(dtype, nq, n_new, lengths):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(nq * 100 + n_new)
    q = torch.randn(B, nq, HQ, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, CAP, HKV, D, generator=gen).to(dtype) for _ in range(2))
    new = [torch.randn(B, n_new, HKV, D, generator=gen).to(dtype) for _ in range(2)]
    return q, k, v, (new if n_new else [None, None]), torch.tensor(lengths, dtype=torch.int32)


def _appended(k, v, new, lengths):  # noqa: ANN001, ANN202
    k, v = k.clone(), v.clone()
    if new[0] is not None:
        for b, n in enumerate(lengths.tolist()):
            k[b, n : n + new[0].shape[1]] = new[0][b]
            v[b, n : n + new[1].shape[1]] = new[1][b]
    return k, v


def _paged(k, v, page_size, gen_seed=0):  # noqa: ANN001, ANN202
    """The same cache in shuffled pages, plus spare pages of noise: (k_pages, v_pages, table)."""
    per = CAP // page_size
    gen = torch.Generator().manual_seed(gen_seed)
    n_pages = B * per + 3
    table = torch.randperm(n_pages, generator=gen)[: B * per].view(B, per).to(torch.int32)
    kp = torch.randn(n_pages, page_size, HKV, D, generator=gen).to(k.dtype)
    vp = torch.randn(n_pages, page_size, HKV, D, generator=gen).to(k.dtype)
    for b in range(B):
        for j in range(per):
            kp[table[b, j]] = k[b, j * page_size : (j + 1) * page_size]
            vp[table[b, j]] = v[b, j * page_size : (j + 1) * page_size]
    return kp, vp, table


def _unpage(pages, table):  # noqa: ANN001, ANN202
    return torch.cat([pages[table[b].long()].reshape(1, -1, HKV, D) for b in range(B)])


CASES = [
    # (Nq, Nnew, lengths already cached, causal, window, softcap)
    (1, 0, [50, 0, 95], True, None, None),  # decode, an empty cache among them
    (1, 1, [50, 0, 94], True, None, None),  # decode with append
    (4, 4, [1, 30, 92], True, (20, 0), None),  # four new tokens, sliding window
    (1, 0, [96, 17, 1], False, None, 5.0),  # a full cache, softcap
    (3, 2, [0, 40, 90], True, None, None),  # Nq > Nnew: the first query sees fewer keys
]


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"nq{c[0]}-new{c[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_contiguous(dtype: torch.dtype, case: tuple, num_splits: int | None) -> None:
    nq, n_new, lengths, causal, window, softcap = case
    q, k, v, new, seqlens = _case(dtype, nq, n_new, lengths)
    kc, vc = k.clone(), v.clone()
    out, lse = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=new[0],
                                           v_new=new[1], causal=causal, window=window,
                                           softcap=softcap, num_splits=num_splits,
                                           return_lse=True)  # fmt: skip
    k_want, v_want = _appended(k, v, new, seqlens)
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)  # the append, read back
    total = seqlens + n_new
    kw = {"causal": causal, "window": window, "softcap": softcap}
    want = _reference(q, k_want, v_want, total, True, **kw)
    torch_lp = _reference(q, k_want, v_want, total, False, **kw)
    err = (out.double() - want).abs().max().item()
    torch_err = (torch_lp.double() - want).abs().max().item()
    assert err <= 2 * torch_err + TOL[dtype].floor, (err, torch_err)
    assert lse.shape == (B, HQ, nq) and torch.isneginf(lse[total == 0]).all()


@pytest.mark.parametrize("page_size", [16, 32, 48])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_equals_contiguous(page_size: int, num_splits: int) -> None:
    if CAP % page_size:
        pytest.skip("the test cache holds whole pages")
    q, k, v, new, seqlens = _case(torch.float16, 2, 2, [10, 0, 70])
    kc, vc = k.clone(), v.clone()
    want = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=new[0],
                                       v_new=new[1], num_splits=num_splits)  # fmt: skip
    kp, vp, table = _paged(k, v, page_size)
    got = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, k_new=new[0],
                                      v_new=new[1], block_table=table,
                                      num_splits=num_splits)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # (tiles may differ on a GPU)
    assert torch.equal(_unpage(kp, table), kc) and torch.equal(_unpage(vp, table), vc)


def test_splits_agree() -> None:
    q, k, v, _, seqlens = _case(torch.float32, 1, 0, [96, 33, 5])
    outs = [flashlite.attention_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=s,
                                        return_lse=True) for s in (1, 2, 3, 6)]  # fmt: skip
    for o, lse in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], atol=2e-6, rtol=0)
        torch.testing.assert_close(lse, outs[0][1], atol=2e-6, rtol=0)


def test_bad_kvcache_arguments_write_nothing() -> None:
    q, k, v, new, seqlens = _case(torch.float32, 1, 1, [95, 10, 3])
    table = torch.zeros(B, CAP // 16, dtype=torch.int32)
    kc, vc = k.clone(), v.clone()
    with pytest.raises(ValueError, match="capacity"):  # 95 + 1 fits, 96 + 1 does not
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens + 1, k_new=new[0],
                                    v_new=new[1], validate="sync")  # fmt: skip
    assert torch.equal(kc, k) and torch.equal(vc, v)
    with pytest.raises(TypeError, match="int32"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens.long())
    with pytest.raises(ValueError, match="both or neither"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=new[0])
    kp = torch.zeros(4, 16, HKV, D)
    bad = table.clone()
    bad[0, 0] = 7  # page 7 of 4, in use by batch 0
    for validate in (True, "sync"):
        with pytest.raises(ValueError, match="block_table"):
            flashlite.attention_kvcache(q, kp, kp.clone(), cache_seqlens=seqlens, block_table=bad,
                                        validate=validate)  # fmt: skip
    with pytest.raises(ValueError, match="page size"):
        flashlite.attention_kvcache(q, torch.zeros(4, 24, HKV, D), torch.zeros(4, 24, HKV, D),
                                    cache_seqlens=seqlens, block_table=table)  # fmt: skip
    with pytest.raises(ValueError, match="num_splits"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=0)
    assert torch.equal(kc, k) and torch.equal(vc, v) and not kp.any()


def test_shapes_that_are_not_b_n_h_d_say_the_layout() -> None:
    """The cache call's layout is fixed at b n h d: a q (or caches) given as b h n d is told
    so, with the shapes expected and given and the transposes that fix it."""
    q, k, v, _, seqlens = _case(torch.float32, 1, 0, [10, 20, 30])  # q (3, 1, 4, 32), Hkv 2
    qb, kb = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # as b h n d
    head = r"layout is fixed at 'b n h d': q must be \(B, Nq, Hq, D\) and k_cache, v_cache "
    cases = (  # (q, caches, what the message ends with)
        (qb, k, r"\(B, Ncap, Hkv, D\).*got q \(3, 4, 1, 32\) and k_cache \(3, 96, 2, 32\) "
         r"\(read as Hq=1, Hkv=2: Hq is not a multiple of Hkv\); q looks like 'b h n d': "
         r"pass q.transpose\(1, 2\)$"),
        (q, kb, r"; k_cache and v_cache look like 'b h n d': pass "
         r"k_cache.transpose\(1, 2\), v_cache.transpose\(1, 2\)$"),
        (qb, kb, r"; q, k_cache and v_cache look like 'b h n d'"),
        (qb[:, :1], k, r"\(read as Hq=1, Hkv=2: Hq is not a multiple of Hkv\)$"),  # no hint
        (q, k[..., :16], r"\(q's D=32, the caches' D=16\)$"),
        (q, k[:2], r"\(q's B=3, the caches' B=2\)$"),
    )  # fmt: skip
    for qq, kk, tail in cases:
        with pytest.raises(ValueError, match=head + ".*" + tail):
            flashlite.attention_kvcache(qq, kk, kk.clone(), cache_seqlens=seqlens)
    kp = torch.zeros(4, 16, HKV, D)  # paged: (num_pages, page_size, Hkv, D)
    table = torch.zeros(B, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k_cache, v_cache \(num_pages, page_size, Hkv, D\).*"
                       r"q looks like 'b h n d'"):  # fmt: skip
        flashlite.attention_kvcache(qb, kp, kp.clone(), cache_seqlens=seqlens, block_table=table)
    # the fix the message names gives the b n h d call's result
    want = flashlite.attention_kvcache(q, k, v, cache_seqlens=seqlens)
    got = flashlite.attention_kvcache(qb.transpose(1, 2), kb.transpose(1, 2),
                                      v.transpose(1, 2).contiguous().transpose(1, 2),
                                      cache_seqlens=seqlens)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_repeated_calls_reuse_the_plan_and_still_check_values() -> None:
    """A decode loop's second call of one kind runs the plan made by the first (its argument
    checks skipped: they read only what the plan's key pins), on the new tensors' data; value
    checks still run every call, and a new kind of call is checked afresh."""
    from flashlite.ops.attention import kvcache as ops

    q, k, v, new, seqlens = _case(torch.float32, 1, 1, [40, 10, 3])
    ops.checked_kvcache.clear()
    first = flashlite.attention_kvcache(q, k.clone(), v.clone(), cache_seqlens=seqlens,
                                        k_new=new[0], v_new=new[1])  # fmt: skip
    assert len(ops.checked_kvcache) == 1
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
    lens2 = torch.tensor([95, 0, 7], dtype=torch.int32)
    kc, vc = k2.clone(), v2.clone()
    out = flashlite.attention_kvcache(q2, kc, vc, cache_seqlens=lens2, k_new=new[0],
                                      v_new=new[1])  # fmt: skip
    assert len(ops.checked_kvcache) == 1  # the same plan, other data
    ka, va = _appended(k2, v2, new, lens2)
    assert torch.equal(kc, ka) and torch.equal(vc, va)
    want = _reference(q2, ka, va, lens2 + 1, True, causal=True)
    torch.testing.assert_close(out.double(), want.double(), atol=1e-5, rtol=0)
    assert not torch.equal(out, first)
    with pytest.raises(ValueError, match="capacity"):  # values: checked on every call
        flashlite.attention_kvcache(q2, kc, vc, cache_seqlens=lens2 + 1, k_new=new[0],
                                    v_new=new[1])  # fmt: skip
    # (checked on the device: the bad row 0 wrote nothing, rows 1 and 2 their new key)
    assert torch.equal(kc[0], ka[0]) and torch.equal(kc[1:, :1], ka[1:, :1])
    kc, vc = ka.clone(), va.clone()
    with pytest.raises(TypeError, match="scale"):  # a new kind of call: checked
        flashlite.attention_kvcache(q2, kc, vc, cache_seqlens=lens2, scale="1")
    with pytest.raises(ValueError, match="scale"):
        flashlite.attention_kvcache(q2, kc, vc, cache_seqlens=lens2, scale=-1.0)
    with pytest.raises(ValueError, match="k_cache"):  # one dimension more: another key
        flashlite.attention_kvcache(q2, kc[:2], vc[:2], cache_seqlens=lens2)
    # an option the key cannot hold (a list window) is checked and run every call
    for _ in range(2):
        out = flashlite.attention_kvcache(q2, ka, va, cache_seqlens=lens2 + 1, window=[20, 0])
    want = _reference(q2, ka, va, lens2 + 1, True, causal=True, window=(20, 0))
    torch.testing.assert_close(out.double(), want.double(), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16, 256], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("num_splits", [1, None], ids=lambda s: f"splits{s}")
def test_gpu_decode(page_size: int, num_splits: int | None) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bsz, cap, hq, hkv, d = 2, 8192, 32, 8, 128
    q = torch.randn(bsz, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(bsz, cap, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([8000, 1], dtype=torch.int32, device="cuda")
    if page_size:
        per = cap // page_size
        table = torch.randperm(bsz * per, device="cuda").view(bsz, per).to(torch.int32)
        kp = torch.empty(bsz * per, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        kp[table.long()] = k.view(bsz, per, page_size, hkv, d)
        vp[table.long()] = v.view(bsz, per, page_size, hkv, d)
        out = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                          num_splits=num_splits)  # fmt: skip
    else:
        out = flashlite.attention_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)
    want = _reference(q.float(), k.float(), v.float(), seqlens.cpu(), False, causal=True)
    assert (out.float() - want).abs().max().item() <= 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_kernel_equals_the_torch_merge(dtype: torch.dtype) -> None:
    """The split-KV combine against its torch twin, stats.merge_attention folded over the
    splits; partials that saw no key (LSE −inf) and rows no split saw included."""
    from flashlite import stats
    from flashlite.ops.attention import combine_splits

    gen = torch.Generator().manual_seed(5)
    splits, b, h, nq, d = 5, 2, 3, 4, 24
    o_parts = torch.randn(splits, b, h, nq, d, generator=gen)
    lse_parts = torch.randn(splits, b, h, nq, generator=gen) * 30
    lse_parts[1] = float("-inf")  # a chunk past every sequence
    lse_parts[:, 1, 2, 3] = float("-inf")  # a row no chunk saw
    o_parts[1] = 0.0
    o_parts[:, 1, 2, 3] = 0.0
    o = torch.empty(b, h, nq, d, dtype=dtype)
    lse = torch.empty(b, h, nq)
    combine_splits(o_parts, lse_parts, o, lse)
    want_o, want_lse = o_parts[0].double(), lse_parts[0].double()
    for s in range(1, splits):
        want_o, want_lse = stats.merge_attention(want_o, want_lse, o_parts[s].double(),
                                                 lse_parts[s].double())  # fmt: skip
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(o.double(), want_o, atol=TOL[dtype].floor, rtol=0)
    assert torch.isneginf(lse[1, 2, 3]) and not o[1, 2, 3].any()


def test_unvalidated_calls_stay_inside_the_caches() -> None:
    """``validate=False`` (no host sync) gives the same results for good values; bad lengths
    and page ids are clamped, never read or written outside the caches."""
    q, k, v, new, seqlens = _case(torch.float32, 1, 1, [95, 10, 3])
    runs = []
    for validate in (True, False):
        kc, vc = k.clone(), v.clone()
        out = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=new[0],
                                          v_new=new[1], validate=validate)  # fmt: skip
        runs.append((out, kc, vc))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    bad = torch.tensor([500, -7, 96], dtype=torch.int32)
    out = flashlite.attention_kvcache(q, k.clone(), v.clone(), cache_seqlens=bad, k_new=new[0],
                                      v_new=new[1], validate=False)  # fmt: skip
    assert out.shape == q.shape and torch.isfinite(out).all()
    kp, vp, table = _paged(k, v, 16)
    table[0, 0], table[1, 2] = 10_000, -3
    out = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=bad, block_table=table,
                                      k_new=new[0], v_new=new[1], validate=False)  # fmt: skip
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "mask", [(True, None, None), (False, (9, 2), 4.0), (True, (30, 0), None)],
    ids=["causal", "window-softcap", "causal-window"],
)  # fmt: skip
def test_packed_rows_span_row_blocks(mask: tuple) -> None:
    """G = 3 query heads per KV head and Nq = 7: 21 packed rows, so two 16-row blocks with the
    second starting inside a query position's group; every row is masked by its own position,
    with a per-batch key length, split or not."""
    from flashlite.masking.masks import describe
    from flashlite.ops.attention import attention_decode_fwd

    causal, window, softcap = mask
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 7, 32, generator=gen)  # (B, Hq, Nq, D)
    k, v = (torch.randn(2, 2, 96, 32, generator=gen) for _ in range(2))
    lens = torch.tensor([96, 23], dtype=torch.int32)
    for splits in (1, 3):
        o, lse, used = attention_decode_fwd(q, k, v, lens, describe(causal, window, softcap),
                                            32**-0.5, num_splits=splits)  # fmt: skip
        assert used == splits
        for b, n in enumerate(lens.tolist()):
            want, want_lse = ref_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                           causal, upcast=True, return_lse=True, window=window,
                                           softcap=softcap)  # fmt: skip
            torch.testing.assert_close(o[b : b + 1].double(), want.double(), atol=2e-5, rtol=0)
            torch.testing.assert_close(lse[b : b + 1].double(), want_lse.double(), atol=2e-5,
                                       rtol=0)  # fmt: skip


def test_gpu_decode_tiles_fit_shared_memory() -> None:
    """The GPU's decode tile (chosen on CPU too: a host function) is the measured one for bf16
    at D = 128 and shrinks its key tile until fp32 or D = 256 fits the shared memory."""
    from flashlite.kernels import configs as C

    assert C.decode_config(4, False, 8) == C.GPU_DECODE_CONFIGS[0]
    assert C.decode_config(4, False, 64) == C.GPU_DECODE_CONFIGS[1]
    assert C.decode_config(64, False, 8) == C.GPU_DECODE_CONFIGS[2]
    for rows in (4, 64):
        for block_d in (16, 64, 128, 256):
            for elem in (2, 4):
                cfg = C.decode_config(rows, False, 8, block_d, elem)
                plain = C.Config(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
                assert C.keep_config(plain, block_d, elem, False), (rows, block_d, elem, cfg)
    assert C.decode_config(4, False, 8, 256, 2).block_n == 64
    assert C.decode_config(4, True, 8) == C.CPU_DECODE_CONFIG


def test_kvcache_is_a_torch_op_that_compiles() -> None:
    """``flashlite::attention_kvcache`` (the caches are declared mutated): opcheck's schema,
    fake and dispatch tests, and a compiled decode step that appends and attends like eager."""
    from torch.library import opcheck

    q, k, v, new, seqlens = _case(torch.float32, 2, 2, [10, 0, 70])
    table = _paged(k, v, 16)[2]
    for paged in (False, True):
        kc, vc = (_paged(k, v, 16)[:2]) if paged else (k.clone(), v.clone())
        args = (q, kc, vc, new[0], new[1], [], [])  # (no mask or score function)
        fields = {"cache_seqlens": seqlens, "block_table": table if paged else None}
        fields |= {"causal": True, "scale": 32**-0.5, "num_splits": 2, "validate": "device"}
        opcheck(torch.ops.flashlite.attention_kvcache.default, args, fields)

    for validate in (False, True):  # (the default's device check runs inside the op)

        def step(q, kc, vc, kn, vn, validate=validate):  # noqa: ANN001, ANN202
            return flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn,
                                               v_new=vn, softcap=5.0,
                                               validate=validate)  # fmt: skip

        caches = [(k.clone(), v.clone()) for _ in range(2)]
        eager = step(q, *caches[0], *new)
        compiled = torch.compile(step, fullgraph=True)(q, *caches[1], *new)
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("validate", [True, "sync"])
def test_bad_values_write_nothing_into_their_row(validate: bool | str) -> None:
    """A bad length or page: with the device check (the default) the bad batch row writes no
    key and the others are appended, and this call raises (on the CPU: nothing to wait for);
    with ``"sync"`` nothing at all is written. The message quotes the value either way."""
    q, k, v, new, seqlens = _case(torch.float32, 1, 2, [40, 95, 3])
    kc, vc = k.clone(), v.clone()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 95, Nnew = 2"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=new[0], v_new=new[1],
                                    validate=validate)  # fmt: skip
    ka, va = _appended(k, v, new, torch.tensor([40, 0, 3], dtype=torch.int32))  # (rows 0, 2)
    assert torch.equal(kc[1], k[1]) and torch.equal(vc[1], v[1])  # the bad row: untouched
    for got, want, base in zip((kc, vc), (ka, va), (k, v), strict=True):
        rows = want if validate is True else base  # the good rows: appended, or untouched
        assert torch.equal(got[0], rows[0]) and torch.equal(got[2], rows[2])
    # the record was reported and cleared: a good call afterwards runs and raises nothing
    good = flashlite.attention_kvcache(q, k.clone(), v.clone(), cache_seqlens=seqlens - 3,
                                       k_new=new[0], v_new=new[1])  # fmt: skip
    assert torch.isfinite(good).all()
    kp, vp, table = _paged(k, v, 16)
    table[0, 1] = -4
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -4"):
        flashlite.attention_kvcache(q, kp, vp, cache_seqlens=seqlens - 3, block_table=table,
                                    validate=validate)  # fmt: skip


def test_device_check_reports_an_earlier_calls_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the device check is reported by a later call: simulated on the CPU by a record
    that a previous call left (what the kernel writes), which the next call raises, naming it as
    an earlier call's, and then clears."""
    from flashlite.ops.attention import checks

    q, k, v, new, seqlens = _case(torch.float32, 1, 1, [4, 5, 6])
    record, host, _ = checks.kv_record(q.device)
    record.copy_(torch.tensor([1, 2, 1, 0, 95, 2, 96]))  # flag, kind, b, j, value, Nnew, limit
    with pytest.raises(ValueError, match=r"an earlier flashlite.attention_kvcache call.*"
                       r"cache_seqlens\[1\] = 95, Nnew = 2"):  # fmt: skip
        flashlite.attention_kvcache(q, k.clone(), v.clone(), cache_seqlens=seqlens, k_new=new[0],
                                    v_new=new[1])  # fmt: skip
    assert not record.any() and not host.any()
    out = flashlite.attention_kvcache(q, k.clone(), v.clone(), cache_seqlens=seqlens,
                                      k_new=new[0], v_new=new[1])  # fmt: skip
    assert torch.isfinite(out).all()


def test_validate_takes_true_false_or_sync() -> None:
    q, k, v, _, seqlens = _case(torch.float32, 1, 0, [4, 5, 6])
    with pytest.raises(TypeError, match="validate must be True, False or 'sync'"):
        flashlite.attention_kvcache(q, k, v, cache_seqlens=seqlens, validate="yes")
