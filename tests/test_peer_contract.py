"""The peer contract: how flash-attn's and Liger's own test files call flashlite's stand-ins.

flashlite stands in for flash-attn's attention and cross-entropy and for Liger's cross-entropy.
Their users' code, and their own test files, rely on behaviour that flashlite must have as they
document it. Each test below is one such behaviour, written in the peer's calling style:

* flash-attn's cross-entropy test passes ``inplace_backward=True`` on a *leaf* that requires
  grad, backpropagates a random incoming gradient and compares ``x.grad``;
* flash-attn's paged-cache tests run ``flash_attn_varlen_func`` with a block table on tensors
  that require grad and never call backward: flashlite's decode call must compute that forward
  (and say so only if a backward reaches it), eager and compiled;
* Liger's fused linear cross-entropy test draws its class weights from ``randn`` (negative ones,
  and sums of either sign) with a bias, label smoothing, z-loss and a soft cap, at tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL, maybe_compile

import flashlite
from flashlite.ops.common import moved_call_device
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- flash-attn: in place on a leaf


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inplace_backward", [False, True], ids=["buffer", "inplace"])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.9, 1e-2)], ids=["plain", "smooth-z"])
def test_flash_attn_cross_entropy_on_a_leaf(
    device: str, dtype: torch.dtype, inplace_backward: bool, smoothing: float, z_loss: float
) -> None:
    """flash-attn's ``test_cross_entropy_loss``, its tolerances included: a leaf, ten-odd ignored
    targets, the fp32 torch loss as reference, a random incoming gradient, ``x.grad`` compared.
    With ``inplace_backward`` the leaf's values are consumed: its memory is its ``.grad``."""
    # (rows enough that gradients sit where flash-attn's 16k rows put them, under its atol: a
    # one-ulp bf16 difference at a larger one exceeds its rtol; 300 classes: a ragged tile)
    n, v = 128, 300
    x_pt = torch.randn(n, v, device=device, dtype=dtype, requires_grad=True)
    x = x_pt.detach().clone().requires_grad_()
    y = torch.randint(0, v, (n,), device=device)
    y[torch.randperm(n)[:10]] = -100
    out = flashlite.cross_entropy(
        x, y, label_smoothing=smoothing, z_loss=z_loss, inplace_backward=inplace_backward
    )
    out_pt = F.cross_entropy(x_pt.float(), y, label_smoothing=smoothing)
    if z_loss:
        out_pt = out_pt + z_loss * (torch.logsumexp(x_pt.float(), -1)[y != -100] ** 2).mean()
    assert torch.allclose(out, out_pt, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    out_pt.backward(g)
    out.backward(g)
    # the gradient against fp64 with the tolerance table: flash-attn's own (1e-3, 1e-4) holds
    # for its 16k rows, whose gradients sit under its atol; at 128 rows a 16-bit gradient of
    # 1e-2 is one rounding from the unit gradient's and one from scaling it by g (in place)
    ref = x_pt.detach().double().requires_grad_()
    want = F.cross_entropy(ref, y, label_smoothing=smoothing)
    if z_loss:
        want = want + z_loss * (torch.logsumexp(ref, -1)[y != -100] ** 2).mean()
    want.backward(g.double())
    tol = TOL[dtype]
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=tol.atol, rtol=tol.rtol)
    if dtype == torch.float32:  # flash-attn's own tolerance, against its fp32 reference
        assert torch.allclose(x.grad, x_pt.grad, rtol=1e-5, atol=1e-6)
    if inplace_backward and moved_call_device(x.device) is None:
        assert x.grad.data_ptr() == x.data_ptr() and torch.equal(x.detach(), x.grad)


