"""Linear cross-entropy's sweep over token chunks (and vocabulary slices), its custom ops and its
autograd: the loss of ``hidden·weightᵀ + bias`` without the ``(N, V)`` logits."""

from __future__ import annotations

import math
from typing import Any

import torch

from flashlite import stats
from flashlite.ops._dispatch import Op, differentiable
from flashlite.ops.cross_entropy.autograd import CE_BWD_INPLACE
from flashlite.ops.cross_entropy.fwd import cross_entropy_bwd, cross_entropy_fwd
from flashlite.ops.cross_entropy.plan import _unit_scale

#: The gradients of hidden, weight and bias (None without one).
_Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

#: Logits bytes one chunk of tokens may hold (the only logits ever materialised).
LINEAR_CHUNK_BYTES = 1 << 28
#: Fewest tokens per chunk before the vocabulary is sliced too (a thinner chunk would starve
#: the products; at 256 MiB that happens past 512k classes in bf16).
LINEAR_MIN_TOKENS = 256


def _linear_chunking(
    v: int, elem_bytes: int, chunk_size: int | None, vocab_chunk_size: int | None
) -> tuple[int, int]:
    """Tokens per chunk and classes per vocabulary slice (0: the whole vocabulary)."""
    fit = LINEAR_CHUNK_BYTES // (v * elem_bytes)  # tokens of whole rows within the budget
    if vocab_chunk_size is None and fit >= LINEAR_MIN_TOKENS:
        return chunk_size or fit, 0
    chunk = chunk_size or LINEAR_MIN_TOKENS
    vocab = vocab_chunk_size or max(1, LINEAR_CHUNK_BYTES // (chunk * elem_bytes))
    return chunk, (vocab if vocab < v else 0)


def _linear_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    scale: torch.Tensor,
    opts: tuple,
    chunk: int,
    with_grads: bool,
    vocab_chunk: int = 0,
    z_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, _Grads | None]:
    """One sweep over token chunks: logits ``h·Wᵀ + b`` of a chunk (tensor cores through
    ``torch.matmul``), the fused kernel writing their gradient over them, then that gradient
    scaled per row by ``scale`` and, ``with_grads``, folded into ``(dh, dW, db)``. With
    ``0 < vocab_chunk < V`` each token chunk's vocabulary is swept in slices instead
    (:func:`_vocab_sweep`). ``z_scale``: a 1-element fp32 factor of the z-loss, on the device
    (:func:`_z_scaled`). Returns the fp32 per-token losses and LSE, and the gradients (or
    None)."""
    n = hidden.shape[0]
    if z_scale is None:
        unit = _unit_scale(hidden.device)
    else:  # (the kernel reads the z-loss's factor after the gradient's scale)
        unit = torch.cat(
            (torch.ones(1, dtype=torch.float32, device=hidden.device), z_scale.reshape(1).float())
        )
    sliced = 0 < vocab_chunk < weight.shape[0]
    if n <= chunk and not sliced:
        # one chunk, the usual case: each result is made by its own product, nothing is
        # accumulated or copied (host time is what a small step waits for)
        logits = hidden @ weight.t()
        if bias is not None:
            logits += bias
        losses, lse = cross_entropy_fwd(logits, target, opts[0], unit, logits, *opts[1:])
        if not with_grads:
            return losses, lse, None
        g = cross_entropy_bwd(logits, logits, scale)  # ∂loss/∂logits
        db = g.sum(0, dtype=torch.float32) if bias is not None else None
        return losses, lse, (g @ weight, g.t() @ hidden, db)
    losses = hidden.new_empty((n,), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    grads = _linear_grads(hidden, weight, bias) if with_grads else None
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        if sliced:
            losses[rows], lse[rows] = _vocab_sweep(
                hidden[rows],
                weight,
                bias,
                target[rows],
                scale[rows],
                opts,
                vocab_chunk,
                grads,
                rows,
                z_scale,
            )
            continue
        h = hidden[rows]
        logits = h @ weight.t()
        if bias is not None:
            logits += bias
        losses[rows], lse[rows] = cross_entropy_fwd(
            logits, target[rows], opts[0], unit, logits, *opts[1:]
        )
        if grads is None:
            continue
        g = cross_entropy_bwd(logits, logits, scale[rows])  # ∂loss/∂logits, these tokens
        dh, dw, db = grads
        torch.matmul(g, weight, out=dh[rows])
        dw.addmm_(g.t(), h)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
    return losses, lse, grads


def _capped_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cols: slice, softcap: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of vocabulary slice ``cols`` (soft-capped), and ``tanh`` of the cap."""
    x = (h @ weight[cols].t()).float()
    if bias is not None:
        x += bias[cols].float()
    if not softcap:
        return x, None
    t = torch.tanh(x / softcap)
    return softcap * t, t


def _vocab_sweep(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    scale: torch.Tensor,
    opts: tuple,
    vocab_chunk: int,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    rows: slice,
    z_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Losses and LSE of one token chunk whose vocabulary is too wide to hold: slices of
    ``vocab_chunk`` classes, each one's ``(m, s)`` pair merged into the row's with
    :func:`flashlite.stats.merge` (with the target's logit and ``Σ w·x``), then, for the
    gradients, a second pass that recomputes each slice's logits and writes ``p − onehot``
    from the finished LSE (:func:`flashlite.stats.torch_probs_from_lse`): the formula of
    :mod:`flashlite.kernels.cross_entropy`, in torch, one slice at a time. Costs one more
    product per slice than a whole-row chunk, so :func:`linear_cross_entropy` takes it only
    when a row of logits is too wide for the chunk budget."""
    class_weight, ignore_index, smoothing, z_loss, softcap = opts
    if z_scale is not None:
        z_loss = z_loss * z_scale.float()  # (1,): broadcast over the rows
    v = weight.shape[0]
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < v)
    tc = target.clamp(0, v - 1)
    if class_weight is not None:
        cw = class_weight.float()
        w_t, wsum = cw[tc], cw.sum()
    else:
        cw, w_t, wsum = None, torch.ones_like(tc, dtype=torch.float32), float(v)
    m = torch.full_like(w_t, -math.inf)
    s = torch.zeros_like(w_t)
    x_t = torch.zeros_like(w_t)
    wx = torch.zeros_like(w_t)
    slices = [slice(c0, min(v, c0 + vocab_chunk)) for c0 in range(0, v, vocab_chunk)]
    for cols in slices:  # pass 1: the pair, merged slice by slice
        x, _ = _capped_logits(h, weight, bias, cols, softcap)
        m, s = stats.merge(m, s, *stats.torch_tile_stats(x))
        inside = (tc >= cols.start) & (tc < cols.stop)
        at = (tc - cols.start).clamp(0, x.shape[1] - 1)[:, None]
        x_t += torch.where(inside, x.gather(1, at)[:, 0], 0.0)
        if smoothing:
            w = cw[cols] if cw is not None else torch.ones_like(x[0])
            wx += (w * torch.where(w != 0, x, 0.0)).sum(1)
    lse = stats.torch_finalize_lse(m, s)
    loss = (1.0 - smoothing) * w_t * (lse - x_t) + z_loss * lse * lse
    if smoothing:
        loss += smoothing / v * (lse * wsum - wx)
    nan = torch.full_like(loss, math.nan)
    loss = torch.where(ignored, 0.0, torch.where(in_range, loss, nan))
    if grads is None:
        return loss, lse
    dh, dw, db = grads
    row_scale = torch.where(ignored, 0.0, torch.where(in_range, scale.float(), nan))[:, None]
    coef = ((1.0 - smoothing) * w_t + smoothing / v * wsum + 2.0 * z_loss * lse)[:, None]
    dh_rows = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for cols in slices:  # pass 2: the gradient of each slice, from the finished LSE
        x, t = _capped_logits(h, weight, bias, cols, softcap)
        g = stats.torch_probs_from_lse(x, lse) * coef
        if smoothing:
            g -= smoothing / v * (cw[cols] if cw is not None else 1.0)
        onehot = torch.arange(cols.start, cols.stop, device=h.device)[None, :] == tc[:, None]
        g -= torch.where(onehot, ((1.0 - smoothing) * w_t)[:, None], 0.0)
        if t is not None:  # d(c·tanh(x/c))/dx = 1 − tanh²
            g *= 1.0 - t * t
        g = torch.where(row_scale == 0, 0.0, g * row_scale).to(h.dtype)
        dh_rows += (g @ weight[cols]).float()
        dw[cols].addmm_(g.t(), h)
        if db is not None:
            db[cols] += g.sum(0, dtype=torch.float32)
    dh[rows] = dh_rows.to(dh.dtype)
    return loss, lse


