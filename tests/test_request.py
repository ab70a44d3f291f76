"""One description of an attention call (:class:`flashlite.ops.attention.Request`): every option
is a field, every field makes a call non-plain and enters the plan's key, every option reaches
the kernel, and a launcher that does not take a field refuses it by name."""

from __future__ import annotations

import pytest
import torch

import flashlite
from flashlite import reference
from flashlite.ops.attention import Request, attention_bwd, attention_fwd

#: A value for each optional field (tensors: small int32/fp32 ones).
SAMPLES = {
    "window_left": 3,
    "window_right": 2,
    "softcap": 5.0,
    "seqlens_k": torch.tensor([5], dtype=torch.int32),
    "cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32),
    "cu_seqlens_k": torch.tensor([0, 6], dtype=torch.int32),
    "max_seqlen_q": 4,
    "max_seqlen_k": 6,
    "num_splits": 2,
    "sinks": torch.zeros(2),
    "q_descale": torch.ones(1, 1),
    "k_descale": torch.ones(1, 1),
    "v_descale": torch.ones(1, 1),
    "out_dtype": torch.bfloat16,
    "head_dim_v": 8,
    "cache_seqlens": torch.tensor([3], dtype=torch.int32),
    "block_table": torch.zeros(1, 2, dtype=torch.int32),
    "validate": "sync",
    "mask_mod": "flashlite.gallery.sliding_window:i",
    "mask_tensors": [torch.zeros(3, dtype=torch.int32)],
    "mask_nums": [2.0],
    "score_mod": "flashlite.gallery.alibi:t",
    "score_tensors": [torch.zeros(2)],
    "score_nums": [1.0],
    "block_tables": [torch.zeros(1, 1, 1, dtype=torch.int32)] * 8,
    "block_size": [16, 16],
}


def test_the_samples_cover_every_field() -> None:
    # a new option is a new field: this file must then say how it reaches the kernel
    assert set(SAMPLES) == set(Request._fields[2:])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_field_makes_the_call_non_plain_and_enters_the_key(name: str) -> None:
    plain = Request.make(False, 0.25)
    request = Request.make(False, 0.25, **{name: SAMPLES[name]})
    assert plain.plain and not request.plain
    assert request.given() == [name]
    assert request.key != plain.key
    hash(request.key)  # a tensor field enters as its kind, never its contents
    if isinstance(SAMPLES[name], torch.Tensor):
        again = Request.make(False, 0.25, **{name: SAMPLES[name].clone()})
        assert again.key == request.key


def test_normal_form() -> None:
    # one kernel path, one request: flash-attn's -1 sides, a (-1, 0) window, a zero cap or split
    assert Request.make(False, 0.5, -1, -1, 0.0, num_splits=0) == Request(0.5)
    assert Request.make(False, 0.5, -1, 0) == Request(0.5, True)
    assert Request.make(True, 0.5, 4, 7) == Request(0.5, True, 4, None)
    assert Request.make(True, 0.5, 4, 7).mask == flashlite.masks.describe(True, (4, 7))


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, n, 16, generator=gen) for n in (4, 6, 6))


#: Each public option of flashlite.attention, as the user passes it (num_splits: a plan choice
#: with the same result, checked below by where it runs)
OPTIONS = {
    "window_left": {"window": (1, -1)},
    "window_right": {"window": (-1, 0)},  # (causal's path: checked as a mask of its own)
    "softcap": {"softcap": 0.5},
    "seqlens_k": {"seqlens_k": torch.tensor([3], dtype=torch.int32)},
    "sinks": {"sinks": torch.tensor([2.0, -1.0])},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_reaches_the_kernel(name: str) -> None:
    # the result follows the option (fp64 reference) and differs from the call without it: an
    # option dropped on the way would give the plain result
    q, k, v = _inputs()
    options = OPTIONS[name]
    got = flashlite.attention(q, k, v, **options)
    want = reference.attention(q.double(), k.double(), v.double(), **options)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    plain = flashlite.attention(q, k, v)
    assert (got - plain).abs().max() > 1e-3


def test_fp8_descales_reach_the_kernel() -> None:
    # each factor scales what it should: q's and k's the scores, v's the output
    q, k, v = (x.to(torch.float8_e4m3fn) for x in _inputs())
    one, two = torch.ones(1), torch.full((1,), 2.0)
    with torch.no_grad():
        base = flashlite.attention(q, k, v, out_dtype=torch.float32)
        for name in ("q_descale", "k_descale"):
            got = flashlite.attention(q, k, v, out_dtype=torch.float32, **{name: two})
            want = flashlite.attention(q, k, v, scale=0.5, out_dtype=torch.float32)  # 2/sqrt(16)
            torch.testing.assert_close(got, want)
            assert (got - base).abs().max() > 1e-3
        got = flashlite.attention(q, k, v, q_descale=one, v_descale=two, out_dtype=torch.float32)
    torch.testing.assert_close(got, 2 * base)


def test_splits_reach_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashlite import _caches
    from flashlite.ops.attention import planner

    seen = []
    decode = planner.split_kv.plan_decode

    def spy(q, k, v, o, request):  # noqa: ANN001, ANN202
        seen.append(request.num_splits)
        return decode(q, k, v, o, request)

    _caches.clear()  # (a kept plan of this kind would skip the planner)
    monkeypatch.setattr(planner.split_kv, "plan_decode", spy)
    q, k, v = _inputs()
    got = flashlite.attention(q, k, v, num_splits=2)
    assert seen == [2]
    torch.testing.assert_close(got, flashlite.attention(q, k, v, num_splits=1))


def test_varlen_fields_reach_the_kernel() -> None:
    # two sequences packed: each equals its own dense call
    q, k, v = _inputs()
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 6], dtype=torch.int32)
    request = Request.make(
        True, 0.25, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4
    )
    o, _, _ = attention_fwd(q, k, v, request)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want = flashlite.attention(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=True, scale=0.25
        )
        torch.testing.assert_close(o[:, :, rows], want)


