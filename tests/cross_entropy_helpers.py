"""Shared pieces of the cross-entropy tests: the fp64 reference (torch's cross_entropy plus
the z-loss and the soft cap written out), inputs, and the loss-and-gradient check."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import flashlite

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