def _linear_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> _Grads:
    """Fresh ``(dh, dW, db)`` to accumulate into (db in fp32)."""
    db = None
    if bias is not None:
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device)
    return torch.empty_like(hidden), torch.zeros_like(weight), db


def _no_bias(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # (a custom op returns tensors, never None: an empty one stands for "no bias")
    return t if t is not None else like.new_empty((0,), dtype=torch.float32)


def _linear_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk: int,
    vocab_chunk: int,
    with_grads: bool,
    z_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward sweep: per-token losses and LSE, and with ``with_grads`` the gradients of
    hidden, weight and bias for per-token incoming gradients ``scale`` (empty tensors stand for
    the gradients not made); ``z_scale``, a 1-element factor of the z-loss (a weighted mean's,
    :func:`_z_scaled`). The products run in the operands' own dtype, autocast or not (the
    front-end cast them to autocast's; a product autocast cast again would not match the
    gradient buffers)."""
    opts = (class_weight, ignore_index, label_smoothing, z_loss, softcap)
    with torch.autocast(hidden.device.type, enabled=False):
        losses, lse, grads = _linear_chunks(
            hidden, weight, bias, target, scale, opts, chunk, with_grads, vocab_chunk, z_scale
        )
    if grads is None:  # (distinct empty tensors: an op's outputs may not alias)
        return losses, lse, *(hidden.new_empty((0,), dtype=torch.float32) for _ in range(3))
    return losses, lse, grads[0], grads[1], _no_bias(grads[2], hidden)


def _linear_fwd_fake(  # type: ignore[no-untyped-def]
    hidden,
    weight,
    bias,
    target,
    class_weight,
    scale,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk,
    vocab_chunk,
    with_grads,
    z_scale=None,
):
    losses = hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
    if not with_grads:
        return (
            losses,
            torch.empty_like(losses),
            *(hidden.new_empty((0,), dtype=torch.float32) for _ in range(3)),
        )
    return losses, torch.empty_like(losses), *_grads_fake(hidden, weight, bias)


def _grads_fake(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The linear ops' gradient outputs as fakes: dh, dW and the fp32 db (empty: no bias)."""
    db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight), db


