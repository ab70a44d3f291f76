"""Values with their own head dim (DeepSeek's 192/128): ``v.shape[-1] != q.shape[-1]``, forward
and backward, against fp64 under flash-attn's rule (2x PyTorch's own low-precision error plus
the table's floor), with every option of the dense kernels, varlen, both layouts, and the
refusals of the paths that do not take it."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import DTYPES
from conftest import TOL, maybe_compile
from torch.library import opcheck

import flashlite
from flashlite import reference


def _within(got: torch.Tensor, ref: torch.Tensor, torch_lp: torch.Tensor, what: str) -> None:
    err = (got.double() - ref).abs().max().item()
    torch_err = (torch_lp.double() - ref).abs().max().item()
    floor = TOL[torch_lp.dtype].floor * max(1.0, ref.abs().max().item())
    assert err <= 2 * torch_err + floor, f"{what}: {err:.3g} against torch's {torch_err:.3g}"


def _check(q, k, v, do, opts, got, grads):  # noqa: ANN001
    """``got`` and the gradients against fp64, each within twice torch's own error."""
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    leaves_lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = reference.attention(*leaves64, upcast=True, **opts)
    ref_grads = torch.autograd.grad(ref, leaves64, do.double())
    torch_lp = reference.attention(*leaves_lp, **opts)
    lp_grads = torch.autograd.grad(torch_lp, leaves_lp, do)
    assert got.shape == (*q.shape[:3], v.shape[3]) and got.dtype == q.dtype
    _within(got, ref, torch_lp, "out")
    for name, g, r, t, x in zip("qkv", grads, ref_grads, lp_grads, (q, k, v), strict=True):
        assert g.shape == x.shape
        _within(g, r, t, f"d{name}")


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (6, 2)},
    "softcap": {"softcap": 4.0},
    "sinks": {"sinks": True},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dims", [(24, 16), (16, 40), (40, 8)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_backward(dtype: torch.dtype, dims: tuple[int, int], case: str) -> None:
    d, dv = dims
    q = torch.randn(2, 4, 37, d, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 45, d, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 45, dv, dtype=dtype, requires_grad=True)
    opts = dict(CASES[case])
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(4)
    out = flashlite.attention(q, k, v, **opts)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    _check(q, k, v, do, opts, out, grads)


def test_layout_non_contiguous_length_one_and_fully_masked() -> None:
    """``b n h d`` slices of packed buffers (non-contiguous), one query, and causal rows that see
    no key (Nq > Nk): zeros and zero gradients there."""
    qk = torch.randn(1, 5, 2, 2 * 24, requires_grad=True)
    q, k = qk[..., :24], qk[..., 24:]  # (B, N, H, 24) views of one buffer
    v = torch.randn(1, 3, 2, 8, requires_grad=True)
    out = flashlite.attention(q, k[:, :3], v, layout="b n h d", causal=True)
    assert out.shape == (1, 5, 2, 8) and torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, v), do)
    as_bhnd = [t.transpose(1, 2) for t in (q, k[:, :3], v)]
    ref = reference.attention(*(t.double() for t in as_bhnd), causal=True, upcast=True)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=1e-5, rtol=1e-5)
    assert grads[0].shape == q.shape and torch.isfinite(grads[0]).all()
    one = flashlite.attention(q[:, :1].detach(), k[:, :1].detach(), v[:, :1].detach(),
                              layout="b n h d")  # fmt: skip
    torch.testing.assert_close(one, v[:, :1].detach())