def test_flash_attn_cross_entropy_on_a_leaf_compiled() -> None:
    """The same call under ``torch.compile(fullgraph=True)``: the leaf written in place, its
    ``.grad`` right."""
    x0 = torch.randn(6, 37)
    x = x0.clone().requires_grad_()
    y = torch.tensor([3, 0, -100, 36, 5, 5])

    def ce(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return flashlite.cross_entropy(x, y, label_smoothing=0.9, inplace_backward=True)

    step = maybe_compile(ce, True)
    loss = step(x, y)
    ref = x0.double().requires_grad_()
    want = F.cross_entropy(ref, y, label_smoothing=0.9)
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-6, rtol=1e-6)
    loss.backward(torch.tensor(0.7))
    want.backward(torch.tensor(0.7, dtype=torch.float64))
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
    if moved_call_device(x.device) is None:  # (a CPU call moved to a GPU writes its copy)
        assert torch.equal(x.detach(), x.grad)


# ------------------------------------------------- Liger: fused linear CE, bias, class weights


def _liger_reference(x, weight, target, bias, ce_weight, *, smoothing, z_loss, softcap):  # noqa: ANN001, ANN202
    """Liger's definition in fp64 (``ops/cross_entropy.py``): per kept row ``w_t·(1 − ε)·ce +
    (ε/V)·Σ_j w_j·(lse − x_j)`` over ``Σ_kept w_t`` (any sign), plus ``z·lse²`` over the kept
    count: torch's weighted, smoothed mean on the capped logits, and the z-loss beside it."""
    logits = x.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logits = softcap * torch.tanh(logits / softcap)
    w = ce_weight.double() if ce_weight is not None else None
    ce = F.cross_entropy(logits, target, w, label_smoothing=smoothing)
    kept = target != -100
    return ce + z_loss * (torch.logsumexp(logits, -1)[kept] ** 2).mean()


LIGER_TOL = [(torch.bfloat16, 5e-3, 5e-2), (torch.float32, 1e-5, 5e-4)]  # its (dtype, atol, rtol)


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", LIGER_TOL, ids=["bf16", "fp32"])
@pytest.mark.parametrize("ce_weight", [None, "randn", "negative sum"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_liger_fused_linear_cross_entropy_functional(
    device: str,
    B: int,
    T: int,
    H: int,
    V: int,
    dtype: torch.dtype,
    atol: float,
    rtol: float,
    ce_weight: str | None,
    bias: bool,
) -> None:
    """Liger's ``test_correctness_functional`` (its options and tolerances): class weights from
    ``randn``, so some are negative, and so, for some draws, is the sum of the kept targets'
    weights that a mean divides by ("negative sum" makes it so). torch and Liger divide by it
    whatever its sign; the loss and every gradient are finite and match the definition."""
    x = torch.randn(B * T, H, device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, V, (B * T,), device=device)
    weight = torch.randn(V, H, device=device, dtype=dtype).requires_grad_()
    b = torch.randn(V, device=device, dtype=dtype).requires_grad_() if bias else None
    cw = None
    if ce_weight is not None:
        cw = torch.randn(V, device=device)
        if ce_weight == "negative sum":
            cw[target] = -cw[target].abs() - 0.1
    opts = {"smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0}
    loss = flashlite.linear_cross_entropy(
        x,
        weight,
        target,
        bias=b,
        class_weight=cw,
        ignore_index=-100,
        label_smoothing=opts["smoothing"],
        z_loss=opts["z_loss"],
        softcap=opts["softcap"],
        reduction="mean",
    )
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)]
    b64 = b.detach().double().requires_grad_() if bias else None
    want = _liger_reference(*leaves, target, b64, cw, **opts)
    assert torch.isfinite(loss)
    assert torch.allclose(loss.double(), want, atol=atol, rtol=rtol)
    g = torch.randn((), device=device)
    loss.backward(g)
    want.backward(g.double())
    for got, ref in ((x, leaves[0]), (weight, leaves[1]), (b, b64)):
        if got is None:
            continue
        assert torch.isfinite(got.grad).all()
        if dtype == torch.float32:
            torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=rtol)
        else:  # bf16 logits and gradients (Liger's test compares two bf16 runs, not fp64): a
            # few elements sit far from 1e-2 relative; the whole tensor stays within it
            err = (got.grad.double() - ref.grad).norm() / ref.grad.norm()
            assert err <= 1e-2, err.item()


