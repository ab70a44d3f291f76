"""flashlite.cross_entropy (issue 12, musts 1 and 3) against torch in fp64.

The kernel runs in Triton's interpreter on CPU; ``kernel`` runs each test twice, once with the
whole row on chip (one read) and once with the row tiled into 256-column loops (two passes), by
shrinking the block table. The reference is ``torch.nn.functional.cross_entropy`` in fp64 on the
same (rounded) logits, plus the z-loss and the soft cap written out in torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL

import flashlite
from flashlite.kernels import cross_entropy as kce
from flashlite.ops import cross_entropy as oce
from flashlite.ops.cross_entropy import checks as oce_checks
from flashlite.ops.cross_entropy import linear as oce_linear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["single", "loop"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "loop":  # rows of 17 take one ragged 32-wide tile, 1000 take four
        monkeypatch.setattr(kce, "SINGLE_READ_MAX", 8)
        monkeypatch.setattr(kce, "LOOP_TILE", 256)
    return request.param


def reference(logits, target, weight=None, *, ignore_index=-100, reduction="mean",  # noqa: ANN001, ANN201
              label_smoothing=0.0, z_loss=0.0, softcap=None):  # fmt: skip
    """fp64 torch: cross_entropy on the (capped) logits, classes last, reduced as torch does
    (weighted mean: divided by the kept targets' weights), plus z·lse² per kept token reduced
    unweighted (mean: divided by the kept targets' count), Liger's convention."""
    x = logits.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    v = x.shape[-1]
    x2, t1 = x.reshape(-1, v), target.reshape(-1).long()
    w = weight.double() if weight is not None else None
    ce = F.cross_entropy(x2, t1, w, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)  # fmt: skip
    kept = t1 != ignore_index
    z = z_loss * torch.where(kept, torch.logsumexp(x2, -1) ** 2, 0.0)
    if reduction == "none":
        return (ce + z).view(target.shape)
    return ce + (z.sum() if reduction == "sum" else z.sum() / kept.sum())


def _inputs(shape, v, dtype, seed=0, scale=3.0):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=gen) * scale).to(dtype)
    target = torch.randint(0, v, shape, generator=gen)
    if target.numel() > 2:
        target.view(-1)[1] = -100  # one ignored token
    weight = torch.rand(v, generator=gen) + 0.5
    return logits, target, weight


def _check(logits, target, tol, **kw):  # noqa: ANN001, ANN202
    """Loss and gradient against the fp64 reference; returns the gradient."""
    leaf = logits.clone().requires_grad_()
    ref_leaf = logits.double().requires_grad_()
    got = flashlite.cross_entropy(leaf, target, **kw)
    want = reference(ref_leaf, target, **kw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=tol.atol, rtol=tol.rtol)
    return leaf.grad


OPTIONS = [
    {},
    {"weight": True},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 5.0},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"ignore_index": 3},  # a valid class id as ignore_index
    {"weight": True, "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0},
    {"weight": True, "label_smoothing": 0.3, "reduction": "none", "softcap": 2.0},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize(
    ("dtype", "v"),
    [(torch.float32, 1000), (torch.float32, 4093), (torch.float32, 17), (torch.float16, 4093),
     (torch.bfloat16, 1000)],
    ids=lambda v: f"V{v}" if isinstance(v, int) else str(v),
)  # fmt: skip
def test_matches_torch(dtype: torch.dtype, v: int, opts: dict, kernel: str) -> None:
    logits, target, weight = _inputs((5,), v, dtype, seed=v)
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = weight
    if "ignore_index" in kw:
        target[1] = kw["ignore_index"]
        target[2] = v - 1 if v - 1 != kw["ignore_index"] else 0
    _check(logits, target, TOL[dtype], **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_time_layout_and_non_contiguous(dtype: torch.dtype, kernel: str) -> None:
    logits, target, _ = _inputs((2, 3), 40, dtype)
    _check(logits, target, TOL[dtype])
    wide = torch.randn(6, 90).to(dtype)[:, ::2]  # (6, 45), column stride 2
    _check(wide, torch.arange(6) * 7, TOL[dtype], label_smoothing=0.1)
    _check(torch.randn(40, 6).to(dtype).t(), torch.arange(6), TOL[dtype])  # rows strided by 1


def test_one_class_and_one_row(kernel: str) -> None:
    _check(torch.randn(3, 1), torch.zeros(3, dtype=torch.long), TOL[torch.float32])
    _check(torch.randn(1, 17), torch.tensor([16]), TOL[torch.float32], z_loss=0.1)


def test_extreme_logits(kernel: str) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen) * 1e4  # ±1e4
    target = torch.randint(0, 50, (6,), generator=gen)
    _check(logits, target, TOL[torch.float32])
    masked = torch.randn(6, 50, generator=gen)
    masked[masked > 0.5] = float("-inf")  # −inf at non-target entries
    masked[torch.arange(6), target] = 1.0
    grad = _check(masked, target, TOL[torch.float32], z_loss=1e-2)
    assert torch.isfinite(grad).all()
    _check(masked, target, TOL[torch.float32], softcap=3.0)  # capped −inf is −3: finite
    # smoothing over −inf logits: torch's loss is inf; ours too
    got = flashlite.cross_entropy(masked, target, label_smoothing=0.1)
    assert torch.isinf(got) and torch.isinf(reference(masked, target, label_smoothing=0.1))


def _close_logits_case(device: str, v: int) -> None:
    # logits near 1e4 that differ by less than one: the LSE rounded to fp32 is off by up to
    # 5e-4, so p and the loss come from the pair (m, s) instead; fp32 then matches fp64 to ~1e-7
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, v, generator=gen) * 3
    x[:, 5], x[:, 7], x[1, 9] = 1e4, 1e4 - 0.7, -1e4
    target = torch.tensor([5, 7, 3, 5])
    for opts in ({}, {"label_smoothing": 0.1}, {"weight": torch.rand(v, generator=gen) + 0.5}):
        leaf = x.to(device, copy=True).requires_grad_()
        w = opts.get("weight")
        kw = dict(opts, weight=w.to(device)) if w is not None else opts
        loss = flashlite.cross_entropy(leaf, target.to(device), reduction="none", **kw)
        loss.sum().backward()
        ref = x.double().requires_grad_()
        eps = opts.get("label_smoothing", 0.0)
        want = F.cross_entropy(ref, target, w.double() if w is not None else None,
                               reduction="none", label_smoothing=eps)  # fmt: skip
        want.sum().backward()
        torch.testing.assert_close(leaf.grad.double().cpu(), ref.grad, atol=1e-6, rtol=0)
        # (a loss of 1e4 is fp32's to 6e-8; the smoothing term's lse·V − Σ x cancels at 1e4·V
        # in fp32: looser there)
        tol = 2e-3 if eps else 1e-5
        torch.testing.assert_close(loss.double().cpu(), want.detach(), atol=tol, rtol=1.2e-7)


def test_close_logits_near_1e4_in_fp32(kernel: str) -> None:
    _close_logits_case("cpu", 1000)


@pytest.mark.gpu
def test_gpu_close_logits_near_1e4_in_fp32() -> None:
    # 64k: the Gluon kernel without weights, the Triton loop with them; 1000: one tile
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for v in (1000, 65536):
        _close_logits_case("cuda", v)


def test_every_target_ignored() -> None:
    logits = torch.randn(4, 30, requires_grad=True)
    target = torch.full((4,), -100)
    got = flashlite.cross_entropy(logits, target)
    assert torch.isnan(got) and torch.isnan(F.cross_entropy(logits.detach(), target))
    got.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    got = flashlite.cross_entropy(logits.detach(), target, reduction="sum")
    assert got.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_backward_gives_the_same_gradient(dtype: torch.dtype, kernel: str) -> None:
    logits, target, weight = _inputs((6,), 300, dtype)
    kw = {"weight": weight, "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 8.0}
    leaf = logits.clone().requires_grad_()
    flashlite.cross_entropy(leaf, target, **kw).backward()
    src = logits.clone().requires_grad_()
    hidden = src * 1.0  # a non-leaf whose buffer the forward overwrites
    loss = flashlite.cross_entropy(hidden, target, inplace_backward=True, **kw)
    loss.backward()
    assert torch.equal(src.grad, leaf.grad)
    assert torch.equal(hidden.detach(), leaf.grad)  # the logits buffer holds the gradient


def test_return_lse_and_int32_targets() -> None:
    logits, target, _ = _inputs((2, 4), 33, torch.float32)
    loss, lse = flashlite.cross_entropy(logits, target.int(), return_lse=True, softcap=6.0)
    capped = 6.0 * torch.tanh(logits.double() / 6.0)
    torch.testing.assert_close(lse.double(), torch.logsumexp(capped, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, flashlite.cross_entropy(logits, target, softcap=6.0))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_non_unit_incoming_gradients(reduction: str) -> None:
    """The stored gradient is scaled for ``loss.backward()``; any other incoming gradient (a
    scaled loss, per-token weights under ``none``) rescales it, in place or through the op."""
    logits, target, weight = _inputs((6,), 70, torch.float32)
    upstream = torch.rand(6) + 0.5 if reduction == "none" else torch.tensor(3.0)
    for inplace in (False, True):
        src = logits.clone().requires_grad_()
        got = flashlite.cross_entropy(src * 1.0, target, weight, reduction=reduction,
                                      inplace_backward=inplace)  # fmt: skip
        (got * upstream).sum().backward()
        ref = logits.double().requires_grad_()
        (reference(ref, target, weight, reduction=reduction) * upstream.double()).sum().backward()
        torch.testing.assert_close(src.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)


def test_inplace_backward_guards_saved_logits() -> None:
    """With ``inplace_backward`` the gradient overwrites the logits (eager: the kernel called
    directly, the version counter bumped by hand): a node that saved them must refuse."""
    logits, target, _ = _inputs((5,), 40, torch.float32)
    src = logits.clone().requires_grad_()
    hidden = src * 1.0
    other = (hidden * hidden).sum()  # saves hidden for its backward
    loss = flashlite.cross_entropy(hidden, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_backward_runs_once() -> None:
    logits = torch.randn(3, 20, requires_grad=True)
    loss = flashlite.cross_entropy(logits, torch.arange(3))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


# on a GPU with Gluon, 128k columns without class weights take the prefetch kernel
@pytest.mark.parametrize(
    ("device", "v", "use_weight"),
    [("cpu", 64, True), pytest.param("cuda", 131072, False, marks=pytest.mark.gpu)],
)
def test_compiles_and_passes_opcheck(device: str, v: int, use_weight: bool) -> None:
    from torch.library import opcheck

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits, target, weight = (t.to(device) for t in _inputs((4,), v, torch.float32))
    weight = weight if use_weight else None

    def step(x, t, w):  # noqa: ANN001, ANN202
        return flashlite.cross_entropy(x, t, w, label_smoothing=0.1, z_loss=1e-3)

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaf = logits.clone().requires_grad_()
        loss = fn(leaf, target, weight)
        loss.backward()
        grads.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)
    scale = torch.tensor([0.25], device=device)
    for reduction in ("mean", "none"):
        args = (logits.clone(), torch.empty_like(logits), target, weight, scale, None, reduction,
                -100, 0.1, 1e-3, 0.0)  # fmt: skip
        opcheck(torch.ops.flashlite.cross_entropy_fwd.default, args)
    opcheck(torch.ops.flashlite.cross_entropy_fwd_inplace.default,
            (logits.clone(), target, None, scale, None, "sum", -100, 0.0, 0.0, 0.0))  # fmt: skip
    grad = torch.randn(4, v, device=device)
    for dloss in (torch.rand(4, device=device), torch.tensor(2.0, device=device)):
        opcheck(torch.ops.flashlite.cross_entropy_bwd_inplace.default, (grad.clone(), dloss))


def test_bad_input() -> None:
    x = torch.randn(4, 10)
    t = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        flashlite.cross_entropy(x, torch.tensor([0, 1, 10, 3]))
    with pytest.raises(ValueError, match="outside"):
        flashlite.cross_entropy(x, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(TypeError, match="class indices"):
        flashlite.cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="target"):
        flashlite.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="label_smoothing"):
        flashlite.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        flashlite.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="weight"):
        flashlite.cross_entropy(x, t, torch.ones(9))
    with pytest.raises(TypeError, match="dtype"):
        flashlite.cross_entropy(x.double(), t)
    # without validation a bad target gives NaN (loss and its gradient row), never a crash
    leaf = x.clone().requires_grad_()
    loss = flashlite.cross_entropy(leaf, torch.tensor([0, 10, 2, 3]), reduction="none",
                                   validate=False)  # fmt: skip
    loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    assert torch.isnan(leaf.grad[1]).all() and torch.isfinite(leaf.grad[[0, 2, 3]]).all()


def test_target_check_reports_the_class_and_resets() -> None:
    # CPU tensors: the device-side check is reported by the call itself, with the class and V;
    # the record is cleared once reported, so the next good call runs
    x = torch.randn(5, 7)
    with pytest.raises(ValueError, match=r"class 9, outside \[0, 7\) and not ignore_index=-1"):
        flashlite.cross_entropy(x, torch.tensor([0, -1, 9, 3, 12]), ignore_index=-1)
    with pytest.raises(ValueError, match=r"class -5, outside"):  # a sum checks too
        flashlite.cross_entropy(x, torch.tensor([0, -5, 2, 3, 4]), reduction="sum",
                                validate="sync")  # fmt: skip
    got = flashlite.cross_entropy(x, torch.tensor([0, 6, 2, 3, 4], dtype=torch.int32))
    want = F.cross_entropy(x.double(), torch.tensor([0, 6, 2, 3, 4]))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # ignore_index may be any integer, a valid class or far outside int32
    for ii in (2, -(2**40)):
        t = torch.tensor([0, ii, 2, 3, 4])
        got = flashlite.cross_entropy(x, t, ignore_index=ii)
        torch.testing.assert_close(got.double(), F.cross_entropy(x.double(), t, ignore_index=ii),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="validate"):
            flashlite.cross_entropy(x, torch.tensor([0, 1, 2, 3, 4]), validate=bad)


def test_an_earlier_calls_bad_target_is_reported_as_earlier() -> None:
    # a record left by an earlier call (on a GPU: one whose check had not landed when it
    # returned) is reported as that call's, before this call's own targets are checked

    flag = oce_checks._bad_record(torch.device("cpu"))[0]
    flag.copy_(torch.tensor([1, 42, 7]))
    x, t = torch.randn(3, 7), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"an earlier .* class 42, outside \[0, 7\)"):
        flashlite.cross_entropy(x, t, validate="sync")
    assert flag.tolist() == [0, 0, 0]
    flag.copy_(torch.tensor([1, 42, 7]))
    with pytest.raises(ValueError, match=r"an earlier .* class 42"):
        flashlite.linear_cross_entropy(x, torch.randn(7, 7), t)
    assert torch.isfinite(flashlite.cross_entropy(x, t))  # reported once


def test_no_targets() -> None:
    # N = 0: torch's mean of nothing is NaN, its sum 0
    x = torch.randn(0, 5, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64)
    assert torch.isnan(flashlite.cross_entropy(x, t))
    loss = flashlite.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, 5)


@pytest.mark.gpu
def test_gpu_linear_bad_target_reported_without_a_sync() -> None:
    # linear cross-entropy checks its targets as cross_entropy does: on the device, in the launch
    # that computes the mean's divisor (no host sync), reported by a later call of either
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden = torch.randn(6, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 32, device="cuda", dtype=torch.bfloat16)
    good = torch.randint(0, 1000, (6,), device="cuda")
    bad = good.clone()
    bad[2] = 1005
    loss = flashlite.linear_cross_entropy(hidden, weight, bad, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[:2]).all()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"earlier .* class 1005, outside \[0, 1000\)"):
        flashlite.linear_cross_entropy(hidden, weight, good)
    assert torch.isfinite(flashlite.linear_cross_entropy(hidden, weight, good))  # reported once
    with pytest.raises(ValueError, match=r"class 1005, outside \[0, 1000\) and not"):
        flashlite.linear_cross_entropy(hidden, weight, bad, validate="sync")
    assert torch.isnan(flashlite.linear_cross_entropy(hidden, weight, bad, validate=False))
    torch.cuda.synchronize()
    assert torch.isfinite(flashlite.cross_entropy(hidden @ weight.t(), good))  # nothing recorded


@pytest.mark.gpu
def test_gpu_bad_target_reported_by_a_later_call() -> None:
    # validate=True on a GPU: no host sync; the bad target's row is NaN and the next call
    # that finds the device's check finished raises; validate="sync" raises at the call

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for v in (1000, 65536):  # the Triton kernel and, for 64k, the Gluon one
        x = torch.randn(6, v, device="cuda", dtype=torch.bfloat16)
        good = torch.randint(0, v, (6,), device="cuda")
        bad = good.clone()
        bad[4] = v + 3
        loss = flashlite.cross_entropy(x, bad, reduction="none")
        assert torch.isnan(loss[4]) and torch.isfinite(loss[:4]).all()
        torch.cuda.synchronize()
        # the kernel set the record's host flag itself (pinned memory, no copy launched)
        assert oce_checks._bad_record(x.device)[1].tolist() == [1]
        with pytest.raises(ValueError, match=rf"earlier .* class {v + 3}, outside \[0, {v}\)"):
            flashlite.cross_entropy(x, good)
        assert torch.isfinite(flashlite.cross_entropy(x, good))  # reported once
        with pytest.raises(ValueError, match=rf"class {v + 3}, outside \[0, {v}\) and not"):
            flashlite.cross_entropy(x, bad, validate="sync")
        loss = flashlite.cross_entropy(x, bad, validate=False)  # unchecked: NaN, no report
        torch.cuda.synchronize()
        assert torch.isnan(loss) and torch.isfinite(flashlite.cross_entropy(x, good))


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


# --------------------------------------------------------------------------- linear CE (must 2)
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
