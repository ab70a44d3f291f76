"""FP8 attention forward: e4m3 q, k, v with descale factors (flash-attn's convention).

The kernels' error against fp64 attention of the dequantised inputs is held to twice the error
of FlashAttention-3's recipe computed in torch (:func:`flashlite.reference.attention_fp8`), plus
the table's floor; the accuracy test compares with attention of the unquantised inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import flashlite
from flashlite import reference
from tests.conftest import TOL, maybe_compile

E4M3 = torch.float8_e4m3fn


def _inputs(b, hq, hkv, nq, nk, d, per_head=False, spread=1.0):
    q, k, v = (torch.randn(b, h, n, d) * spread for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    q8, sq = reference.quantize_e4m3(q, per_head, hkv)
    (k8, sk), (v8, sv) = (reference.quantize_e4m3(x, per_head) for x in (k, v))
    return [q8, sq, k8, sk], [v8, sv]


def _dequantised(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """The fp64 tensor an e4m3 one (``b h n d``) and its ``(1,)`` or ``(B, Hkv)`` descale stand
    for (query heads share their KV head's factor)."""
    f = descale.double()
    if f.dim() == 2:
        f = f.repeat_interleave(x8.shape[1] // f.shape[1], 1)[:, :, None, None]
    return x8.double() * f


def _check(o, q8, sq, k8, sk, v8, sv, **opts):
    """``o`` against fp64 attention of the dequantised inputs, within twice the error of the
    same recipe in torch plus the bf16 row's floor."""
    ref = reference.attention(
        _dequantised(q8, sq), _dequantised(k8, sk), _dequantised(v8, sv), upcast=True, **opts
    )
    twin = reference.attention_fp8(q8, k8, v8, sq, sk, sv, **opts)
    bound = 2 * (twin.double() - ref).abs().max().item() + TOL[torch.bfloat16].floor
    err = (o.double() - ref).abs().max().item()
    assert o.dtype == torch.bfloat16 and o.shape == ref.shape
    assert err <= bound, f"FP8 error {err:.3g} above twice the torch recipe's ({bound:.3g})"


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (5, 3)},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": True},
    "causal_sinks_softcap": {"causal": True, "sinks": True, "softcap": 3.0},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_fp8_forward_options(case: str, per_head: bool) -> None:
    opts = dict(CASES[case])
    (q8, sq, k8, sk), (v8, sv) = _inputs(2, 4, 2, 37, 45, 24, per_head=per_head)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(4)
    with torch.no_grad():
        o = flashlite.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, **opts)
    _check(o, q8, sq, k8, sk, v8, sv, **opts)


def test_fp8_layouts_lengths_and_lse() -> None:
    """``b n h d`` views, per-batch key lengths (one of them 0: a fully masked batch), the LSE
    against fp64 (the scores are exact products of e4m3 values), and an fp32 output."""
    (q8, sq, k8, sk), (v8, sv) = _inputs(2, 2, 1, 19, 33, 16)
    lengths = torch.tensor([0, 20], dtype=torch.int32)
    with torch.no_grad():
        o, lse = flashlite.attention(
            q8.transpose(1, 2),
            k8.transpose(1, 2),
            v8.transpose(1, 2),
            layout="b n h d",
            causal=True,
            seqlens_k=lengths,
            q_descale=sq,
            k_descale=sk,
            v_descale=sv,
            return_lse=True,
            out_dtype=torch.float32,
        )
    assert o.dtype == torch.float32
    o = o.transpose(1, 2)
    deq = [_dequantised(x, s) for x, s in ((q8, sq), (k8, sk), (v8, sv))]
    ref, ref_lse = reference.attention(
        *deq, causal=True, seqlens_k=lengths, upcast=True, return_lse=True
    )
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    torch.testing.assert_close(lse[1], ref_lse[1], atol=1e-5, rtol=1e-5)
    twin = reference.attention_fp8(q8, k8, v8, sq, sk, sv, causal=True, seqlens_k=lengths)
    bound = 2 * (twin.double() - ref).abs().max().item() + TOL[torch.bfloat16].floor
    assert (o.double() - ref).abs().max().item() <= bound