def test_a_weighted_mean_divides_by_the_kept_weights_whatever_their_sign(use_compile: bool) -> None:
    """The divisor of a weighted mean, as torch computes it: a negative sum divides; a zero sum
    gives ±inf (and NaN when every target is ignored, torch's 0/0), eager and compiled, the
    fused cross-entropy and the linear one alike."""
    x = torch.randn(4, 10)
    t = torch.tensor([0, 1, 2, 3])
    h, w = torch.randn(4, 6), torch.randn(10, 6)
    ce = maybe_compile(lambda x, t, cw: flashlite.cross_entropy(x, t, cw), use_compile)
    lce = maybe_compile(
        lambda h, w, t, cw: flashlite.linear_cross_entropy(h, w, t, class_weight=cw), use_compile
    )
    for cw in (
        torch.tensor([1.0, -1.0, -2.0, -2.0, 1, 1, 1, 1, 1, 1]),  # sum -4
        torch.tensor([1.0, -1.0, 2.0, -2.0, 1, 1, 1, 1, 1, 1]),
    ):  # sum 0
        want = F.cross_entropy(x.double(), t, cw.double())
        torch.testing.assert_close(ce(x, t, cw).double(), want, atol=1e-5, rtol=1e-5)
        want = F.cross_entropy(h.double() @ w.double().T, t, cw.double())
        torch.testing.assert_close(lce(h, w, t, cw).double(), want, atol=1e-5, rtol=1e-5)
    assert torch.isnan(ce(x, torch.full((4,), -100), cw))


# ------------------------------------------- flash-attn: paged varlen forward on grad tensors


