"""flashlite.cross_entropy against torch in fp64.

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
from cross_entropy_helpers import DTYPES, _check, _inputs, reference

import flashlite
from flashlite.kernels import cross_entropy as kce


@pytest.fixture(params=["single", "loop"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "loop":  # rows of 17 take one ragged 32-wide tile, 1000 take four
        monkeypatch.setattr(kce, "SINGLE_READ_MAX", 8)
        monkeypatch.setattr(kce, "LOOP_TILE", 256)
    return request.param


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


def test_no_targets() -> None:
    # N = 0: torch's mean of nothing is NaN, its sum 0
    x = torch.randn(0, 5, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64)
    assert torch.isnan(flashlite.cross_entropy(x, t))
    loss = flashlite.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, 5)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_the_moved_call_path_on_the_cpu(softcap: float | None, monkeypatch) -> None:  # noqa: ANN001
    """CPU tensors in a process whose kernels run on a GPU re-call the function with the moved
    tensors (the GPU's path). Here the CPU stands in for that GPU, once per call: the re-call
    takes the same options (the defaults included) and gives the plain call's result."""
    from flashlite.ops.cross_entropy import api

    real = api.moved_call_device
    pending: list[bool] = []

    def once(device: torch.device) -> torch.device | None:
        if pending:
            pending.clear()
            return torch.device("cpu")
        return real(device)

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 40, generator=gen)
    target = torch.randint(0, 40, (5,), generator=gen)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(40, 8, generator=gen)
    want = (
        flashlite.cross_entropy(logits, target, softcap=softcap),
        flashlite.linear_cross_entropy(hidden, weight, target, softcap=softcap),
    )
    monkeypatch.setattr(api, "moved_call_device", once)
    pending.append(True)
    got_ce = flashlite.cross_entropy(logits, target, softcap=softcap)
    assert not pending  # (the moved path ran)
    pending.append(True)
    got_linear = flashlite.linear_cross_entropy(hidden, weight, target, softcap=softcap)
    assert not pending
    torch.testing.assert_close(got_ce, want[0])
    torch.testing.assert_close(got_linear, want[1])