def _linear_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    dloss: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk: int,
    vocab_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reduction="none"``'s backward: the sweep again, with each token's incoming gradient."""
    _, _, dh, dw, db = _linear_fwd(
        hidden,
        weight,
        bias,
        target,
        class_weight,
        dloss.float(),
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        chunk,
        vocab_chunk,
        True,
    )
    return dh, dw, db


def _linear_bwd_fake(  # type: ignore[no-untyped-def]
    hidden,
    weight,
    bias,
    target,
    class_weight,
    dloss,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk,
    vocab_chunk,
):
    return _grads_fake(hidden, weight, bias)


#: ``flashlite::linear_cross_entropy_fwd``: the forward sweep (losses, LSE, and with
#: ``with_grads`` the gradients for the given per-token scale).
LINEAR_FWD = Op(
    "linear_cross_entropy_fwd", _linear_fwd, fake=_linear_fwd_fake, inputs=6, moves=False
)
#: ``flashlite::linear_cross_entropy_bwd``: ``reduction="none"``'s second sweep.
LINEAR_BWD = Op(
    "linear_cross_entropy_bwd", _linear_bwd, fake=_linear_bwd_fake, inputs=6, moves=False
)


def _forward(  # type: ignore[no-untyped-def]
    ctx,
    hidden,
    weight,
    bias,
    target,
    class_weight,
    grad_scale,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    reduction,
    chunk,
    vocab_chunk,
):
    # grad_scale: what a unit loss sends each row, worked out by the front-end (a mean's 1/Σ,
    # with the z-loss's factor second when it has its own; else 1)
    n = hidden.shape[0]
    opts = (ignore_index, label_smoothing, z_loss, softcap, chunk, vocab_chunk)
    z_scale = grad_scale[1:] if grad_scale.numel() == 2 else None
    unit = grad_scale[0] if z_scale is not None else grad_scale.reshape(())
    need = any(ctx.needs_input_grad[:3])
    with_grads = need and reduction != "none"
    losses, lse, dh, dw, db = LINEAR_FWD(
        hidden, weight, bias, target, class_weight, unit.expand(n), *opts, with_grads, z_scale
    )
    ctx.mark_non_differentiable(lse)
    ctx.reduction, ctx.opts, ctx.has_bias = reduction, opts, bias is not None
    if with_grads:
        ctx.save_for_backward(dh, dw, db)
    elif need:  # "none": the backward sweeps again
        ctx.save_for_backward(hidden, weight, bias, target, class_weight)
    if reduction == "none":
        return losses, lse
    total = losses.sum()
    return (total * unit if reduction == "mean" else total), lse


def _backward(ctx, dloss, _dlse):  # type: ignore[no-untyped-def]
    if ctx.reduction != "none":  # the forward's gradients, scaled where they lie
        dh, dw, db = ctx.saved_tensors
        # by the kernel that leaves them as they are when dloss is 1 (a plain loss.backward()):
        # dW alone is V·D values, a mul_ read and wrote it all
        CE_BWD_INPLACE(dh, dloss)
        CE_BWD_INPLACE(dw, dloss)
        db = db.mul_(dloss)
        return dh, dw, db.to(dw.dtype) if ctx.has_bias else None, *([None] * 10)
    hidden, weight, bias, target, class_weight = ctx.saved_tensors
    dh, dw, db = LINEAR_BWD(hidden, weight, bias, target, class_weight, dloss, *ctx.opts)
    return dh, dw, db.to(weight.dtype) if ctx.has_bias else None, *([None] * 10)


#: Cross-entropy of ``hidden·weightᵀ + bias`` without the full logits: the gradients of hidden,
#: weight and bias are accumulated in the forward's sweep over token chunks (mean and sum: the
#: backward scales them by the incoming scalar); ``reduction="none"`` needs each token's
#: incoming gradient, so its backward sweeps the chunks again.
LinearCrossEntropyFunction = differentiable("linear_cross_entropy", _forward, _backward)


def _autocast(t: object, dtype: torch.dtype) -> Any:
    """``t`` cast as autocast casts a product's operands: floating tensors but fp64 (which
    autocast leaves alone) to ``dtype``; anything else as it is (the checks judge it)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t
