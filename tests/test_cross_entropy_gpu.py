"""cross_entropy on a CUDA device: long vocabularies with every option, the Gluon prefetch
kernel (its counts and sums over many rows, bad targets and the LSE), and CPU tensors in a
process with a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL
from cross_entropy_helpers import _check, reference

import flashlite


@pytest.mark.gpu
@pytest.mark.parametrize("v", [131072, 262144], ids=["128k", "256k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_long_vocabularies(dtype: torch.dtype, v: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, v, device="cuda", generator=gen) * 4).to(dtype)
    target = torch.randint(0, v, (64,), device="cuda", generator=gen)
    target[5] = -100
    weight = torch.rand(v, device="cuda", generator=gen) + 0.5
    _check(logits, target, TOL[dtype], weight=weight, label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace"])
@pytest.mark.parametrize("v", [65536 + 13, 262144], ids=["64k+13", "256k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_long_rows_every_option(dtype: torch.dtype, v: int, inplace: bool) -> None:
    # the two-pass loop on long rows, many rows, every option on, in place or not
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 2**26 // v
    logits = (torch.randn(rows, v, device="cuda", generator=gen) * 4).to(dtype)
    logits[3, ::7] = float("-inf")
    target = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    target[5] = -100
    weight = torch.rand(v, device="cuda", generator=gen) + 0.5
    kw = dict(weight=weight, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    target[3] = 0  # a finite logit (column 0 is not −inf)
    _check_through_a_non_leaf(logits, target, inplace, **kw)


def _check_through_a_non_leaf(logits, target, inplace, **kw):  # noqa: ANN001, ANN003, ANN202
    """Loss and gradient against the fp64 reference, the logits a non-leaf (``inplace_backward``
    overwrites its buffer with the gradient)."""
    leaf = logits.clone().requires_grad_()
    got = flashlite.cross_entropy(leaf * 1.0, target, inplace_backward=inplace, **kw)
    ref_leaf = logits.double().requires_grad_()
    want = reference(ref_leaf, target, **kw)
    tol = TOL[logits.dtype]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=tol.atol, rtol=tol.rtol)


PREFETCH_OPTIONS = [
    {},
    {"label_smoothing": 0.1, "z_loss": 1e-4},
    {"reduction": "sum", "ignore_index": 7},
    {"reduction": "none", "label_smoothing": 0.2},
]


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace"])
@pytest.mark.parametrize("kw", PREFETCH_OPTIONS, ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize(("rows", "v"), [(300, 65544), (257, 131072), (64, 262144)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_prefetch_kernel(dtype: torch.dtype, rows: int, v: int, kw: dict,
                             inplace: bool) -> None:  # fmt: skip
    # Long rows without weights or a soft cap take the Gluon team kernel (logits read once):
    # an odd number of rows (more than teams), −inf logits, ±1e4, an ignored row, a target in
    # the last chunk, every reduction; in place or not.
    from flashlite.ops.prefetch import prefetch_applies

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(rows, v, device="cuda", generator=gen) * 4).to(dtype)
    if not prefetch_applies(logits, logits):
        pytest.skip("the prefetch kernel needs Gluon on a CUDA sm_80+ device")
    logits[3, ::7] = float("-inf")
    logits[4, 11] = 1e4
    logits[6, -1] = -1e4
    target = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    target[3], target[4], target[5], target[6] = 1, 11, kw.get("ignore_index", -100), v - 1
    _check_through_a_non_leaf(logits, target, inplace, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("validate", [True, False, "sync"], ids=["checked", "unchecked", "sync"])
def test_gpu_prefetch_counts_and_sums_many_rows(validate: bool | str) -> None:
    # An eager call on the Gluon path is one launch: the kernel counts the mean's targets and
    # sums the losses itself ("sync": the scale is counted before, with the host check, and
    # given; the kernel still scales the sum). More rows than its programs' first blocks of
    # targets, a third of them ignored; the same loss bit for bit on a second call; every
    # target ignored.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashlite.ops.prefetch import prefetch_applies

    rows, v = 300_007, 16384
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16, generator=gen)
    if not prefetch_applies(logits, logits):
        pytest.skip("the prefetch kernel needs Gluon on a CUDA sm_80+ device")
    target = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    target[::3] = -100
    want = sum(torch.nn.functional.cross_entropy(logits[r : r + 20000].double(),
                                                 target[r : r + 20000], reduction="sum")
               for r in range(0, rows, 20000))  # fmt: skip
    kept = (target != -100).sum().double()
    got = flashlite.cross_entropy(logits, target, validate=validate)
    torch.testing.assert_close(got.double(), want / kept, atol=1e-6, rtol=1e-5)
    assert torch.equal(got, flashlite.cross_entropy(logits, target, validate=validate))
    total = flashlite.cross_entropy(logits, target, reduction="sum", validate=validate)
    torch.testing.assert_close(total.double(), want, atol=1e-6, rtol=1e-5)
    none = torch.full((1000,), -100, device="cuda")
    assert torch.isnan(flashlite.cross_entropy(logits[:1000], none, validate=validate))
    zero = flashlite.cross_entropy(logits[:1000], none, reduction="sum", validate=validate)
    assert zero.item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("v", [1000, 16384], ids=["triton", "gluon"])
def test_gpu_cpu_tensors_run_on_the_gpu(v: int) -> None:
    # CPU tensors in a process with a GPU: the call moves whole to the GPU (its kernels write
    # the gradient in place, which a per-call copy would lose) and the gradients come back to
    # the CPU leaves; a bad target still raises at the call, as on the CPU
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, v, generator=gen) * 3
    target = torch.randint(0, v, (6,), generator=gen)
    target[2] = -100
    for inplace in (False, True):
        _check_through_a_non_leaf(logits, target, inplace, label_smoothing=0.1)
    bad = target.clone()
    bad[4] = v + 3
    with pytest.raises(ValueError, match=rf"class {v + 3}, outside \[0, {v}\) and not"):
        flashlite.cross_entropy(logits, bad)
    hidden = torch.randn(6, 16, generator=gen, requires_grad=True)
    weight = (torch.randn(v, 16, generator=gen) / 4).requires_grad_()
    flashlite.linear_cross_entropy(hidden, weight, target).backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    F.cross_entropy(h64 @ w64.t(), target).backward()
    assert hidden.grad.device.type == "cpu" and weight.grad.device.type == "cpu"
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_prefetch_kernel_bad_target_and_lse() -> None:
    # validate=False: a target outside [0, V) gives a NaN loss and gradient row; the LSE
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(33, 65536, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 65536, (33,), device="cuda")
    target[2] = 65536
    leaf = logits.clone().requires_grad_()
    loss, lse = flashlite.cross_entropy(leaf, target, reduction="none", validate=False,
                                        return_lse=True)  # fmt: skip
    loss.sum().backward()
    assert torch.isnan(loss[2]) and torch.isfinite(loss[torch.arange(33) != 2]).all()
    assert torch.isnan(leaf.grad[2]).all() and torch.isfinite(leaf.grad[:2]).all()
    want = torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(lse.double(), want, atol=1e-4, rtol=1e-5)
