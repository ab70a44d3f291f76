"""flashlite.linear_cross_entropy against torch's cross-entropy of the full logits in fp64:
every option over chunks of tokens and slices of the vocabulary, layouts and bad input, the
stored gradients, compile and opcheck, and when the vocabulary is sliced."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL
from cross_entropy_helpers import DTYPES, reference

import flashlite
from flashlite.ops import cross_entropy as oce
from flashlite.ops.cross_entropy import linear as oce_linear

LINEAR_OPTIONS = [
    {},
    {"bias": True},
    {"class_weight": True, "label_smoothing": 0.1},
    {"z_loss": 1e-3, "softcap": 5.0, "bias": True},
    {"reduction": "sum", "class_weight": True},
    {"reduction": "none", "bias": True, "label_smoothing": 0.2},
    {"class_weight": True, "z_loss": 1e-2, "softcap": 5.0},  # the mean's z-loss: by the count
]


#: The 16-bit dtypes share the options between them (CI time): bf16 (the interpreter's slowest
#: dtype) runs those whose kernel work differs, plain and both mixes of z-loss and soft cap
#: with a bias or class weights, fp16 the rest; fp32 runs all.
_16_BIT_LINEAR = {torch.bfloat16: (0, 3, 6), torch.float16: (1, 2, 4, 5)}


_LINEAR_CASES = [
    pytest.param(dtype, opts, id=f"{dtype}-{'-'.join(opts) or 'plain'}")
    for dtype in DTYPES
    for i, opts in enumerate(LINEAR_OPTIONS)
    if i in _16_BIT_LINEAR.get(dtype, range(len(LINEAR_OPTIONS)))
]


@pytest.mark.parametrize("vocab", [None, 300], ids=["whole-rows", "vocab-slices"])
@pytest.mark.parametrize("dtype,opts", _LINEAR_CASES)
def test_linear_cross_entropy_matches_torch(dtype: torch.dtype, opts: dict, vocab: int) -> None:
    """Loss and the gradients of hidden, weight and bias against torch's CE of the full logits
    in fp64; four tokens per chunk, so ten tokens take three chunks, and with ``vocab`` each
    chunk's 1000 classes in slices of 300 (the last one 100) merged through ``stats.merge``."""
    gen = torch.Generator().manual_seed(7)
    n, h, v = 10, 16, 1000
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / 4).to(dtype)
    bias = torch.randn(v, generator=gen).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    target[3] = -100
    kw = dict(opts)
    b = bias if kw.pop("bias", False) else None
    cw = torch.rand(v, generator=gen) + 0.5 if kw.pop("class_weight", False) else None
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    lb = b.clone().requires_grad_() if b is not None else None
    got = flashlite.linear_cross_entropy(*leaves, target, bias=lb, class_weight=cw,
                                         chunk_size=4, vocab_chunk_size=vocab, **kw)  # fmt: skip
    refs = [t.double().requires_grad_() for t in (hidden, weight)]
    rb = b.double().requires_grad_() if b is not None else None
    logits = refs[0] @ refs[1].t() + (rb if rb is not None else 0.0)
    want = reference(logits, target, cw, **kw)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol.atol * 4, rtol=tol.rtol * 4)
    upstream = torch.randn(got.shape, generator=gen, dtype=torch.float64)  # a non-unit gradient
    (got.double() * upstream).sum().backward()
    (want * upstream).sum().backward()
    for leaf, ref in zip([*leaves, lb], [*refs, rb], strict=True):
        if leaf is None:
            continue
        scale = max(1.0, ref.grad.abs().max().item())
        torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=4 * tol.atol * scale,
                                   rtol=4 * tol.rtol)  # fmt: skip