def _flash_attn_varlen_paged(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,  # noqa: ANN001, ANN202
    causal,
    block_table,
):
    """``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, causal=causal, block_table=block_table)`` as a thin stand-in maps it onto
    :func:`flashlite.attention_kvcache`: each sequence's queries right-aligned in ``(B,
    max_seqlen_q, H, D)`` (so that bottom-right alignment puts them where flash-attn does), its
    key count as ``cache_seqlens``; the padding rows dropped again."""
    lens_q = cu_seqlens_q.diff().tolist()
    rows = [q[s : s + n] for s, n in zip(cu_seqlens_q.tolist(), lens_q, strict=False)]
    q_pad = torch.stack([F.pad(r, (0, 0, 0, 0, max_seqlen_q - r.shape[0], 0)) for r in rows])
    out = flashlite.attention_kvcache(
        q_pad,
        k_cache,
        v_cache,
        block_table=block_table,
        cache_seqlens=cu_seqlens_k.diff().to(torch.int32),
        causal=causal,
    )
    return torch.cat([out[b, max_seqlen_q - n :] for b, n in enumerate(lens_q)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_varlen_paged_forward_on_grad_tensors(
    device: str, dtype: torch.dtype, causal: bool
) -> None:
    """flash-attn's ``test_flash_attn_varlen_causal`` with a paged cache: q, k and v require
    grad, the forward is compared with the reference and no backward is taken. A backward that
    does reach the call raises, naming what required grad."""
    hq, hkv, d, page = 4, 2, 16, 16
    lens_q, lens_k = [5, 1, 17], [40, 23, 17]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d, device=device, dtype=dtype, requires_grad=True)
    per = 3  # pages per sequence: 48 slots
    n_pages = len(lens_k) * per + 2
    table = torch.randperm(n_pages)[: len(lens_k) * per].view(-1, per).to(torch.int32)
    k_pages, v_pages = (
        torch.randn(n_pages, page, hkv, d, device=device, dtype=dtype, requires_grad=True)
        for _ in range(2)
    )
    out = _flash_attn_varlen_paged(
        q, k_pages, v_pages, cu_q.to(device), cu_k.to(device), max(lens_q), causal, table.to(device)
    )
    assert out.shape == q.shape and out.requires_grad
    tol = TOL[dtype]
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        k, v = (
            p.detach()[table[b].long()].reshape(1, -1, hkv, d)[:, :nk] for p in (k_pages, v_pages)
        )
        qb = q.detach()[cu_q[b] : cu_q[b] + nq][None]
        args = [t.transpose(1, 2) for t in (qb, k, v)]  # (b h n d)
        want = ref_attention(*(t.double() for t in args), causal=causal).transpose(1, 2)[0]
        low = ref_attention(*args, causal=causal).transpose(1, 2)[0]  # torch's own error
        err = (out.detach()[cu_q[b] : cu_q[b] + nq].double() - want).abs().max().item()
        assert err <= 2 * (low.double() - want).abs().max().item() + tol.floor, (b, err)
    with pytest.raises(RuntimeError, match="attention_kvcache is forward-only.* q and k_cache"):
        out.float().sum().backward()


# ----------------------------------------- forward-only calls: eager and compiled, both ops


def test_kvcache_forward_on_tensors_that_require_grad(use_compile: bool) -> None:
    """q, the caches and the new keys require grad: the decode step computes what it computes
    under ``no_grad`` and appends; ``backward`` raises naming them, eager and compiled."""
    bsz, hq, hkv, d, cap = 2, 4, 2, 16, 32
    q = torch.randn(bsz, 2, hq, d)
    kc, vc = torch.randn(bsz, cap, hkv, d), torch.randn(bsz, cap, hkv, d)
    kn, vn = torch.randn(bsz, 2, hkv, d), torch.randn(bsz, 2, hkv, d)
    lens = torch.tensor([7, 30], dtype=torch.int32)
    with torch.no_grad():
        caches = [kc.clone(), vc.clone()]
        want, want_lse = flashlite.attention_kvcache(
            q, *caches, cache_seqlens=lens, k_new=kn, v_new=vn, return_lse=True
        )
    grads = [t.clone().requires_grad_() for t in (q, kc, vc, kn)]

    def decode(q, kc, vc, kn):  # noqa: ANN001, ANN202
        return flashlite.attention_kvcache(
            q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, return_lse=True
        )

    step = maybe_compile(decode, use_compile)
    out, lse = step(*grads)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=0)
    assert torch.equal(grads[1], caches[0]) and torch.equal(grads[2], caches[1])  # appended
    assert out.requires_grad and lse.requires_grad
    with pytest.raises(RuntimeError, match="forward-only.* q and k_cache and v_cache and k_new"):
        (out.sum() + lse.sum()).backward()


def test_shared_prefix_forward_on_tensors_that_require_grad(use_compile: bool) -> None:
    """The same for :func:`flashlite.attention_shared_prefix`, the prefix requiring grad."""
    bsz, hq, hkv, d, cap, n_prefix = 3, 4, 2, 16, 32, 13
    q = torch.randn(bsz, 1, hq, d)
    pk, pv = torch.randn(n_prefix, hkv, d), torch.randn(n_prefix, hkv, d)
    kc, vc = torch.randn(bsz, cap, hkv, d), torch.randn(bsz, cap, hkv, d)
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)
    with torch.no_grad():
        want = flashlite.attention_shared_prefix(
            q, pk, pv, kc.clone(), vc.clone(), cache_seqlens=lens
        )
    grads = [t.clone().requires_grad_() for t in (q, pk)]
    step = maybe_compile(
        lambda q, pk: flashlite.attention_shared_prefix(q, pk, pv, kc, vc, cache_seqlens=lens),
        use_compile,
    )
    out = step(*grads)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    with pytest.raises(
        RuntimeError, match="attention_shared_prefix is forward-only.* q and prefix_k,"
    ):
        out.sum().backward()
