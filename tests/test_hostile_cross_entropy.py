"""Hostile cross-entropy calls: a weighted mean's z-loss (and every target ignored), and
inplace_backward on leaves, views, rows that make no (N, V) view and overlapping logits.

Each case gives the right value (checked against torch or the fp64 reference) or raises a
clear error naming the argument; none may crash, read outside a tensor or return silent garbage.
Runs on CPU in the interpreter and, for the cases marked ``gpu``, on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from hostile_helpers import _F, _ce_inputs, _ce_ref

import flashlite


def _ce_run(x, t, w, path, **kw):  # noqa: ANN001, ANN003, ANN202
    """flashlite.cross_entropy's loss and the logits' gradient on one of its forward paths."""
    leaf = x.clone().requires_grad_()
    if path == "checked":  # (CPU: the scale kernel checks the targets and is waited for)
        loss = flashlite.cross_entropy(leaf, t, w, **kw)
    elif path == "unchecked":  # the scale kernel inside the eager forward
        loss = flashlite.cross_entropy(leaf, t, w, validate=False, **kw)
    elif path == "inplace":
        loss = flashlite.cross_entropy(leaf * 1.0, t, w, inplace_backward=True, **kw)
    else:  # traced: the scales from torch ops
        step = torch.compile(lambda x, t, w: flashlite.cross_entropy(x, t, w, **kw),
                             fullgraph=True)  # fmt: skip
        loss = step(leaf, t, w)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("path", ["checked", "unchecked", "inplace", "compiled"])
def test_cross_entropy_weighted_mean_divides_the_z_loss_by_the_kept_targets_count(
    path: str,
) -> None:
    # Liger's convention: a mean's cross-entropy term is torch's weighted mean, its z-loss is
    # divided by the number of kept targets, unweighted; without class weights the two agree
    x, _, _, _, t, cw = _ce_inputs()
    kw = dict(label_smoothing=0.1, softcap=5.0)
    for w in (cw, None):
        loss, grad = _ce_run(x, t, w, path, z_loss=1e-2, **kw)
        ref = x.double().requires_grad_()
        want = _ce_ref(ref, t, w, eps=0.1, z=1e-2, softcap=5.0)
        want.backward()
        by_weight = _ce_ref(x, t, w, eps=0.1, z=1e-2, softcap=5.0, z_by="weight")
        torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
        if w is not None:
            assert (loss.double() - by_weight).abs() > 1e-2  # not the Σw convention
        else:
            torch.testing.assert_close(by_weight, want.detach())
    # sum and none: the z-loss unweighted as before (per-row losses: ce_row + z·lse²)
    for reduction in ("sum", "none"):
        got = flashlite.cross_entropy(x, t, cw, reduction=reduction, z_loss=1e-2, **kw)
        want = _ce_ref(x, t, cw, reduction=reduction, eps=0.1, z=1e-2, softcap=5.0)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["checked", "unchecked", "compiled"])
def test_cross_entropy_weighted_mean_with_z_loss_and_every_target_ignored_is_nan_with_zero_grad(
    path: str,
) -> None:
    # the z-loss's scale of a mean that keeps no target is 0, not 0/0: ignored rows stay 0
    x, _, _, _, _, cw = _ce_inputs()
    none = torch.full((6,), -100)
    loss, grad = _ce_run(x, none, cw, path, z_loss=1e-2)
    assert torch.isnan(loss) and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("vocab", [None, 16], ids=["whole-rows", "vocab-slices"])
def test_linear_cross_entropy_weighted_mean_divides_the_z_loss_by_the_kept_targets_count(
    vocab: int | None, compiled: bool
) -> None:
    _, hidden, weight, bias, t, cw = _ce_inputs()
    for w in (cw, None):

        def step(h, wt, b, w=w):  # noqa: ANN001, ANN202
            return flashlite.linear_cross_entropy(h, wt, t, bias=b, class_weight=w,
                                                  label_smoothing=0.1, z_loss=1e-2,
                                                  softcap=5.0, chunk_size=4,
                                                  vocab_chunk_size=vocab)  # fmt: skip

        leaves = [a.clone().requires_grad_() for a in (hidden, weight, bias)]
        loss = (torch.compile(step, fullgraph=True) if compiled else step)(*leaves)
        loss.backward()
        refs = [a.double().requires_grad_() for a in (hidden, weight, bias)]
        logits = refs[0] @ refs[1].t() + refs[2]
        want = _ce_ref(logits, t, w, eps=0.1, z=1e-2, softcap=5.0)
        want.backward()
        by_weight = _ce_ref(logits.detach(), t, w, eps=0.1, z=1e-2, softcap=5.0, z_by="weight")
        torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
        for leaf, ref in zip(leaves, refs, strict=True):
            torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
        if w is not None:
            assert (loss.double() - by_weight).abs() > 1e-2  # not the Σw convention
        else:
            torch.testing.assert_close(by_weight, want.detach())
    # every target ignored: NaN, zero gradients (the z-loss's scale is 0, not 0/0)
    leaves = [a.clone().requires_grad_() for a in (hidden, weight, bias)]
    loss = flashlite.linear_cross_entropy(*leaves[:2], torch.full((6,), -100), bias=leaves[2],
                                          class_weight=cw, z_loss=1e-2,
                                          vocab_chunk_size=vocab)  # fmt: skip
    loss.backward()
    assert torch.isnan(loss) and all(torch.equal(a.grad, torch.zeros_like(a)) for a in leaves)


def test_cross_entropy_inplace_backward_consumes_a_leaf_that_requires_grad() -> None:
    # flash-attn's and Liger's contract: inplace_backward=True is the caller's consent, a leaf
    # included; its values are consumed (they hold the gradient from the forward on) and its
    # .grad is that memory. A view of a leaf, grad mode off and logits needing no grad: alike
    from flashlite.ops.common import moved_call_device

    t = torch.tensor([0, 3, 5, 1])
    for shape in ((4, 10), (2, 2, 10)):
        tt = t.view(shape[:-1])
        before = torch.randn(*shape)
        ref = before.double().requires_grad_()
        want = _F.cross_entropy(ref.reshape(-1, 10), t)
        want.backward()
        leaf = before.clone().requires_grad_()
        loss = flashlite.cross_entropy(leaf, tt, inplace_backward=True)
        torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
        in_place = moved_call_device(leaf.device) is None  # (a moved call writes its copy)
        if in_place:  # consumed by the forward already
            torch.testing.assert_close(leaf.detach().double(), ref.grad, atol=1e-6, rtol=1e-5)
        loss.backward()
        torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
        assert not in_place or leaf.grad.data_ptr() == leaf.data_ptr()
        # a view of a leaf: the leaf's own columns are written, its grad gathers them
        leaf = before.clone().requires_grad_()
        flashlite.cross_entropy(leaf[..., :8], tt, inplace_backward=True).backward()
        ref8 = before[..., :8].double().requires_grad_()
        _F.cross_entropy(ref8.reshape(-1, 8), t).backward()
        torch.testing.assert_close(leaf.grad[..., :8].double(), ref8.grad, atol=1e-6, rtol=1e-5)
        assert torch.equal(leaf.grad[..., 8:], torch.zeros_like(leaf.grad[..., 8:]))
        for x, grad_mode in ((before.clone().requires_grad_(), False), (before.clone(), True)):
            with torch.set_grad_enabled(grad_mode):
                loss = flashlite.cross_entropy(x, tt, inplace_backward=True)
            torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
            if moved_call_device(x.device) is None:
                torch.testing.assert_close(x.detach().double(), ref.grad, atol=1e-6, rtol=1e-5)
    # a node that saved the leaf for its own backward: torch's version check, at the backward
    leaf = torch.randn(4, 10, requires_grad=True)
    square = (leaf * leaf).sum()
    loss = flashlite.cross_entropy(leaf, t, inplace_backward=True)
    if moved_call_device(leaf.device) is None:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (loss + square).backward()


@pytest.mark.gpu
def test_gpu_cpu_leaf_with_inplace_backward_on_a_gpu_machine() -> None:
    # CPU tensors on a machine with a GPU: the call moves to the GPU and its copy takes the
    # gradient; the CPU leaf keeps its values and gets the right .grad; overlap is still refused
    before = torch.randn(4, 10)
    leaf = before.clone().requires_grad_()
    t = torch.tensor([0, 3, 5, 1])
    flashlite.cross_entropy(leaf, t, inplace_backward=True).backward()
    ref = before.double().requires_grad_()
    _F.cross_entropy(ref, t).backward()
    assert torch.equal(leaf.detach(), before)
    torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
    buf = torch.randn(10)
    with pytest.raises(ValueError, match="overlapping or interleaved"):
        flashlite.cross_entropy(buf.expand(4, 10), t, inplace_backward=True)


def test_cross_entropy_inplace_backward_needs_rows_that_view_as_n_by_v() -> None:
    from flashlite.ops.common import moved_call_device

    # (B, T, V) logits whose rows make no (B·T, V) view (T and B swapped in memory): a copy
    # would take the gradient, not the caller's logits; refused, eagerly and compiled (the
    # compiled call falls back to eager for the error: a raise is a graph break)
    src = torch.randn(3, 2, 10)
    t = torch.tensor([[0, 3], [5, 1], [9, 2]])
    swapped = (src * 1.0).transpose(0, 1).contiguous().transpose(0, 1)  # (3, 2, 10), strided
    for fn in (flashlite.cross_entropy, torch.compile(flashlite.cross_entropy)):
        with pytest.raises(ValueError, match=r"rows form a \(N, V\) view"):
            fn(swapped, t, inplace_backward=True)
    want = _F.cross_entropy(src.double().reshape(-1, 10), t.reshape(-1))
    got = flashlite.cross_entropy(swapped, t)  # only read: fine
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    sliced = torch.randn(3, 2, 12)[..., :10]  # rows strided by 12: a view, written in place
    before = sliced.clone()
    flashlite.cross_entropy(sliced, t, inplace_backward=True)
    ref = before.double().requires_grad_()
    _F.cross_entropy(ref.reshape(-1, 10), t.reshape(-1)).backward()
    if moved_call_device(sliced.device) is None:  # (a CPU call moved to a GPU writes its copy)
        torch.testing.assert_close(sliced.double(), ref.grad, atol=1e-6, rtol=1e-5)


def test_cross_entropy_inplace_backward_on_overlapping_logits_raises() -> None:
    # rows that share memory would be clobbered by the gradient written over earlier rows
    v = 10
    buf = torch.randn(4 * v)
    t2, t3 = torch.tensor([0, 3, 5, 1, 9, 2]), torch.tensor([[0, 3, 5], [1, 9, 2]])
    cases = [
        (torch.as_strided(buf, (6, v), (v // 2, 1)), t2),  # each row half over the next
        (buf[:v].expand(6, v), t2),  # one row six times (row stride 0)
        (buf[: 2 * v].view(2, 1, v).expand(2, 3, v), t3),  # (B, T, V), T expanded
        (torch.as_strided(buf, (2, 3, v), (3, 1, 3)), t3),  # interleaved columns and rows
    ]
    for x, t in cases:
        before = buf.clone()
        with pytest.raises(ValueError, match=r"inplace_backward.*logits.*overlapping or inter"):
            flashlite.cross_entropy(x, t, inplace_backward=True)
        with torch.no_grad(), pytest.raises(ValueError, match="overlapping or interleaved"):
            flashlite.cross_entropy(x, t, inplace_backward=True)
        assert torch.equal(buf, before)
        # without inplace_backward the logits are only read: the right loss
        got = flashlite.cross_entropy(x, t, reduction="none")
        want = _F.cross_entropy(x.double().reshape(-1, v), t.reshape(-1), reduction="none")
        torch.testing.assert_close(got.double(), want.view(t.shape), atol=1e-5, rtol=1e-5)
    # strided logits whose elements are distinct are written in place as before
    src = torch.randn(v, 6, requires_grad=True)
    x = (src * 1.0).t()  # (6, V), rows strided by 1
    flashlite.cross_entropy(x, t2, inplace_backward=True).backward()
    ref = src.detach().double().requires_grad_()
    _F.cross_entropy(ref.t(), t2).backward()
    torch.testing.assert_close(src.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)


def test_overlapping_decides_from_sizes_and_strides_and_misses_no_overlap() -> None:
    # every layout of up to three dims (sizes 1-3, strides 0-5) against its addresses: an
    # overlapping one is always refused; the usual distinct ones are not
    import itertools

    from flashlite.ops.common import overlapping

    buf = torch.zeros(64)
    for dims in (1, 2, 3):
        for shape in itertools.product((1, 2, 3), repeat=dims):
            for stride in itertools.product(range(6), repeat=dims):
                t = torch.as_strided(buf, shape, stride)
                addresses = [sum(i * s for i, s in zip(idx, stride, strict=True))
                             for idx in itertools.product(*map(range, shape))]  # fmt: skip
                if len(set(addresses)) < len(addresses):
                    assert overlapping(t), (shape, stride)
    x = torch.zeros(4, 6, 8)
    for t in (x, x.transpose(0, 2), x[:, ::2, 1:], x[..., 0], x[:0], torch.zeros(5).expand(1, 5)):
        assert not overlapping(t), (t.shape, t.stride())
    assert overlapping(torch.zeros(5)[None].expand(2, 5))