def test_fp8_length_one_and_huge_scales() -> None:
    """One query against one key (p = 1 exactly), and descale factors far from 1."""
    (q8, sq, k8, sk), (v8, sv) = _inputs(1, 2, 2, 1, 1, 8)
    with torch.no_grad():
        o = flashlite.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv)
    torch.testing.assert_close(o.double(), _dequantised(v8, sv).to(torch.bfloat16).double())
    (q8, sq, k8, sk), (v8, sv) = _inputs(1, 2, 2, 9, 40, 16, spread=1e4)
    with torch.no_grad():
        o = flashlite.attention(q8, k8, v8, q_descale=sq / 1e4, k_descale=sk, v_descale=sv)
    _check(o, q8, sq / 1e4, k8, sk, v8, sv)


def test_fp8_varlen() -> None:
    """Packed sequences, per-sequence descales ``(batch, Hkv)``."""
    lens_q, lens_k = [5, 0, 17], [9, 4, 20]
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 33], dtype=torch.int32)
    q8 = torch.randn(22, 4, 16).to(E4M3)
    k8, v8 = torch.randn(33, 2, 16).to(E4M3), torch.randn(33, 2, 16).to(E4M3)
    sq, sk, sv = (torch.rand(3, 2) + 0.5 for _ in range(3))
    with torch.no_grad():
        o = flashlite.attention_varlen(
            q8, k8, v8, cu_q, cu_k, 17, 20, causal=True, q_descale=sq, k_descale=sk, v_descale=sv
        )
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        if nq == 0:
            continue
        rows, keys = slice(cu_q[i], cu_q[i] + nq), slice(cu_k[i], cu_k[i] + nk)
        one = [x[r].transpose(0, 1)[None] for x, r in ((q8, rows), (k8, keys), (v8, keys))]
        scales = [s[i : i + 1] for s in (sq, sk, sv)]
        _check(o[rows].transpose(0, 1)[None], one[0], scales[0], one[1], scales[1], one[2],
               scales[2], causal=True)  # fmt: skip


def test_fp8_accuracy_with_outliers() -> None:
    """FlashAttention-3's FP8 evaluation: Gaussian inputs with 0.1% outliers 10× larger, one
    factor per tensor. The forward's RMSE against fp64 attention of the unquantised inputs, and
    torch's from the same e4m3 values in fp32, are at or under FlashAttention-3's per-tensor
    FP8 baseline (2.4e-2)."""

    def gaussian(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, dtype=torch.float64)
        return torch.where(torch.rand(*shape) < 1e-3, 10 * x, x)

    q, k, v = (gaussian(1, 2, 256, 64) for _ in range(3))
    (q8, sq), (k8, sk), (v8, sv) = (reference.quantize_e4m3(x) for x in (q, k, v))
    for causal in (False, True):
        ref = reference.attention(q, k, v, causal=causal, upcast=True)
        with torch.no_grad():
            o = flashlite.attention(
                q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=causal
            )
        deq = [x.float() * s for x, s in ((q8, sq), (k8, sk), (v8, sv))]
        torch_fp32 = reference.attention(*deq, causal=causal)

        def rmse(x: torch.Tensor, ref: torch.Tensor = ref) -> float:
            return (x.double() - ref).pow(2).mean().sqrt().item()

        assert rmse(o) <= 2.4e-2 and rmse(torch_fp32) <= 2.4e-2, (rmse(o), rmse(torch_fp32))


def test_fp8_compiled_and_opcheck() -> None:
    """The custom op under ``torch.compile(fullgraph=True)`` and torch's op checks (the fake
    gives the bf16 output)."""
    (q8, sq, k8, sk), (v8, sv) = _inputs(1, 2, 2, 16, 16, 16)

    def run(q8, k8, v8, sq, sk, sv):
        return flashlite.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv)

    with torch.no_grad():
        eager = run(q8, k8, v8, sq, sk, sv)
        compiled = maybe_compile(run, True)(q8, k8, v8, sq, sk, sv)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    scales = {"q_descale": sq.expand(1, 2), "k_descale": sk.expand(1, 2), "v_descale": sv}
    scales["v_descale"] = sv.expand(1, 2)
    fields = {"scale": 0.25, "out_dtype": torch.bfloat16, **scales}
    # (test_schema is left out: its checker multiplies the inputs, which torch's CPU kernels do
    # not do for e4m3; the schema's aliasing is the same as every other dtype's)
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    opcheck(torch.ops.flashlite.attention_fwd.default, (q8, k8, v8), fields, test_utils=tests)


