"""Sliding windows, soft-capping and per-batch key lengths (issue 11, musts 1 and 2): forward and
backward against the fp64 reference, through ``flashlite.attention(window=..., softcap=...,
seqlens_k=...)``.

Each check allows twice PyTorch's own low-precision error (the same math in the inputs' dtype)
plus the dtype's floor, like the dense tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TOL, maybe_compile

import flashlite
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: windows of every shape: one-sided, two-sided, empty-ish (0, 0), wider than the sequence
WINDOWS = [(4, 2), (0, 0), (7, -1), (-1, 3), (2, 9), (100, 100)]


def rand(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def _err_ok(got: torch.Tensor, want: torch.Tensor, torch_lp: torch.Tensor, dtype: torch.dtype):  # noqa: ANN202
    err = (got.double() - want).abs().max().item()
    torch_err = (torch_lp.double() - want).abs().max().item()
    floor = TOL[dtype].floor * max(1.0, want.abs().max().item())
    return err <= 2 * torch_err + floor, (err, torch_err)


def check_forward(q, k, v, *, causal=False, window=None, softcap=None, scale=None,  # noqa: ANN001
                  layout="b h n d", use_compile=False) -> None:  # fmt: skip
    call = maybe_compile(flashlite.attention, use_compile)
    out, lse = call(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                    layout=layout, return_lse=True)  # fmt: skip
    if layout == "b n h d":
        q, k, v, out = (t.transpose(1, 2) for t in (q, k, v, out))
    kw = {"window": window, "softcap": softcap, "return_lse": True}
    want, want_lse = ref_attention(q, k, v, causal, scale, upcast=True, **kw)
    torch_lp, torch_lse = ref_attention(q, k, v, causal, scale, **kw)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    ok, info = _err_ok(out, want, torch_lp, q.dtype)
    assert ok, ("out", info)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "rows that see no key"
    fin = torch.isfinite(want_lse)
    if fin.any():
        ok, info = _err_ok(lse[fin], want_lse[fin], torch_lse[fin], q.dtype)
        assert ok, ("lse", info)
    assert (out[~fin.unsqueeze(-1).expand_as(out)] == 0).all(), "rows that see no key give 0"


def check_backward(q, k, v, *, causal=False, window=None, softcap=None, with_lse=True) -> None:  # noqa: ANN001
    do = torch.randn(q.shape, dtype=q.dtype)
    dlse = torch.randn(q.shape[:3]) if with_lse else None

    def grads(fn, *ts):  # noqa: ANN001, ANN202
        ts = [t.detach().clone().requires_grad_() for t in ts]
        o, lse = fn(*ts)
        loss = (o.double() * do.double()).sum()
        if dlse is not None:  # rows that see no key have LSE −inf: their dlse is not used
            loss = loss + torch.where(torch.isfinite(lse), lse.double() * dlse, 0).sum()
        loss.backward()
        return [t.grad for t in ts]

    kw = {"causal": causal, "window": window, "softcap": softcap, "return_lse": True}

    def ref(upcast):  # noqa: ANN001, ANN202
        return lambda a, b, c: ref_attention(a, b, c, upcast=upcast, **kw)

    want = grads(ref(True), q.double(), k.double(), v.double())
    torch_lp = grads(ref(False), q, k, v)
    got = grads(lambda a, b, c: flashlite.attention(a, b, c, **kw), q, k, v)
    for name, g, w, t in zip("qkv", got, want, torch_lp, strict=True):
        assert g.dtype == q.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"NaN/inf in d{name}"
        ok, info = _err_ok(g, w, t, q.dtype)
        assert ok, (f"d{name}", info)


# --------------------------------------------------------------------------- forward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(1, 1), (37, 37), (23, 50), (50, 23), (1, 41)], ids=str)
def test_window_forward(nq: int, nk: int, window: tuple[int, int], causal: bool) -> None:
    q, k, v = rand(1, 2, nq, 32), rand(1, 2, nk, 32), rand(1, 2, nk, 32)
    check_forward(q, k, v, causal=causal, window=window)


def test_window_minus_one_zero_is_causal_and_minus_ones_is_none() -> None:
    q, k, v = rand(1, 2, 29, 32), rand(1, 2, 41, 32), rand(1, 2, 41, 32)
    causal = flashlite.attention(q, k, v, causal=True)
    assert torch.equal(flashlite.attention(q, k, v, window=(-1, 0)), causal)
    assert torch.equal(flashlite.attention(q, k, v, window=(-1, -1)), flashlite.attention(q, k, v))
    # causal=True makes right 0 whatever the window says
    a = flashlite.attention(q, k, v, causal=True, window=(5, 7))
    assert torch.equal(a, flashlite.attention(q, k, v, window=(5, 0)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap_forward(dtype: torch.dtype, softcap: float, use_compile: bool) -> None:
    # scores scaled up so that the cap bites: softcap 0.5 flattens them almost to a constant
    q, k, v = (
        rand(2, 2, 33, 32, dtype=dtype) * 3,
        rand(2, 2, 45, 32, dtype=dtype),
        rand(2, 2, 45, 32, dtype=dtype),
    )
    check_forward(q, k, v, causal=True, softcap=softcap, use_compile=use_compile)


# every dtype eager, bf16 compiled too (each compiled run took ~13 s of CI)
@pytest.mark.parametrize(
    ("dtype", "use_compile"),
    [*((d, False) for d in DTYPES), (torch.bfloat16, True)],
    ids=lambda v: ("compiled" if v else "eager") if isinstance(v, bool) else str(v),
)
def test_window_softcap_gqa_layout_and_head_dims(dtype: torch.dtype, use_compile: bool) -> None:
    for d in (8, 40, 64, 256):
        q, k, v = (
            rand(2, 31, 4, d, dtype=dtype),
            rand(2, 44, 2, d, dtype=dtype),
            rand(2, 44, 2, d, dtype=dtype),
        )
        check_forward(q, k, v, window=(6, 3), softcap=10.0, layout="b n h d",
                      use_compile=use_compile)  # fmt: skip


def test_huge_scores_with_softcap_stay_finite() -> None:
    # a cap bounds every score: even 1e4-sized raw scores give a finite, exact softmax
    q, k, v = (
        rand(1, 1, 20, 16, dtype=torch.float32) * 1e3,
        rand(1, 1, 20, 16, dtype=torch.float32),
        rand(1, 1, 20, 16, dtype=torch.float32),
    )
    check_forward(q, k, v, softcap=30.0, window=(3, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [20.0, 50.0, 60.0])
def test_softcap_rows_at_both_ends_of_the_cap(dtype: torch.dtype, softcap: float) -> None:
    # caps up to 50 (bf16, fp32) use a fixed reference instead of the running max: rows whose
    # every score sits at -cap (p = e^-80 there), at +cap, or spans both must stay exact
    x = rand(1, 1, 24, 32, dtype=torch.float32)
    k = torch.cat([x, -x]).reshape(1, 2, 24, 32)  # head 0: q·k > 0 on the diagonal, head 1: < 0
    q = torch.cat([x * 8, x * 8]).reshape(1, 2, 24, 32)
    k[0, 1, ::5] = -k[0, 1, ::5]  # head 1: a few keys at +cap among ones at -cap
    v = rand(1, 2, 24, 32, dtype=torch.float32)
    check_forward(*(t.to(dtype) for t in (q, k, v)), softcap=softcap)
    check_forward(*(t.to(dtype) for t in (q, -k, v)), causal=True, softcap=softcap)
    # more queries than keys, causal: the first rows see no key (output 0, LSE -inf)
    q_more = torch.cat([q, q[:, :, :7]], 2)
    check_forward(*(t.to(dtype) for t in (q_more, k, v)), causal=True, softcap=softcap)


def test_bad_window_and_softcap_are_refused() -> None:
    q = rand(1, 1, 4, 16)
    with pytest.raises(TypeError, match="window"):
        flashlite.attention(q, q, q, window=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="window"):
        flashlite.attention(q, q, q, window=(1.0, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        flashlite.attention(q, q, q, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flashlite.attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match="softcap"):
        flashlite.attention(q, q, q, softcap=-math.inf)
    with pytest.raises(TypeError, match="softcap"):
        flashlite.attention(q, q, q, softcap="1")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- backward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(4, 2), (0, 0), (7, -1), (-1, 3), (2, 9)], ids=str)
@pytest.mark.parametrize("nq,nk", [(1, 1), (37, 37), (23, 50), (50, 23)], ids=str)
def test_window_backward(nq: int, nk: int, window: tuple[int, int], causal: bool) -> None:
    q, k, v = rand(1, 2, nq, 32), rand(1, 1, nk, 32), rand(1, 1, nk, 32)
    check_backward(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [0.5, 5.0])
def test_softcap_backward(dtype: torch.dtype, softcap: float) -> None:
    q = rand(1, 4, 29, 24, dtype=dtype) * 3
    k, v = rand(1, 2, 35, 24, dtype=dtype), rand(1, 2, 35, 24, dtype=dtype)
    check_backward(q, k, v, causal=True, softcap=softcap)
    check_backward(q, k, v, window=(5, 1), softcap=softcap, with_lse=False)


@pytest.mark.parametrize("d", [1, 100, 256])
def test_window_softcap_backward_head_dims_and_packed_layout(d: int) -> None:
    # odd and wide heads through the backward, and gradients of b n h d slices of one qkv buffer
    qkv = rand(1, 19, 3, 2, d, dtype=torch.float32).requires_grad_()
    q, k, v = qkv.unbind(2)  # (B, N, H, D) strided views
    out = flashlite.attention(q, k, v, window=(5, 2), softcap=3.0, layout="b n h d")
    do = torch.randn_like(out)
    out.backward(do)
    ref = qkv.detach().double().requires_grad_()
    rq, rk, rv = (t.transpose(1, 2) for t in ref.unbind(2))
    want = ref_attention(rq, rk, rv, window=(5, 2), softcap=3.0).transpose(1, 2)
    want.backward(do.double())
    assert qkv.grad.shape == qkv.shape
    torch.testing.assert_close(qkv.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck prefers fp64, which no kernel takes
def test_gradcheck_fp32_window_softcap() -> None:
    # finite differences against the analytic backward through O and the LSE, tanh included
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 1, 11, 8, generator=gen).requires_grad_() for _ in range(2))

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, window=(2, 1), softcap=2.0, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


def test_compiled_forward_and_backward_with_window_and_softcap() -> None:
    q, k, v = (rand(1, 2, 21, 16, dtype=torch.float32).requires_grad_() for _ in range(3))

    def step(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=True, window=(4, 0), softcap=3.0).sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- seqlens_k
SEQLENS_CASES = [
    # (Nq, Nk, lengths, causal, window, softcap): lengths 0, 1, full, ragged
    (9, 40, [40, 0, 17, 1], False, None, None),
    (33, 33, [33, 5, 20, 0], True, None, None),
    (7, 50, [50, 13, 30, 2], True, (6, 0), 3.0),
    (40, 30, [10, 30, 0, 29], False, (4, 2), None),
]


# one dtype per case, every dtype covered: the product of the two took 85 s of CI
@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(SEQLENS_CASES)],
    ids=lambda v: f"{v[0]}x{v[1]}-{v[2]}" if isinstance(v, tuple) else str(v),
)
def test_seqlens_k_forward_and_backward(case: tuple, dtype: torch.dtype) -> None:
    nq, nk, lengths, causal, window, softcap = case
    b = len(lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q, k, v = (
        rand(b, 4, nq, 24, dtype=dtype),
        rand(b, 2, nk, 24, dtype=dtype),
        rand(b, 2, nk, 24, dtype=dtype),
    )
    out, lse = flashlite.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                   seqlens_k=seqlens, return_lse=True)  # fmt: skip
    for i, n in enumerate(lengths):  # each batch equals attention over its own keys only
        if n == 0:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
            continue
        kw = {"causal": causal, "window": window, "softcap": softcap}
        check_forward(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], **kw)
        want = flashlite.attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], **kw)
        torch.testing.assert_close(out[i : i + 1], want, atol=TOL[dtype].floor, rtol=0)
    # gradients against the reference with the same lengths; keys past them get exactly 0
    do = torch.randn_like(out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flashlite.attention(*leaves, causal=causal, window=window, softcap=softcap,
                        seqlens_k=seqlens).backward(do)  # fmt: skip
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_attention(*ref, causal, upcast=True, window=window, softcap=softcap,
                  seqlens_k=seqlens).backward(do.double())  # fmt: skip
    lp = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_attention(*lp, causal, window=window, softcap=softcap, seqlens_k=seqlens).backward(do)
    for name, g, w, t in zip("qkv", leaves, ref, lp, strict=True):
        assert torch.isfinite(g.grad).all(), name
        ok, info = _err_ok(g.grad, w.grad, t.grad, dtype)
        assert ok, (f"d{name}", info)
    for i, n in enumerate(lengths):
        assert (leaves[1].grad[i, :, n:] == 0).all() and (leaves[2].grad[i, :, n:] == 0).all()


def test_seqlens_k_compiled_and_through_the_op() -> None:
    q, k, v = (rand(3, 2, 12, 16, dtype=torch.float32).requires_grad_() for _ in range(3))
    seqlens = torch.tensor([12, 3, 0], dtype=torch.int32)

    def step(q, k, v, s):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=True, seqlens_k=s).sum()

    eager = torch.autograd.grad(step(q, k, v, seqlens), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, seqlens), (q, k, v))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
    from torch.library import opcheck

    args = (q.detach().requires_grad_(), k.detach(), v.detach(), seqlens)
    fields = {"causal": True, "scale": 0.25, "window_left": 3, "softcap": 2.0}
    opcheck(torch.ops.flashlite.attention_fwd.default, args, fields)


def test_bad_seqlens_k_are_refused() -> None:
    q = rand(2, 1, 4, 16)
    with pytest.raises(TypeError, match="seqlens_k"):
        flashlite.attention(q, q, q, seqlens_k=[4, 4])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int32"):
        flashlite.attention(q, q, q, seqlens_k=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="shape"):
        flashlite.attention(q, q, q, seqlens_k=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, Nk = 4\]"):
        flashlite.attention(q, q, q, seqlens_k=torch.tensor([5, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, Nk = 4\]"):
        flashlite.attention(q, q, q, seqlens_k=torch.tensor([-1, 1], dtype=torch.int32))


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "nq,nk,d,window,softcap",
    [
        (4096, 4096, 128, (256, 0), None),
        (2000, 3001, 64, (100, 50), 30.0),
        (3001, 1000, 96, (-1, 64), None),
        (1024, 1024, 256, (128, 128), 50.0),
        (4096, 4096, 64, (-1, -1), 20.0),
    ],  # fmt: skip
)
def test_gpu_window_softcap(dtype, nq, nk, d, window, softcap) -> None:  # noqa: ANN001
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = torch.randn(1, 4, nq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, nk, d, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashlite.attention(*leaves, window=window, softcap=softcap)
    out.backward(do)
    ref_leaves = [t.float().clone().requires_grad_() for t in (q, k, v)]
    want = ref_attention(*ref_leaves, window=window, softcap=softcap)
    want.backward(do.float())
    lp_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch_lp = ref_attention(*lp_leaves, window=window, softcap=softcap)
    torch_lp.backward(do)
    pairs = [(out, want, torch_lp)] + [
        (a.grad, b.grad, c.grad) for a, b, c in zip(leaves, ref_leaves, lp_leaves, strict=True)
    ]
    for got, w, t in pairs:
        assert torch.isfinite(got).all()
        err = (got.float() - w).abs().max().item()
        torch_err = (t.float() - w).abs().max().item()
        assert err <= 2 * torch_err + TOL[dtype].floor * max(1.0, w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_seqlens_k(dtype: torch.dtype, causal: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lengths = [4096, 0, 1, 3001]
    q = torch.randn(4, 4, 777, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(4, 2, 4096, 128, device="cuda", dtype=dtype) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashlite.attention(*leaves, causal=causal, window=(1000, -1), seqlens_k=seqlens)
    do = torch.randn_like(out)
    out.backward(do)
    ref = [t.float().clone().requires_grad_() for t in (q, k, v)]
    want = ref_attention(*ref, causal, window=(1000, -1), seqlens_k=seqlens.cpu())
    want.backward(do.float())
    for got, w in [(out, want)] + [(a.grad, r.grad) for a, r in zip(leaves, ref, strict=True)]:
        assert torch.isfinite(got).all()
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        assert (got.float() - w).abs().max().item() <= tol * max(1.0, w.abs().max().item())
    for i, n in enumerate(lengths):
        assert (leaves[1].grad[i, :, n:] == 0).all()


# --------------------------------------------------------------------------- num_splits
@pytest.mark.parametrize(
    ("num_splits", "mask"),
    [(2, (True, None, None)), (7, (True, None, None)), (3, (False, (40, 5), 3.0))],
    ids=["causal-2", "causal-7", "window-softcap-3"],
)  # fmt: skip
def test_num_splits_forward_and_backward(num_splits: int, mask: tuple) -> None:
    # split-KV on the differentiable path: the exact merge gives the unsplit result, and the
    # backward (which only needs O and the LSE) gives the same gradients
    causal, window, softcap = mask
    q = rand(2, 4, 3, 32, dtype=torch.float32)
    k, v = rand(2, 2, 200, 32, dtype=torch.float32), rand(2, 2, 200, 32, dtype=torch.float32)
    check_forward(q, k, v, causal=causal, window=window, softcap=softcap)

    def run(splits):  # noqa: ANN001, ANN202
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = flashlite.attention(*leaves, causal=causal, window=window, softcap=softcap,
                                     num_splits=splits, return_lse=True)  # fmt: skip
        (o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
        return o, lse, *(t.grad for t in leaves)

    for got, want in zip(run(num_splits), run(None), strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_num_splits_compiles_and_bad_values_are_refused() -> None:
    q, k, v = (rand(1, 2, 4, 16, dtype=torch.float32) for _ in range(3))
    eager = flashlite.attention(q, k, v, num_splits=2)
    compiled = torch.compile(lambda a, b, c: flashlite.attention(a, b, c, num_splits=2),
                             fullgraph=True)(q, k, v)  # fmt: skip
    torch.testing.assert_close(compiled, eager)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            flashlite.attention(q, k, v, num_splits=bad)  # type: ignore[arg-type]