def test_varlen_forward_and_backward() -> None:
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 33], dtype=torch.int32)
    q = torch.randn(22, 4, 24, requires_grad=True)
    k = torch.randn(33, 2, 24, requires_grad=True)
    v = torch.randn(33, 2, 16, requires_grad=True)
    out = flashlite.attention_varlen(q, k, v, cu_q, cu_k, 17, 20, causal=True)
    assert out.shape == (22, 4, 16)
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    for i in range(3):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop:
            continue
        one = [x[r].detach().transpose(0, 1)[None].double().requires_grad_()
               for x, r in ((q, rows), (k, keys), (v, keys))]  # fmt: skip
        ref = reference.attention(*one, causal=True, upcast=True)
        torch.testing.assert_close(out[rows].transpose(0, 1)[None].double(), ref, atol=2e-5,
                                   rtol=2e-5)  # fmt: skip
        r_dq, _r_dk, _r_dv = torch.autograd.grad(ref, one, do[rows].transpose(0, 1)[None].double())
        torch.testing.assert_close(dq[rows].transpose(0, 1)[None].double(), r_dq, atol=2e-5,
                                   rtol=2e-5)  # fmt: skip
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("mods", ["mask", "score"])
def test_flex_attention(mods: str) -> None:
    """flex_attention with a block mask (sliding window) or a score function (ALiBi), V 8 wide
    against Q's 24, forward and backward; and attention_varlen with a score function."""
    from flashlite import gallery

    q = torch.randn(1, 4, 40, 24, requires_grad=True)
    k, v = (
        torch.randn(1, 2, 40, 24, requires_grad=True),
        torch.randn(1, 2, 40, 8, requires_grad=True),
    )
    opts: dict = {}
    ref_opts: dict = {}
    if mods == "mask":
        mask = gallery.sliding_window(6)
        opts["block_mask"] = flashlite.create_block_mask(mask, None, None, 40, 40)
        ref_opts["mask_mod"] = mask
    else:
        score = gallery.alibi(gallery.alibi_slopes(4))
        opts["score_mod"] = ref_opts["score_mod"] = score
    out = flashlite.flex_attention(q, k, v, enable_gqa=True, **opts)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference.attention(*leaves, upcast=True, **ref_opts)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert out.shape == (1, 4, 40, 8)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=2e-5)
    if mods == "score":  # packed sequences with the same score function
        cu = torch.tensor([0, 15, 40], dtype=torch.int32)
        packed = [x[0].detach().transpose(0, 1).contiguous() for x in (q, k, v)]
        got = flashlite.attention_varlen(*packed, cu, cu, 25, 25, score_mod=opts["score_mod"])
        assert got.shape == (40, 4, 8)
        one = reference.attention(*(x[:15].transpose(0, 1)[None].double() for x in packed),
                                  upcast=True, score_mod=opts["score_mod"])  # fmt: skip
        torch.testing.assert_close(got[:15].transpose(0, 1)[None].double(), one, atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


def test_compiled_and_opcheck() -> None:
    q, k = torch.randn(1, 2, 16, 24), torch.randn(1, 2, 16, 24)
    v = torch.randn(1, 2, 16, 8)

    def run(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.attention(q, k, v, causal=True)

    torch.testing.assert_close(maybe_compile(run, True)(q, k, v), run(q, k, v))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fields = {"causal": True, "scale": 24**-0.5, "head_dim_v": 8}
    opcheck(torch.ops.flashlite.attention_fwd.default, tuple(leaves), fields)


@pytest.mark.parametrize(
    "call, error, words",
    [
        ("dv_too_wide", NotImplementedError, "v's head dim 257 is not supported"),
        ("rank", ValueError, "must have 4 dimensions"),
        ("keys", ValueError, "k and v must have the same shape"),
        ("splits", NotImplementedError, "split-KV decoding does not support head_dim_v"),
        ("kvcache", ValueError, "k_cache and v_cache must have one shape"),
        ("batch", ValueError, "k and v must have the same shape"),
    ],
)
def test_bad_input(call: str, error: type, words: str) -> None:
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 24)
    with pytest.raises(error, match=words):
        if call == "dv_too_wide":
            flashlite.attention(q, k, torch.randn(1, 2, 8, 257))
        elif call == "rank":
            flashlite.attention(q, k, v[0])
        elif call == "keys":
            flashlite.attention(q, k, torch.randn(1, 2, 9, 24))
        elif call == "splits":
            flashlite.attention(q, k, v, num_splits=2)
        elif call == "kvcache":
            lens = torch.tensor([4], dtype=torch.int32)
            flashlite.attention_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        cache_seqlens=lens)  # fmt: skip
        else:
            flashlite.attention(q, k, torch.randn(2, 2, 8, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deepseek_dims_on_the_gpu(causal: bool) -> None:
    """DeepSeek's 192/128 in bf16 on the GPU, lengths not a multiple of any tile, GQA and
    varlen's packed form, forward and backward against fp64 (2x torch's own error)."""
    q = torch.randn(2, 8, 999, 192, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(2, 4, 1037, 192, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(2, 4, 1037, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = flashlite.attention(q, k, v, causal=causal)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    _check(q, k, v, do, {"causal": causal}, out, grads)