def test_a_field_a_launcher_does_not_take_is_refused_by_name() -> None:
    q, k, v = _inputs()
    o, lse, _ = attention_fwd(q, k, v, Request(0.25))
    request = Request.make(False, 0.25, num_splits=2)  # (the forward's alone)
    with pytest.raises(NotImplementedError, match="num_splits"):
        attention_bwd(torch.ones_like(o), q, k, v, o, lse, None, request)
    with pytest.raises(NotImplementedError, match="window_left, sinks"):
        Request.make(False, 1.0, 3, sinks=torch.zeros(2)).refuse("this backend")


def test_the_ops_take_the_fields_by_name() -> None:
    from flashlite.ops.attention.planner import FWD_FIELDS

    schema = str(torch.ops.flashlite.attention_fwd.default._schema)
    for name in FWD_FIELDS:
        assert f" {name}" in schema, name
    q, k, v = _inputs()
    o, lse = torch.ops.flashlite.attention_fwd(q, k, v, causal=True, scale=0.25, window_left=2)
    want = flashlite.attention(q, k, v, causal=True, scale=0.25, window=(2, 0), return_lse=True)
    torch.testing.assert_close((o, lse), want)


def _cache() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k, v = (torch.randn(2, 32, 2, 16, generator=gen) for _ in range(2))
    return q, k, v, torch.tensor([9, 30], dtype=torch.int32)


#: attention_kvcache's options as the user passes them, beyond cache_seqlens (each changes the
#: result of the call on _cache(); the mods' buffers travel as their tensor and number fields)
CACHE_OPTIONS = {
    "block_table": {},  # (checked below: a paged copy gives the contiguous result)
    "mask_mod": {"mask_mod": flashlite.gallery.sliding_window(3)},
    "score_mod": {"score_mod": flashlite.gallery.alibi(flashlite.gallery.alibi_slopes(4))},
    "window": {"window": (4, 0)},
}


@pytest.mark.parametrize("name", sorted(CACHE_OPTIONS))
def test_each_cache_option_reaches_the_kernel(name: str) -> None:
    q, k, v, lens = _cache()
    plain = flashlite.attention_kvcache(q, k, v, cache_seqlens=lens)
    if name == "block_table":  # the same keys through shuffled pages of 16
        table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
        kp, vp = (torch.empty(4, 16, 2, 16) for _ in range(2))
        for b in range(2):
            for j in range(2):
                rows = slice(16 * j, 16 * j + 16)
                kp[table[b, j]], vp[table[b, j]] = k[b, rows], v[b, rows]
        got = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
        torch.testing.assert_close(got, plain)
        return
    got = flashlite.attention_kvcache(q, k, v, cache_seqlens=lens, **CACHE_OPTIONS[name])
    assert (got - plain).abs().max() > 1e-3
    # the lengths themselves: each row sees its own first cache_seqlens keys
    for b, n in enumerate(lens.tolist()):
        one = [t[b : b + 1, :m].transpose(1, 2) for t, m in ((q, 1), (k, n), (v, n))]
        want = reference.attention(*one, causal=True).transpose(1, 2)
        torch.testing.assert_close(plain[b : b + 1], want, atol=2e-5, rtol=2e-5)


def test_validate_reaches_the_cache_checks() -> None:
    q, k, v, lens = _cache()
    bad = torch.tensor([9, 40], dtype=torch.int32)  # past the capacity
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashlite.attention_kvcache(q, k, v, cache_seqlens=bad, validate="sync")
    flashlite.attention_kvcache(q, k, v, cache_seqlens=bad, validate=False)  # (clamped)


def test_the_cache_op_refuses_fields_it_does_not_take() -> None:
    q, k, v, lens = _cache()
    with pytest.raises(RuntimeError, match="seqlens_k"):  # not in its schema: by name
        torch.ops.flashlite.attention_kvcache(
            q, k, v, None, None, [], [], cache_seqlens=lens, seqlens_k=lens, causal=True, scale=0.25
        )
    from flashlite.ops.attention.kvcache import KVCACHE

    request = Request.make(True, 0.25, seqlens_k=lens, cache_seqlens=lens)
    with pytest.raises(NotImplementedError, match="seqlens_k"):  # the eager path: by name too
        KVCACHE(q, k, v, None, None, request)


def test_an_empty_backward_with_a_pinned_config_launches_nothing() -> None:
    # the planner's backward tree asks "anything to compute?" before the pinned config
    from flashlite.kernels import configs as C

    q = torch.randn(1, 2, 0, 16)
    k, v = (torch.randn(1, 2, 5, 16) for _ in range(2))
    o, lse, _ = attention_fwd(q, k, v, Request(0.25))
    grads = attention_bwd(
        torch.ones_like(o), q, k, v, o, lse, None, Request(0.25), config=C.CPU_BWD_CONFIG
    )
    assert [tuple(g.shape) for g in grads] == [(1, 2, 0, 16), (1, 2, 5, 16), (1, 2, 5, 16)]
    assert not grads[1].any() and not grads[2].any()
