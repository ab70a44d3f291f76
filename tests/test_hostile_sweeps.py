"""Hostile inputs swept: each public op over dtypes (the accepted ones against the fp64
reference; others must raise TypeError), shapes (length 1, non-powers of two), expanded (stride-0)
and non-contiguous inputs (the same values as a dense copy must give the same answer)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL
from hostile_helpers import INF, KV_B, KV_CAP, KV_D, KV_HKV, KV_HQ, _pages

import flashlite


def _layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x`` as given, as a non-contiguous view of a bigger buffer with the same values, and
    (for one row or column of size 1 broadcast) an expanded stride-0 view."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype)
    wide[..., 1::2] = x
    out = {"dense": x, "strided": wide[..., 1::2]}
    if x.shape[0] > 1:
        out["expanded"] = x[:1].expand_as(x)
    return out


SWEEP_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BAD_DTYPES = [torch.float64, torch.int32, torch.bool]


def _shapes_and_layouts(shapes: list[tuple[int, ...]]) -> list:
    """Every (shape, layout) pair, but no expanded view of a single row (nothing to expand)."""
    layouts = ("dense", "strided", "expanded")
    return [pytest.param(s, lay, id=f"{s}-{lay}") for s in shapes for lay in layouts
            if s[0] > 1 or lay != "expanded"]  # fmt: skip


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape,layout", _shapes_and_layouts([(1, 1), (3, 1), (1, 7), (5, 33), (2, 3, 17)])
)
def test_sweep_softmax(op, dtype, shape, layout) -> None:  # noqa: ANN001
    x = _layouts((torch.randn(shape) * 4).to(dtype))[layout]
    ours = getattr(flashlite, op)
    theirs = getattr(torch, op)
    for dim in range(-x.dim(), x.dim()):
        got = ours(x, dim)
        want = theirs(x.double(), dim)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype].atol,
                                   rtol=TOL[dtype].rtol)  # fmt: skip


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_sweep_softmax_refuses_other_dtypes(op, dtype) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match="dtype"):
        getattr(flashlite, op)(torch.ones(3, 4).to(dtype), -1)


def _attention_close(got: torch.Tensor, q, k, v, causal=False) -> None:  # noqa: ANN001
    # within 2x PyTorch's own error in the same dtype plus the floor (b h n d)
    from attention_helpers import assert_close_to_reference

    assert_close_to_reference(got, q, k, v, causal)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("nq,nk,d", [(1, 1, 1), (1, 33, 8), (7, 3, 5), (17, 17, 24)], ids=str)
@pytest.mark.parametrize("layout", ["dense", "strided", "expanded"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sweep_attention(dtype, nq, nk, d, layout, causal) -> None:  # noqa: ANN001
    q = _layouts(torch.randn(2, 2, nq, d).to(dtype))[layout]
    k, v = (_layouts(torch.randn(2, 2, nk, d).to(dtype))[layout] for _ in range(2))
    got = flashlite.attention(q, k, v, causal=causal)
    assert got.dtype == dtype and got.shape == q.shape
    _attention_close(got, q, k, v, causal)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_sweep_attention_refuses_other_dtypes(dtype) -> None:  # noqa: ANN001
    q = torch.ones(1, 1, 4, 8).to(dtype)
    with pytest.raises(TypeError, match="dtype"):
        flashlite.attention(q, q, q)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        flashlite.attention_varlen(q[0, 0, :, None], q[0, 0, :, None], q[0, 0, :, None], cu, cu,
                                   4, 4)  # fmt: skip
    with pytest.raises(TypeError, match="dtype"):
        flashlite.attention_kvcache(q, q, q, cache_seqlens=torch.tensor([2], dtype=torch.int32))


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["dense", "strided", "expanded"])
def test_sweep_attention_varlen(dtype, layout) -> None:  # noqa: ANN001
    lengths = [1, 6, 0, 3]
    total = sum(lengths)
    cu = torch.tensor([0, 1, 7, 7, 10], dtype=torch.int32)
    q, k, v = (_layouts(torch.randn(total, 2, 8).to(dtype))[layout] for _ in range(3))
    got = flashlite.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if b > a:
            one = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            _attention_close(got[a:b].transpose(0, 1)[None], *one, causal=True)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["dense", "strided", "expanded"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_sweep_attention_kvcache(dtype, layout, paged) -> None:  # noqa: ANN001
    q = _layouts(torch.randn(KV_B, 2, KV_HQ, KV_D).to(dtype))[layout]
    k, v = (_layouts(torch.randn(KV_B, KV_CAP, KV_HKV, KV_D).to(dtype))[layout] for _ in range(2))
    lens = torch.tensor([1, 64, 33, 16], dtype=torch.int32)
    if paged:
        kp, vp, table = _pages(k.float(), v.float(), 16)
        kp, vp = kp.to(dtype), vp.to(dtype)
        got = flashlite.attention_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    else:
        got = flashlite.attention_kvcache(q, k, v, cache_seqlens=lens)
    for b, n in enumerate(lens.tolist()):
        one = [t[b : b + 1, :m].transpose(1, 2) for t, m in ((q, 2), (k, n), (v, n))]
        _attention_close(got[b : b + 1].transpose(1, 2), *one, causal=True)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("shape,layout", _shapes_and_layouts([(1, 1), (1, 7), (5, 33), (3, 1000)]))
def test_sweep_cross_entropy(dtype, shape, layout) -> None:  # noqa: ANN001
    n, v = shape
    x = _layouts((torch.randn(n, v) * 3).to(dtype))[layout]
    t = torch.randint(0, v, (n,))
    leaf = x.detach().clone().requires_grad_() if layout == "dense" else x.requires_grad_()
    got = flashlite.cross_entropy(leaf, t, reduction="sum")
    ref = x.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref, t, reduction="sum")
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=n * tol.atol, rtol=tol.rtol)
    got.backward()
    want.backward()
    grad = leaf.grad if layout == "dense" else x.grad
    torch.testing.assert_close(grad.double(), ref.grad, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_sweep_cross_entropy_refuses_other_dtypes(dtype) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match="dtype"):
        flashlite.cross_entropy(torch.ones(3, 4).to(dtype), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError):  # float targets: class probabilities are not supported
        flashlite.cross_entropy(torch.ones(3, 4), torch.zeros(3))


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["dense", "strided", "expanded"])
def test_sweep_linear_cross_entropy(dtype, layout) -> None:  # noqa: ANN001
    h = _layouts(torch.randn(6, 16).to(dtype))[layout]
    w = _layouts((torch.randn(40, 16) / 4).to(dtype))[layout]
    t = torch.randint(0, 40, (6,))
    got = flashlite.linear_cross_entropy(h, w, t, reduction="sum", chunk_size=4)
    want = torch.nn.functional.cross_entropy(h.double() @ w.double().t(), t, reduction="sum")
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=16 * tol.atol, rtol=4 * tol.rtol)


@pytest.mark.parametrize("shape", [(), (1,), (3, 1), (2, 5)], ids=str)
def test_sweep_merge_broadcasts_like_torch(shape) -> None:  # noqa: ANN001
    from flashlite import stats

    x = torch.randn(*shape, 6)
    x[..., :3] = torch.where(torch.rand(*shape, 3) < 0.3, -INF, x[..., :3])
    a, b = stats.torch_tile_stats(x[..., :3]), stats.torch_tile_stats(x[..., 3:])
    m, s = stats.merge(*a, *b)
    torch.testing.assert_close(stats.torch_finalize_lse(m, s), torch.logsumexp(x, -1))
