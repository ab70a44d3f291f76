"""The public functions :func:`cross_entropy` and :func:`linear_cross_entropy`."""

from __future__ import annotations

import contextlib

import torch

from flashlite.ops._dispatch import eager_apply, plain_eager
from flashlite.ops.common import check_softcap, moved, moved_call_device
from flashlite.ops.cross_entropy.autograd import CrossEntropyFunction
from flashlite.ops.cross_entropy.checks import (
    _bad_record,
    _check,
    _check_inplace,
    _report_bad_targets,
)
from flashlite.ops.cross_entropy.fwd import (
    _scale_and_check,
    _traced_scale,
    _z_scaled,
    cross_entropy_scale,
)
from flashlite.ops.cross_entropy.linear import (
    LinearCrossEntropyFunction,
    _autocast,
    _linear_chunking,
)
from flashlite.ops.cross_entropy.plan import _unit_scale

_CE_APPLY = eager_apply(CrossEntropyFunction)
#: what :func:`linear_cross_entropy` enters when autocast is off (reusable, reentrant)
_NO_CONTEXT = contextlib.nullcontext()
_LINEAR_APPLY = eager_apply(LinearCrossEntropyFunction)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    inplace_backward: bool = False,
    return_lse: bool = False,
    validate: bool | str = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax cross-entropy with its gradient computed in the same pass (the softmax is never
    stored). The options at length: ``docs/guides/cross-entropy.md``.

    Args:
        logits: ``(N, V)`` or ``(B, T, V)``: classes on the *last* dim (torch's
            ``cross_entropy`` wants them on dim 1). fp16, bf16 or fp32.
        target: ``(N,)`` or ``(B, T)`` class indices (int64 or int32).
        weight: ``(V,)`` per-class weights (torch's ``weight``, its weighted mean included).
        ignore_index: targets equal to it add nothing (any integer, even a valid class).
        reduction: ``"mean"`` (over the non-ignored targets, weighted by ``weight``; NaN when
            all are ignored, as torch), ``"sum"`` or ``"none"``.
        label_smoothing: ε in [0, 1], torch's definition: the target mixes ``1 − ε`` of the
            one-hot with ``ε/V`` everywhere (weighted by ``weight``).
        z_loss: adds ``z_loss·lse²`` to each non-ignored token's loss (PaLM); ``mean`` divides
            it by the number of non-ignored targets, with ``weight`` too (Liger's convention).
        softcap: logits become ``softcap·tanh(logits/softcap)`` first; the loss, z-loss and LSE
            use the capped logits.
        inplace_backward: write the gradient over ``logits`` (no extra memory): from this call
            on they hold it, so nothing else may need them, and their elements must not overlap.
        return_lse: also return the fp32 LSE per token (``target``'s shape; no gradient).
        validate: check that every target is in ``[0, V)`` or ``ignore_index`` (a bad one gives
            a NaN loss and gradient row, never a read outside the tensors). ``True``: on the
            device, no host sync: a *later* call on that GPU raises (on the CPU, this call).
            ``"sync"``: this call raises, after a host sync. ``False``: no check. Skipped
            inside ``torch.compile``.

    Returns:
        The loss in **fp32** whatever the logits' dtype: a scalar for ``mean``/``sum``,
        ``target``'s shape for ``none``; and the LSE with ``return_lse``. One backward per call.

    Raises:
        TypeError: non-tensors, unsupported dtypes, float targets, non-numeric options.
        ValueError: shape or device mismatch, a bad reduction, ``label_smoothing`` outside
            [0, 1], a negative ``z_loss``, a non-positive ``softcap``, ``validate`` not True,
            False or "sync", ``inplace_backward`` on overlapping logits; with ``validate``, a
            bad target (raised by the call ``validate`` says).
    """
    _check(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    opts = _options(
        logits,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        inplace_backward,
        validate,
    )
    dev = moved_call_device(logits.device)
    if dev is not None:  # the whole call on the GPU, CPU tensors' rule kept: a bad one raises
        return _moved_call(dev, logits, target, weight, opts, softcap, return_lse, validate)
    v = logits.shape[-1]
    # (2-D logits and 1-D targets as they are: a reshape would add a view to the autograd graph)
    x2 = logits if logits.dim() == 2 else logits.reshape(-1, v)
    t1 = target if target.dim() == 1 else target.reshape(-1)
    plain = plain_eager(x2, t1, weight)
    # (no scale yet: the forward's own launch works it out, and checks the targets into `bad`)
    grad_scale, bad = _scale_or_record(
        plain, t1, weight, v, ignore_index, reduction, z_loss, validate
    )
    apply = _CE_APPLY if plain else CrossEntropyFunction.apply
    loss, lse = apply(x2, t1, weight, grad_scale, bad, opts)
    if reduction == "none":
        loss = loss.view(target.shape)
    return (loss, lse.view(target.shape)) if return_lse else loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    validate: bool | str = True,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy` of the output layer's logits ``hidden·weightᵀ + bias``, never
    materialising the ``(N, V)`` logits: the tokens are swept in chunks, at most one chunk of
    logits existing at a time (:data:`LINEAR_CHUNK_BYTES`), and the vocabulary in slices too
    where even :data:`LINEAR_MIN_TOKENS` tokens would not fit. Under ``torch.autocast`` the
    products run in autocast's dtype, as ``hidden @ weight.T`` would (the gradients come back
    in the inputs' dtypes). The sweep at length: ``docs/guides/cross-entropy.md``.

    Args:
        hidden: ``(N, H)`` or ``(B, T, H)``.
        weight: ``(V, H)``, the output layer's matrix (class weights are ``class_weight``).
        target: ``(N,)`` or ``(B, T)`` class indices.
        bias: ``(V,)`` or None.
        class_weight: ``(V,)`` per-class weights (torch's ``weight``).
        ignore_index, reduction, label_smoothing, z_loss, softcap, return_lse, validate: as
            :func:`cross_entropy` (``validate=True`` checks in the launch that computes the
            mean's divisor).
        chunk_size: tokens per chunk (default: as many as fit :data:`LINEAR_CHUNK_BYTES`).
        vocab_chunk_size: classes per vocabulary slice (default: the whole vocabulary, unless
            it does not fit the budget as said above).

    Returns:
        The fp32 loss (and the LSE per token), as :func:`cross_entropy`.

    Raises:
        TypeError, ValueError: as :func:`cross_entropy`; also hidden and weight that disagree
            on H or dtype, a bias that is not ``(V,)``, a chunk size that is not an int >= 1.
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device_type = hidden.device.type  # (other devices fail the checks below)
    autocast_off = _NO_CONTEXT
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        # as torch.matmul under autocast: the products in autocast's dtype (differentiable
        # casts: the gradients come back in the leaves' dtypes), the loss fp32; the sweep then
        # runs with autocast off, so that its products and its buffers agree on one dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (_autocast(t, dtype) for t in (hidden, weight, bias))
        autocast_off = torch.autocast(device_type, enabled=False)
    with autocast_off:
        return _linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            class_weight,
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            softcap,
            return_lse,
            validate,
            chunk_size,
            vocab_chunk_size,
        )


def _linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    return_lse: bool,
    validate: bool | str,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_cross_entropy` once its tensors are cast for autocast (autocast off): the
    checks, the move of CPU tensors to where kernels run, the sweep."""
    _check_linear(hidden, weight, bias, validate, chunk_size, vocab_chunk_size)
    v = weight.shape[0]
    fake = hidden.new_empty((1,) * hidden.dim()).expand(*hidden.shape[:-1], v)  # (no storage)
    _check(fake, target, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    dev = moved_call_device(hidden.device)
    if dev is not None:  # the whole call on the GPU, CPU tensors' rule kept: a bad one raises
        out = linear_cross_entropy(
            hidden.to(dev),
            weight.to(dev),
            target.to(dev),
            bias=moved(bias, dev),
            class_weight=moved(class_weight, dev),
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            return_lse=return_lse,
            validate="sync" if validate else False,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
        )
        return moved(out, hidden.device)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    plain = plain_eager(h2, t1, weight, bias, class_weight)
    grad_scale, bad = _scale_or_record(
        plain, t1, class_weight, v, ignore_index, reduction, z_loss, validate
    )
    if grad_scale is None:  # the scale kernel, the device check in its launch
        mean = reduction == "mean"
        grad_scale = (
            cross_entropy_scale(
                t1, class_weight, v, ignore_index, mean, bad, _z_scaled(class_weight, mean, z_loss)
            )
            if mean or bad is not None
            else _unit_scale(t1.device)
        )
    chunk, vocab_chunk = _linear_chunking(v, hidden.element_size(), chunk_size, vocab_chunk_size)
    apply = _LINEAR_APPLY if plain else LinearCrossEntropyFunction.apply
    loss, lse = apply(
        h2,
        weight,
        bias,
        t1,
        class_weight,
        grad_scale,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        check_softcap(softcap),
        reduction,
        chunk,
        vocab_chunk,
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    return (loss, lse.view(target.shape)) if return_lse else loss


def _moved_call(
    dev: torch.device,
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    opts: tuple,
    softcap: float | None,
    return_lse: bool,
    validate: bool | str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy` of CPU tensors in a process whose kernels run on the GPU ``dev``:
    the whole call there, and a bad target raised by this call (``validate="sync"``). ``opts``
    as :func:`_options` gives them, but the cap as the caller gave it (the kernels' 0.0 for no
    cap is not a cap the public call takes)."""
    ignore_index, label_smoothing, z_loss, _, inplace_backward, reduction = opts
    out = cross_entropy(
        logits.to(dev),
        target.to(dev),
        moved(weight, dev),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        inplace_backward=inplace_backward,
        return_lse=return_lse,
        validate="sync" if validate else False,
    )
    return moved(out, logits.device)


def _check_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    validate: bool | str,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
) -> None:
    """:func:`linear_cross_entropy`'s own arguments (the loss's are :func:`_check`'s)."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.dim() not in (2, 3):
        raise ValueError(
            f"hidden (N, H) or (B, T, H) and weight (V, H) must agree on H, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ValueError(f"bias must be a ({weight.shape[0]},) tensor")
    if not (isinstance(validate, bool) or validate == "sync"):
        raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {size!r}")


def _options(
    logits: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    inplace_backward: bool,
    validate: bool | str,
) -> tuple:
    """:func:`cross_entropy`'s options as :class:`CrossEntropyFunction` takes them, after the
    checks of its own flags (the loss's are :func:`_check`'s). Before a move: a refused call
    copies nothing."""
    if not (isinstance(validate, bool) or validate == "sync"):
        raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
    if inplace_backward:
        _check_inplace(logits)
    opts = (float(label_smoothing), float(z_loss), check_softcap(softcap), bool(inplace_backward))
    return (ignore_index, *opts, reduction)


_Maybe = torch.Tensor | None


def _scale_or_record(
    plain: bool,
    t1: torch.Tensor,
    weight: _Maybe,
    v: int,
    ignore_index: int,
    reduction: str,
    z_loss: float,
    validate: bool | str,
) -> tuple[_Maybe, _Maybe]:
    """``(gradient scale, bad-target record)`` of a cross-entropy call before its forward, the
    targets checked as ``validate`` says. The scale is a mean's ``1/Σ`` (else 1; with the
    z-loss's own factor second where :func:`_z_scaled`). Traced calls (``plain`` False: not
    :func:`plain_eager`): the scale from torch ops, no check (no host read). ``"sync"`` and CPU
    tensors: the scale with the check, waited for (a bad target raises here). ``True`` on a
    GPU: no scale yet, and the device's record for the launch that works it out to check into
    (reported by a later call). ``False``: neither."""
    mean = reduction == "mean"
    z = _z_scaled(weight, mean, z_loss)
    if not plain:
        return _traced_scale(t1, weight, v, ignore_index, mean, z), None
    if validate == "sync" or (validate and t1.device.type == "cpu"):
        return _scale_and_check(t1, weight, v, ignore_index, mean, z), None
    if validate:
        _report_bad_targets(t1.device, False, ignore_index, earlier=True)
        return None, _bad_record(t1.device)[0]
    return None, None