def test_linear_cross_entropy_layouts_and_bad_input() -> None:
    hidden = torch.randn(2, 3, 8)
    weight = torch.randn(50, 8)
    target = torch.randint(0, 50, (2, 3))
    loss, lse = flashlite.linear_cross_entropy(hidden, weight, target, return_lse=True)
    want = reference(hidden @ weight.t(), target)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(hidden @ weight.t(), -1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="agree on H"):
        flashlite.linear_cross_entropy(hidden, torch.randn(50, 9), target)
    with pytest.raises(ValueError, match="outside"):
        flashlite.linear_cross_entropy(hidden, weight, target + 50)
    with pytest.raises(ValueError, match="chunk_size"):
        flashlite.linear_cross_entropy(hidden, weight, target, chunk_size=0)
    with pytest.raises(ValueError, match="validate"):
        flashlite.linear_cross_entropy(hidden, weight, target, validate="later")
    with pytest.raises(ValueError, match="outside"):  # CPU tensors: reported by this call
        flashlite.linear_cross_entropy(hidden, weight, target - 60, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_unit_backward_leaves_the_stored_gradients(reduction: str) -> None:
    """A plain ``loss.backward()`` sends exactly 1: the backward hands over the gradients the
    forward stored, untouched (its scaling kernel skips a unit gradient), and they are the fp64
    reference's; a second loss scaled by 3 gets three times them."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(6, 16, generator=gen), torch.randn(50, 16, generator=gen) / 4
    bias, target = torch.randn(50, generator=gen), torch.randint(0, 50, (6,), generator=gen)
    refs = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    reference(refs[0] @ refs[1].t() + refs[2], target, reduction=reduction).backward()
    for factor in (1.0, 3.0):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = flashlite.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2],
                                              reduction=reduction)  # fmt: skip
        (loss * factor if factor != 1.0 else loss).backward()
        for leaf, ref in zip(leaves, refs, strict=True):
            torch.testing.assert_close(leaf.grad.double(), factor * ref.grad, atol=1e-5,
                                       rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_compiles_and_passes_opcheck(reduction: str) -> None:
    """``torch.compile(fullgraph=True)`` traces linear CE (its sweeps are custom ops) and gives
    eager's loss and gradients; both ops pass ``opcheck``."""
    from torch.library import opcheck

    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(6, 16, generator=gen), torch.randn(50, 16, generator=gen) / 4
    bias, target = torch.randn(50, generator=gen), torch.randint(0, 50, (6,), generator=gen)
    upstream = torch.rand(6, generator=gen) + 0.5 if reduction == "none" else torch.tensor(2.0)

    def step(h, w, b):  # noqa: ANN001, ANN202
        return flashlite.linear_cross_entropy(h, w, target, bias=b, reduction=reduction,
                                              label_smoothing=0.1, chunk_size=4,
                                              validate=False)  # fmt: skip

    runs = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = fn(*leaves)
        (loss * upstream).sum().backward()
        runs.append((loss.detach(), *(leaf.grad for leaf in leaves)))
    for got, want in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    opts = (-100, 0.1, 1e-3, 0.0, 4, 0)
    opcheck(torch.ops.flashlite.linear_cross_entropy_fwd.default,
            (hidden, weight, bias, target, None, torch.rand(6), *opts, True))  # fmt: skip
    opcheck(torch.ops.flashlite.linear_cross_entropy_fwd.default,
            (hidden, weight, None, target, None, torch.ones(6), *opts, False))  # fmt: skip
    opcheck(torch.ops.flashlite.linear_cross_entropy_bwd.default,
            (hidden, weight, bias, target, torch.rand(50) + 0.5, torch.rand(6), *opts))  # fmt: skip
    sliced = (*opts[:-1], 16)  # vocabulary slices of 16 classes
    opcheck(torch.ops.flashlite.linear_cross_entropy_fwd.default,
            (hidden, weight, bias, target, None, torch.rand(6), *sliced, True))  # fmt: skip
    opcheck(torch.ops.flashlite.linear_cross_entropy_bwd.default,
            (hidden, weight, None, target, None, torch.rand(6), *sliced))  # fmt: skip


def test_linear_cross_entropy_slices_the_vocabulary_only_when_rows_do_not_fit() -> None:

    budget = oce.LINEAR_CHUNK_BYTES
    assert oce_linear._linear_chunking(128256, 2, None, None) == (budget // (128256 * 2), 0)
    too_wide = budget // (2 * oce.LINEAR_MIN_TOKENS) + 1  # classes: 256 tokens no longer fit
    assert oce_linear._linear_chunking(too_wide, 2, None, None) == (
        oce.LINEAR_MIN_TOKENS,
        budget // (2 * oce.LINEAR_MIN_TOKENS),
    )
    assert oce_linear._linear_chunking(1000, 4, 8, 300) == (8, 300)
    assert oce_linear._linear_chunking(1000, 4, 8, 5000) == (8, 0)  # a slice past V: whole rows
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        flashlite.linear_cross_entropy(torch.randn(2, 8), torch.randn(50, 8),
                                       torch.zeros(2, dtype=torch.long),
                                       vocab_chunk_size=0)  # fmt: skip