def _q8():
    (q8, sq, k8, sk), (v8, sv) = _inputs(1, 2, 2, 8, 8, 16)
    return q8, k8, v8, sq


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"q": "e5m2"}, TypeError, "float8_e4m3fn only"),
        ({"v": "bf16"}, TypeError, "share one dtype"),
        ({"q_descale": torch.ones(2)}, ValueError, "q_descale must have shape"),
        ({"k_descale": torch.ones(1, dtype=torch.float64)}, TypeError, "k_descale must be float32"),
        ({"v_descale": 1.0}, TypeError, "v_descale must be a torch.Tensor"),
        ({"out_dtype": torch.float8_e4m3fn}, TypeError, "out_dtype must be"),
        ({"grad": True}, RuntimeError, "forward only"),
        ({"all": "bf16"}, TypeError, "are for torch.float8_e4m3fn inputs"),
    ],
    ids=["e5m2", "mixed", "shape", "dtype", "not_tensor", "out_dtype", "grad", "bf16_descale"],
)
def test_fp8_bad_input(change: dict, error: type, words: str) -> None:
    q8, k8, v8, s = _q8()
    args = {"q": q8, "k": k8, "v": v8}
    named = {"q_descale": s, "k_descale": s, "v_descale": s}
    for name, value in change.items():
        if value == "e5m2":
            args[name] = args[name].float().to(torch.float8_e5m2)
        elif name == "all":
            args = {n: t.float().to(torch.bfloat16) for n, t in args.items()}
        elif value == "bf16":
            args[name] = args[name].float().to(torch.bfloat16)
        elif name == "grad":
            args["q"] = args["q"].float().to(E4M3).requires_grad_()
        else:
            named[name] = value
    with pytest.raises(error, match=words):
        flashlite.attention(args["q"], args["k"], args["v"], **named)


def test_fp8_refused_where_not_supported() -> None:
    """Mods with FP8 varlen, FP8 through the functions without an FP8 path: refused by name."""
    q8 = torch.randn(8, 2, 16).to(E4M3)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="FP8 inputs without score_mod"):
        flashlite.attention_varlen(q8, q8, q8, cu, cu, 8, 8, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(TypeError, match="does not take"):
        flashlite.flex_attention(*(torch.randn(1, 2, 8, 16).to(E4M3) for _ in range(3)))


@pytest.mark.gpu
@pytest.mark.parametrize("v_layout", ["n-major", "as-is"])
def test_fp8_on_the_gpu(v_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernels (FP8 tensor-core products on sm_89+) against the torch recipe, at
    lengths that are not tile multiples, V left as given or copied keys-contiguous first
    ($FLASHLITE_FP8_V); scales on the CPU refused."""
    dev = "cuda"
    monkeypatch.setenv("FLASHLITE_FP8_V", v_layout)
    for causal, d in ((False, 128), (True, 64), (True, 256)):
        (q8, sq, k8, sk), (v8, sv) = _inputs(2, 8, 2, 333, 1025, d)
        q8, sq, k8, sk, v8, sv = (x.to(dev) for x in (q8, sq, k8, sk, v8, sv))
        with torch.no_grad():
            o = flashlite.attention(
                q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=causal
            )
        _check(o, q8, sq, k8, sk, v8, sv, causal=causal)
    with pytest.raises(ValueError, match="q_descale must be on q's device"):
        flashlite.attention(q8, k8, v8, q_descale=sq.cpu())


def test_fp8_keys_contiguous_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FLASHLITE_FP8_V=n-major``'s path: V copied keys-contiguous before the forward (FP8
    wgmma reads its B operand K-major only); the same arithmetic, so the same bits as V as
    given."""
    from flashlite.ops.attention.backends.triton import fwd as triton_fwd

    (q8, sq, k8, sk), (v8, sv) = _inputs(1, 4, 2, 37, 45, 24)
    opts = {"q_descale": sq, "k_descale": sk, "v_descale": sv, "causal": True}
    with torch.no_grad():
        want = flashlite.attention(q8, k8, v8, **opts)
        monkeypatch.setattr(triton_fwd, "fp8_v_n_major", lambda v: True)
        got = flashlite.attention(q8, k8, v8, **opts)
    assert torch.equal(got, want)
