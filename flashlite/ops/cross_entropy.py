"""Fused softmax cross-entropy: validation, views, launch, custom ops and autograd.

The kernel (:mod:`flashlite.kernels.cross_entropy`) computes each row's loss and LSE and writes
its gradient in the same pass, so the softmax is never stored; the backward only rescales that
gradient when the incoming one is not what a unit loss sends. ``flashlite::cross_entropy_fwd``
writes the gradient into a buffer of its own (one logits-sized buffer of extra memory);
``flashlite::cross_entropy_fwd_inplace`` writes it over the logits (none). Both are
``torch.library`` custom ops with fakes that declare what they write; the autograd formula lives
in a ``torch.autograd.Function`` around them, and ``torch.compile(fullgraph=True)`` traces
:func:`cross_entropy`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from flashlite import _backend, stats
from flashlite.kernels import cross_entropy as K
from flashlite.kernels import cross_entropy_gluon as KG
from flashlite.kernels.configs import cdiv
from flashlite.ops.common import (
    check_softcap,
    moved,
    moved_call_device,
    on_compute_device,
    overlapping,
    plain_eager,
    skip_dispatcher,
)
from flashlite.ops.softmax import prefetch_applies, prefetch_plan, prefetch_words

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("none", "mean", "sum")
_INT32_LIMIT = 2**31
#: Columns per tile, and tiles per program, of the backward's scaling kernel (a row's tiles in
#: one program), and its most programs along the rows (each loops over rows: a skipped incoming
#: gradient costs one program, not one per row: 11-16 us -> a few at 8192 rows on the H200).
BWD_BLOCK = 4096
BWD_TILES = 16
BWD_PROGRAMS = 1024


# ----------------------------------------------------------------------------- launchers
#: Planned launches (kernel, launch options, grid, Triton's argument binding), per everything
#: they depend on but the tensors' addresses: a training loop's repeated calls skip the
#: planning, which cost more host time than the launch itself (``_backend.Launcher.bind``).
#: Fresh buffers (losses, LSE, the words) come from torch's allocator, 512-byte aligned. The
#: kernels' module constants (tile sizes) are taken as fixed: a test that patches them starts
#: an empty cache.
_plans: dict[tuple, Callable[..., None]] = {}
_PLAN_LIMIT = 1024


def _aligned(*tensors: torch.Tensor | None) -> bool | tuple[bool, ...]:
    """True when every tensor starts on 16 bytes (the usual case, one test), else each one's."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    if bits % 16 == 0:
        return True
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _planned(key: tuple, plan: Callable[[], Callable[..., None]]) -> Callable[..., None]:
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= _PLAN_LIMIT:
            _plans.clear()
        found = _plans[key] = plan()
    return found


def _gluon_applies(logits: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor,
                   softcap: float) -> bool:  # fmt: skip
    """Whether the Gluon prefetching team takes these logits: long plain rows (no class
    weights, no soft cap) on a GPU that runs it."""
    return (weight is None and not softcap and logits.shape[1] >= KG.MIN_COLS
            and prefetch_applies(logits, grad))  # fmt: skip


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    grad: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on ``(N, V)`` logits (any strides), ``(N,)`` targets: returns
    the fp32 per-row losses and LSE ``(N,)`` and writes the per-row gradient, times the fp32
    1-element ``grad_scale``, into ``grad`` ``(N, V)`` (which may be ``logits``); a 2-element
    ``grad_scale`` also scales the z-loss by its second element (:func:`_z_scaled`). No checks.
    (:func:`cross_entropy_fwd_eager` with the scale given, nothing checked, nothing reduced.)"""
    losses, lse, _ = cross_entropy_fwd_eager(logits, target, weight, grad, grad_scale, None,
                                             "none", ignore_index, label_smoothing, z_loss,
                                             softcap)  # fmt: skip
    return losses, lse


def _plan_triton_fwd(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                     grad_scale: torch.Tensor, grad: torch.Tensor,
                     opts: tuple[int, float, float, float],
                     z_scale: bool = False) -> Callable[..., None]:  # fmt: skip
    """The Triton kernel's ``run(logits, target, weight, grad_scale, grad, losses, lse)``;
    ``z_scale``: ``grad_scale`` holds the z-loss's scale too (:func:`_z_scaled`)."""
    ignore_index, label_smoothing, z_loss, softcap = opts
    n, v = logits.shape
    col64 = any((v - 1) * abs(t.stride(1)) >= _INT32_LIMIT for t in (logits, grad))
    rest = (v, *logits.stride(), *grad.stride(), ignore_index, label_smoothing, z_loss, softcap)
    options = dict(HAS_WEIGHT=weight is not None, SOFTCAP=softcap > 0, SMOOTH=label_smoothing > 0,
                   COL_INT64=col64, ROUND_BF16=_backend.round_bf16(logits.dtype), num_stages=1,
                   Z_SCALE=z_scale, **K.ce_config(v))  # fmt: skip
    stand_in = grad_scale  # (for the weights and their sum when there are none: never read)
    bound = _backend.launcher(K._cross_entropy_fwd_kernel).bind(
        (logits, target, weight if weight is not None else stand_in, stand_in, grad_scale, grad,
         stand_in, stand_in, *rest), options)  # fmt: skip

    def run(logits, target, weight, grad_scale, grad, losses, lse) -> None:  # noqa: ANN001
        if weight is None:
            weight = wsum = losses
        else:  # Σ w on the device: no host sync for it
            wsum = weight.float().sum().reshape(1)
        bound((n, 1, 1), logits, target, weight, wsum, grad_scale, grad, losses, lse, *rest)

    return run


def _plan_prefetch(logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor,
                   opts: tuple[int, float, float, float],
                   mode: tuple[bool, bool, int]) -> Callable[..., None]:  # fmt: skip
    """Long rows without class weights or a soft cap, on a GPU with Gluon: the prefetching
    team kernel (:mod:`flashlite.kernels.cross_entropy_gluon`), logits read once.
    ``mode = (count, check, reduce)``: the mean's divisor counted in the kernel (``grad_scale``
    unread), bad targets recorded in ``bad``, the losses summed into ``out`` (``reduce`` 1)
    or averaged (2: the sum times the gradient scale, counted or given). Returns
    ``launch(logits, target, grad_scale, grad, losses, lse, bad, out)``."""
    ignore_index, label_smoothing, z_loss, _ = opts
    count, check, reduce = mode
    n, v = logits.shape
    smooth = label_smoothing > 0
    # per (row, chunk): the (m, s) word, and with smoothing a Σx word; then two control words
    options, n_chunks, size = prefetch_plan(logits, 2 if smooth else 1, control=2)
    device = logits.device
    vec = options["VEC"]  # lengths and strides in 16-byte vectors (prefetch_applies checked)
    rest = (n, v, v // vec, logits.stride(0) // vec, grad.stride(0) // vec, n_chunks,
            ignore_index, label_smoothing, z_loss)  # fmt: skip
    # (stand-ins for the binding, which reads only their dtypes and alignment)
    f32, i64 = torch.empty(1, device=device), torch.empty(1, device=device, dtype=torch.int64)
    launch = _backend.bind_teams(
        KG._cross_entropy_prefetch_kernel,
        [logits, target, f32, grad, f32, f32, i64, i64, i64, f32, *rest],
        {"SMOOTH": smooth, "COUNT": count, "CHECK": check, "REDUCE": reduce,
         "EVEN": v % options["CHUNK"] == 0, **options},
        n_chunks, n, device,
    )  # fmt: skip

    def run(logits, target, grad_scale, grad, losses, lse, bad, out) -> None:  # noqa: ANN001
        words = prefetch_words(size, device)  # (the control words: no program in, none done)
        if bad is None:
            seen = bad = words
        else:
            seen = _host_flag(bad)
        launch(logits, target, losses if grad_scale is None else grad_scale, grad, losses, lse,
               words, seen, bad, losses if out is None else out, *rest)  # fmt: skip

    return run


@on_compute_device
def cross_entropy_fwd_eager(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    bad: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An eager call's whole forward: :func:`cross_entropy_fwd` with the gradient scale
    worked out here unless given (``1/Σ`` of the kept targets' weights for a ``mean``, else 1;
    with the z-loss's scale too where :func:`_z_scaled`),
    bad targets recorded in ``bad`` (:func:`cross_entropy_scale`), and the loss reduced: returns
    the per-row losses, the LSE and the fp32 0-dim loss (None for ``"none"``). On the Gluon
    path all of it is one launch (the host time before the kernel starts is what a host-bound
    step waits for); otherwise the scale kernel, the forward kernel and a torch sum."""
    n, v = logits.shape
    mean = reduction == "mean"
    if n == 0:
        losses = logits.new_empty((0,), dtype=torch.float32)
        nothing = math.nan if mean else 0.0
        return losses, torch.empty_like(losses), None if reduction == "none" else (
            losses.new_full((), nothing))  # fmt: skip
    opts = (ignore_index, float(label_smoothing), float(z_loss), float(softcap))
    key = ("eager", logits.device, logits.dtype, grad.dtype, target.dtype, n, v, logits.stride(),
           grad.stride(), None if weight is None else weight.dtype, reduction,
           None if grad_scale is None else grad_scale.numel(), bad is None,
           _aligned(logits, target, weight, grad_scale, grad, bad), *opts)  # fmt: skip
    run = _planned(key, lambda: _plan_eager(logits, target, weight, grad, grad_scale, bad,
                                            reduction, opts))  # fmt: skip
    return run(logits, target, weight, grad, grad_scale, bad)


#: :func:`cross_entropy_fwd_eager` for a front-end that moved its call to the compute device
_fwd_eager_here = cross_entropy_fwd_eager.__wrapped__  # type: ignore[attr-defined]


def _plan_eager(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                grad: torch.Tensor, grad_scale: torch.Tensor | None, bad: torch.Tensor | None,
                reduction: str, opts: tuple[int, float, float, float],
                ) -> Callable[..., Any]:  # fmt: skip
    """``run(logits, target, weight, grad, grad_scale, bad)`` for :func:`cross_entropy_fwd_eager`
    calls like this one."""
    n, v = logits.shape
    mean, reduce = reduction == "mean", reduction != "none"
    device = logits.device
    if _gluon_applies(logits, weight, grad, opts[3]):
        count = mean and grad_scale is None
        # a mean's sum is scaled in the kernel whether it counted the divisor or was given it
        mode = (count, bad is not None, 2 if mean else int(reduce))
        launch = _plan_prefetch(logits, target, grad, opts, mode)

        def fused(logits, target, weight, grad, grad_scale, bad):  # noqa: ANN001, ANN202
            losses = logits.new_empty((n,), dtype=torch.float32)
            lse = logits.new_empty((n,), dtype=torch.float32)
            out = losses.new_empty(()) if reduce else None
            if grad_scale is None and not count:
                grad_scale = _unit_scale(device)
            launch(logits, target, grad_scale, grad, losses, lse, bad, out)
            return losses, lse, out

        return fused
    unit = _unit_scale(device)
    given = grad_scale is not None
    z_scale = grad_scale.numel() == 2 if given else _z_scaled(weight, mean, opts[2])
    fwd = _plan_triton_fwd(logits, target, weight, unit, grad, opts, z_scale)

    def apart(logits, target, weight, grad, grad_scale, bad):  # noqa: ANN001, ANN202
        if grad_scale is None:
            grad_scale = unit
            if mean or bad is not None:
                grad_scale = cross_entropy_scale(target, weight, v, opts[0], mean, bad,
                                                 z_scale)  # fmt: skip
        losses = logits.new_empty((n,), dtype=torch.float32)
        lse = logits.new_empty((n,), dtype=torch.float32)
        fwd(logits, target, weight, grad_scale, grad, losses, lse)
        return losses, lse, _reduced(losses, grad_scale, reduction)

    return apart


def _reduced(losses: torch.Tensor, grad_scale: torch.Tensor, reduction: str) -> torch.Tensor | None:
    """The loss of the per-row ``losses`` in torch ops (None for ``"none"``): their sum, times
    ``grad_scale`` (``1/Σ``, the scale the gradient was stored with) for a mean."""
    if reduction == "none":
        return None
    total = losses.sum()
    if reduction != "mean":
        return total
    return total * (grad_scale if grad_scale.numel() == 1 else grad_scale[0])


@on_compute_device
def cross_entropy_bwd(grad: torch.Tensor, out: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """``out = grad·dloss``: the stored ``(N, V)`` gradient of a unit loss times the incoming
    gradient, one scalar (a mean or a sum) or one per row ``(N,)`` (any stride). With ``out`` =
    ``grad``, rows whose incoming gradient is exactly 1 are left as they are (no bytes moved).
    Returns ``out``."""
    n, v = grad.shape
    if n == 0:
        return out
    d = dloss if dloss.dim() <= 1 else dloss.reshape(-1)  # (a 0-dim one is read as a pointer)
    if d.dtype != torch.float32:
        d = d.float()
    stride_l = d.stride(0) if d.numel() > 1 else 0
    skip = out.data_ptr() == grad.data_ptr()
    key = ("bwd", grad.device, grad.dtype, out.dtype, n, v, grad.stride(), out.stride(), stride_l,
           skip, _aligned(grad, out, d))  # fmt: skip
    _planned(key, lambda: _plan_bwd(grad, out, d, stride_l, skip))(grad, out, d)
    return out


#: :func:`cross_entropy_bwd` for tensors already on the compute device (the autograd backward)
_bwd_here = cross_entropy_bwd.__wrapped__  # type: ignore[attr-defined]


def _plan_bwd(grad: torch.Tensor, out: torch.Tensor, d: torch.Tensor, stride_l: int,
              skip: bool) -> Callable[..., None]:  # fmt: skip
    n, v = grad.shape
    block = min(BWD_BLOCK, 1 << max(4, (v - 1).bit_length()))
    tiles = min(BWD_TILES, cdiv(v, block))
    col64 = (v - 1) * max(abs(grad.stride(1)), abs(out.stride(1))) >= _INT32_LIMIT
    rest = (n, v, *grad.stride(), *out.stride(), stride_l)
    bound = _backend.launcher(K._cross_entropy_bwd_kernel).bind(
        (grad, out, d, *rest),
        dict(SCALAR=d.numel() == 1, SKIP_UNIT=skip, BLOCK_N=block, TILES=tiles, COL_INT64=col64,
             ROUND_BF16=_backend.round_bf16(grad.dtype), num_warps=4, num_stages=1),
    )  # fmt: skip
    grid = (min(n, BWD_PROGRAMS), cdiv(v, block * tiles), 1)
    return lambda grad, out, d: bound(grid, grad, out, d, *rest)


@on_compute_device
def cross_entropy_scale(
    target: torch.Tensor,
    weight: torch.Tensor | None,
    n_classes: int,
    ignore_index: int,
    mean: bool,
    bad: torch.Tensor | None,
    z_scale: bool = False,
) -> torch.Tensor:
    """The fp32 0-dim gradient scale a unit loss sends each row (``1/Σ`` of the kept targets'
    weights for a mean, NaN when none is kept; else 1), from the ``(N,)`` targets in one launch;
    with ``bad`` (int64 ``(3,)`` on the compute device), the first target outside
    ``[0, V)`` that is not ``ignore_index`` is recorded there as ``(1, class, V)``, unless one
    is recorded already (and, for a device's record, flagged in its host flag). With
    ``z_scale`` (a weighted mean with z-loss, :func:`_z_scaled`): ``(2,)``, that scale and the
    z-loss's, ``Σ w / count`` of the kept targets (0 when none is kept)."""
    scale = target.new_empty((2,) if z_scale else (), dtype=torch.float32)
    n = target.shape[0]
    if n == 0:  # (a mean of nothing is NaN; nothing to check)
        scale.fill_(math.nan if mean else 1.0)
        if z_scale:
            scale[1] = 0.0
        return scale
    weight = weight if weight is not None else scale  # (stand-ins: never read)
    seen = _host_flag(bad) if bad is not None else scale
    bad = bad if bad is not None else scale
    rest = (n, n_classes, ignore_index)
    key = ("scale", target.device, target.dtype, weight.dtype, *rest, mean, bad is not scale,
           weight is not scale, z_scale, _aligned(target, weight, bad))  # fmt: skip

    def plan() -> Callable[..., None]:
        options = dict(MEAN=mean, HAS_WEIGHT=weight is not scale, CHECK=bad is not scale,
                       BLOCK=K.SCALE_BLOCK, Z_SCALE=z_scale, num_warps=4)  # fmt: skip
        bound = _backend.launcher(K._cross_entropy_scale_kernel).bind(
            (target, weight, scale, bad, bad, *rest), options)  # fmt: skip
        return lambda *a: bound((1, 1, 1), *a, *rest)

    _planned(key, plan)(target, weight, scale, seen, bad)
    return scale


# ----------------------------------------------------------------------------- target checks
#: Per compute device, where the kernels record a bad target: ``(flag, class, V)`` in the
#: device's memory, kept until reported, and a host flag the recording kernel also sets (pinned
#: host memory on a GPU, which a kernel writes directly: no copy launched per call, the host
#: reads it without waiting; the same tensor on the CPU).
_bad_records: dict[torch.device, tuple[torch.Tensor, torch.Tensor, Any]] = {}


def _bad_record(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(flag, host flag, the host flag as a numpy array)`` (numpy: a read costs no torch op)."""
    found = _bad_records.get(device)
    if found is None:
        flag = torch.zeros(3, dtype=torch.int64, device=device)
        host = torch.zeros(1, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else flag
        found = _bad_records[device] = (flag, host, host.numpy())
    return found


def _host_flag(bad: torch.Tensor) -> torch.Tensor:
    """What a kernel that records a bad target in ``bad`` sets to 1 as well: the host flag of a
    device's record, or ``bad`` itself (any other record: its own flag)."""
    found = _bad_records.get(bad.device)
    return found[1] if found is not None and found[0] is bad else bad


def _report_bad_targets(device: torch.device, wait: bool, ignore_index: int,
                        earlier: bool) -> None:  # fmt: skip
    """Raise the ``ValueError`` for a bad target recorded on ``device``: with ``wait`` once the
    device has finished, else only what the host flag already shows (nothing is waited for
    unless there is one). ``earlier``: the record can only be an earlier call's (this call's
    check is not launched yet), and the message says so."""
    found = _bad_records.get(device)
    if found is None:
        return
    flag, host, host_view = found
    if not wait and not host_view[0]:  # (pinned memory: read without a sync)
        return
    record = flag.tolist()  # the whole record, once the device is done (a sync on a GPU)
    if not record[0]:
        return
    flag.zero_()
    host.zero_()
    _, cls, v = record
    if not earlier:
        raise ValueError(f"target holds class {cls}, outside [0, {v}) and not "
                         f"ignore_index={ignore_index}")  # fmt: skip
    raise ValueError(
        f"an earlier flashlite.cross_entropy call on {device} had a target of class {cls}, "
        f"outside [0, {v}) and not its ignore_index: that call's loss and gradient rows are "
        "NaN. Targets are checked on the device without waiting for it, and a bad one is "
        "reported by a later call; validate='sync' reports it at the call itself"
    )


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("flashlite::cross_entropy_fwd", mutates_args=("grad",))
def _ce_fwd_op(
    logits: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(logits, target, weight, grad_scale, grad, ignore_index,
                             label_smoothing, z_loss, softcap)  # fmt: skip


def _row_stats_fake(logits: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Both forward ops' fake: fp32 per-row losses and LSE."""
    return tuple(logits.new_empty((logits.shape[0],), dtype=torch.float32) for _ in range(2))  # type: ignore[return-value]


_ce_fwd_op.register_fake(_row_stats_fake)


@torch.library.custom_op("flashlite::cross_entropy_fwd_inplace", mutates_args=("logits",))
def _ce_fwd_inplace_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_fwd(logits, target, weight, grad_scale, logits, ignore_index,
                             label_smoothing, z_loss, softcap)  # fmt: skip


_ce_fwd_inplace_op.register_fake(_row_stats_fake)


@torch.library.custom_op("flashlite::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    return cross_entropy_bwd(grad, torch.empty_like(grad), dloss)


@_ce_bwd_op.register_fake
def _(grad, dloss):  # type: ignore[no-untyped-def]
    return torch.empty_like(grad)


class _CrossEntropy(torch.autograd.Function):
    """The forward writes the gradient of the returned (reduced) loss into a buffer of its own
    or, with ``inplace``, over the logits; the backward scales it there by the incoming
    gradient, if that is not 1, and hands it over as the logits' gradient. The reduction
    happens inside, so ``loss.backward()`` meets one node, not three. The ops that write the
    gradient declare the mutation, and a mutating custom op cannot carry an autograd formula,
    so the autograd side lives here. The in-place write goes through a detached alias, which
    shares the logits' version counter: a node that saved the logits for its own backward
    raises torch's "modified by an inplace operation" error instead of reading gradients."""

    @staticmethod
    def forward(ctx, logits, target, weight, grad_scale, opts):  # type: ignore[no-untyped-def, override]
        # (the options in one tuple: autograd's per-argument handling costs host time)
        ignore_index, label_smoothing, z_loss, softcap, inplace, reduction, grad, done = opts
        if done is not None:  # a plain eager call: the front-end launched the ops' bodies
            losses, lse, total = done
            if inplace:  # what the op's declared mutation would do
                torch.autograd.graph.increment_version(grad)
        else:
            kernel_opts = (ignore_index, label_smoothing, z_loss, softcap)
            grad = _grad_buffer(logits, inplace)
            if inplace:
                losses, lse = torch.ops.flashlite.cross_entropy_fwd_inplace.default(
                    grad, target, weight, grad_scale, *kernel_opts)  # fmt: skip
            else:
                losses, lse = torch.ops.flashlite.cross_entropy_fwd.default(
                    logits, grad, target, weight, grad_scale, *kernel_opts)  # fmt: skip
            total = _reduced(losses, grad_scale, reduction)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(grad)
        ctx.used = False
        return (losses if reduction == "none" else total), lse

    @staticmethod
    def backward(ctx, dloss, _dlse):  # type: ignore[no-untyped-def, override]
        if ctx.used:
            raise RuntimeError(
                "flashlite.cross_entropy's backward runs once: its gradient buffer is handed to "
                "the logits' gradient; run the forward again to differentiate again"
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        if skip_dispatcher(grad, dloss):  # eager: scaled where it is, and only if needed
            _bwd_here(grad, grad, dloss)  # (on the compute device: the front-end moved the call)
        else:  # traced (compile, AOT, fake tensors): the functional op, a new buffer
            grad = torch.ops.flashlite.cross_entropy_bwd.default(grad, dloss)
        return grad, None, None, None, None


def _grad_buffer(logits: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where the forward writes the gradient: a buffer of its own, or with ``inplace`` the
    logits through a detached alias (it shares their version counter)."""
    return logits.detach() if inplace else torch.empty_like(logits)


# ----------------------------------------------------------------------------- front-end
def _check(
    logits: object,
    target: object,
    weight: object,
    ignore_index: object,
    reduction: object,
    label_smoothing: object,
    z_loss: object,
    softcap: object,
) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in DTYPES:
        raise TypeError(f"logits has dtype {logits.dtype}; flashlite.cross_entropy accepts "
                        "torch.float16, torch.bfloat16 and torch.float32")  # fmt: skip
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold class indices (torch.int64 or torch.int32), got "
                        f"{target.dtype} (class probabilities are not supported)")  # fmt: skip
    if logits.dim() not in (2, 3) or target.shape != logits.shape[:-1]:
        raise ValueError(f"logits (N, V) or (B, T, V) need target (N,) or (B, T): got logits "
                         f"{tuple(logits.shape)} and target {tuple(target.shape)}")  # fmt: skip
    if logits.shape[-1] == 0:
        raise ValueError("logits must have at least one class (V >= 1)")
    if target.device != logits.device:
        raise ValueError(f"target must be on logits' device {logits.device}, got {target.device}")
    _backend.check_device(logits, "logits")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a float tensor, got {type(weight).__name__}")
        if weight.shape != (logits.shape[-1],) or weight.device != logits.device:
            raise ValueError(f"weight must be ({logits.shape[-1]},) on {logits.device}, got "
                             f"{tuple(weight.shape)} on {weight.device}")  # fmt: skip
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {value!r}")
    if not 0.0 <= label_smoothing <= 1.0:  # type: ignore[operator]
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:  # type: ignore[operator]
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    check_softcap(softcap)


def _scale_and_check(target: torch.Tensor, weight: torch.Tensor | None, n_classes: int,
                     ignore_index: int, mean: bool, z_scale: bool = False,
                     ) -> torch.Tensor:  # fmt: skip
    """The gradient scale (:func:`cross_entropy_scale`) with the targets checked in the same
    launch, waited for: a bad target raises here (``validate="sync"``, CPU tensors and linear
    cross-entropy). A bad target an earlier call recorded is reported first, as that call's."""
    device = _backend.compute_device(target.device)
    _report_bad_targets(device, True, ignore_index, earlier=True)
    scale = cross_entropy_scale(target, weight, n_classes, ignore_index, mean,
                                _bad_record(device)[0], z_scale)  # fmt: skip
    _report_bad_targets(device, True, ignore_index, earlier=False)
    return scale


_unit_scales: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 one on ``device``, kept (the kernels only read it)."""
    found = _unit_scales.get(device)
    if found is None:
        found = _unit_scales[device] = torch.ones((), dtype=torch.float32, device=device)
    return found


def _traced_scale(target: torch.Tensor, weight: torch.Tensor | None, n_classes: int,
                  ignore_index: int, mean: bool, z_scale: bool = False,
                  ) -> torch.Tensor:  # fmt: skip
    """:func:`cross_entropy_scale` without the check, in torch ops (what a trace can hold): the
    incoming gradient a unit loss sends each row, ``1/Σ`` of the kept targets' weights for a
    mean (torch's weighted mean), else 1; with ``z_scale``, and the z-loss's scale."""
    if not mean:
        return torch.ones((), dtype=torch.float32, device=target.device)
    denom = _mean_divisor(target, weight, n_classes, ignore_index)
    if not z_scale:
        return 1.0 / denom
    return torch.stack((1.0 / denom, _z_ratio(target, denom, ignore_index)))


def _z_scaled(weight: torch.Tensor | None, mean: bool, z_loss: float) -> bool:
    """Whether the z-loss needs a scale of its own: a mean divides the cross-entropy by the kept
    targets' class weights (torch's weighted mean) but the z-loss by their count (it bounds each
    row's LSE, whatever the target's class: Liger's convention, PaLM's definition); the kernel
    adds ``z·r·lse²`` to a row, ``r = Σ w / count`` (:func:`_z_ratio`), so that dividing the
    rows' sum by ``Σ w`` gives both. Without class weights the two divisors are one."""
    return weight is not None and mean and z_loss > 0


def _z_ratio(target: torch.Tensor, denom: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``r = Σ w / count`` of the kept targets from the mean's divisor ``denom = Σ w``, in torch
    ops; 0 when none is kept (their rows' gradients stay 0, not 0/0)."""
    count = (target != ignore_index).sum(dtype=torch.float32)
    return torch.where(count > 0, denom / count.clamp(min=1.0), 0.0)


def _mean_divisor(target: torch.Tensor, weight: torch.Tensor | None, n_classes: int,
                  ignore_index: int) -> torch.Tensor:  # fmt: skip
    """torch's divisor of a mean, in torch ops: the kept targets' count, or the sum of their
    class weights (a bad target's weight read at a clamped class: its row is NaN anyway)."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum(dtype=torch.float32)
    return torch.where(kept, weight.float()[target.clamp(0, n_classes - 1)], 0.0).sum()


def _check_inplace(logits: torch.Tensor) -> None:
    """Refuse logits that ``inplace_backward`` must not overwrite: a leaf that requires grad (or
    a view of one), which torch forbids to modify in place while grad mode is on (the leaf would
    hold its own gradient), and memory whose elements overlap (writing one row's gradient would
    clobber rows still to be read)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        base = logits if logits.is_leaf else logits._base
        if base is not None and base.is_leaf:
            what = "a leaf tensor" if base is logits else "a view of a leaf tensor"
            raise ValueError(
                f"inplace_backward=True would overwrite logits, {what} that requires grad, with "
                "its gradient (torch forbids in-place writes to such a leaf); pass a non-leaf "
                "(e.g. the output layer's output, as it comes) or use inplace_backward=False"
            )
    if overlapping(logits):
        raise ValueError(
            f"inplace_backward=True needs logits whose elements do not share memory, got "
            f"overlapping or interleaved strides {logits.stride()} for shape "
            f"{tuple(logits.shape)} (the gradient written over one row would clobber others "
            "still to be read); pass logits.contiguous() or use inplace_backward=False"
        )


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
    stored).

    Args:
        logits: ``(N, V)`` or ``(B, T, V)``: classes on the *last* dim (the language-model
            layout; torch's ``cross_entropy`` wants them on dim 1). fp16, bf16 or fp32.
        target: ``(N,)`` or ``(B, T)`` class indices (int64 or int32).
        weight: ``(V,)`` per-class weights (torch's ``weight``, its weighted mean included).
        ignore_index: targets equal to it add nothing (any integer, even a valid class).
        reduction: ``"mean"`` (over the non-ignored targets, weighted by ``weight``: torch's
            rule, NaN when every target is ignored), ``"sum"`` or ``"none"``.
        label_smoothing: ε in [0, 1], as torch defines it: the target mixes ``1 − ε`` of the
            one-hot with ``ε/V`` everywhere (weighted by ``weight``).
        z_loss: adds ``z_loss·lse²`` to each non-ignored token's loss (PaLM). A ``mean``
            divides the z-loss by the number of non-ignored targets, also with ``weight``
            (it bounds each row's LSE, whatever the target's class: Liger's convention).
        softcap: logits become ``softcap·tanh(logits/softcap)`` first; the loss, z-loss and LSE
            use the capped logits.
        inplace_backward: write the gradient over ``logits`` (no extra memory; Liger's trick).
            ``logits`` must then be a non-leaf tensor (or need no gradient) that nothing else
            saved for its own backward, whose elements do not share memory, and it holds the
            gradient afterwards.
        return_lse: also return the fp32 LSE per token (``target``'s shape; no gradient).
        validate: check that every target is in ``[0, V)`` or ``ignore_index``. A bad target
            always gives a NaN loss and gradient row, never a read outside the tensors; the
            check turns it into a ``ValueError``. ``True``: on the device, inside the
            forward's launches (the one that computes the mean's divisor; for rows of 16k
            logits and more on a GPU, the forward kernel itself), without stopping the host.
            On a GPU the error is then raised by a *later* ``cross_entropy`` call on that
            device, the first that finds the check finished (on the CPU, by this call).
            ``"sync"``: by this call, before the forward runs, after a host sync (for
            debugging; about 0.2 ms a step at 128k–256k classes on the H200).
            ``False``: no check.
            Skipped inside ``torch.compile``.

    Returns:
        The loss in **fp32** whatever the logits' dtype (a bf16 sum over thousands of tokens
        loses the digits training curves compare): a scalar for ``mean``/``sum``, ``target``'s
        shape for ``none``; and the LSE with ``return_lse``. The backward runs once per forward.

    Raises:
        TypeError: non-tensors, unsupported dtypes, float targets, non-numeric options.
        ValueError: shape or device mismatch, a bad reduction, ``label_smoothing`` outside
            [0, 1], a negative ``z_loss``, a non-positive ``softcap``, ``validate`` not one of
            True, False, "sync"; ``inplace_backward`` on a leaf that requires grad (or a view
            of one) while grad mode is on, or on logits whose elements overlap; with
            ``validate``, a target outside ``[0, V)`` that is not ``ignore_index`` (see
            ``validate`` for which call raises it).
    """
    _check(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    if not (isinstance(validate, bool) or validate == "sync"):
        raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
    if inplace_backward:  # (here: a moved call's copy would no longer be the caller's leaf)
        _check_inplace(logits)
    dev = moved_call_device(logits.device)
    if dev is not None:  # the whole call on the GPU, CPU tensors' rule kept: a bad one raises
        out = cross_entropy(
            logits.to(dev), target.to(dev), moved(weight, dev), ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            inplace_backward=inplace_backward, return_lse=return_lse,
            validate="sync" if validate else False,
        )  # fmt: skip
        return moved(out, logits.device)
    v = logits.shape[-1]
    # (2-D logits and 1-D targets as they are: a reshape would add a view to the autograd graph)
    x2 = logits if logits.dim() == 2 else logits.reshape(-1, v)
    if inplace_backward and x2.data_ptr() != logits.data_ptr():
        raise ValueError("inplace_backward needs logits whose rows form a (N, V) view (no copy)")
    t1 = target if target.dim() == 1 else target.reshape(-1)
    eager = plain_eager(x2, t1)
    mean = reduction == "mean"
    record, grad_scale = None, None
    if not eager:  # traced: the scale from torch ops, no check (a host read cannot be traced)
        grad_scale = _traced_scale(t1, weight, v, ignore_index, mean,
                                   _z_scaled(weight, mean, z_loss))  # fmt: skip
    elif validate == "sync" or (validate and x2.device.type == "cpu"):  # checked, then waited for
        grad_scale = _scale_and_check(t1, weight, v, ignore_index, mean,
                                      _z_scaled(weight, mean, z_loss))  # fmt: skip
    elif validate:  # checked in the forward's own launch, reported by a later call
        _report_bad_targets(t1.device, False, ignore_index, earlier=True)
        record = _bad_record(t1.device)
    bad = None if record is None else record[0]
    kernel_opts = (ignore_index, float(label_smoothing), float(z_loss), check_softcap(softcap))
    grad, done = None, None
    if eager:  # the whole forward launched before autograd's bookkeeping: a host-bound step's
        # GPU starts that much sooner (the Function only records what was launched)
        grad = _grad_buffer(x2, inplace_backward)
        done = _fwd_eager_here(x2, t1, weight, grad, grad_scale, bad, reduction, *kernel_opts)
    opts = (*kernel_opts, bool(inplace_backward), reduction, grad, done)
    loss, lse = _CrossEntropy.apply(x2, t1, weight, grad_scale, opts)
    if reduction == "none":
        loss = loss.view(target.shape)
    return (loss, lse.view(target.shape)) if return_lse else loss


# ----------------------------------------------------------------------------- linear CE
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
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    vocab_chunk: int = 0,
    z_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sweep over token chunks: logits ``h·Wᵀ + b`` of a chunk (tensor cores through
    ``torch.matmul``), the fused kernel writing their gradient over them, then that gradient
    scaled per row by ``scale`` and folded into ``grads = (dh, dW, db)`` (when given). With
    ``0 < vocab_chunk < V`` each token chunk's vocabulary is swept in slices instead
    (:func:`_vocab_sweep`). ``z_scale``: a 1-element fp32 factor of the z-loss, on the device
    (:func:`_z_scaled`). Returns the fp32 per-token losses and LSE."""
    n = hidden.shape[0]
    losses = hidden.new_empty((n,), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    unit = torch.ones(1, dtype=torch.float32, device=hidden.device)
    if z_scale is not None:  # (the kernel reads the z-loss's factor after the gradient's scale)
        unit = torch.cat((unit, z_scale.reshape(1).float()))
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        if 0 < vocab_chunk < weight.shape[0]:
            losses[rows], lse[rows] = _vocab_sweep(
                hidden[rows], weight, bias, target[rows], scale[rows], opts, vocab_chunk, grads,
                rows, z_scale,
            )  # fmt: skip
            continue
        h = hidden[rows]
        logits = h @ weight.t()
        if bias is not None:
            logits += bias
        losses[rows], lse[rows] = cross_entropy_fwd(logits, target[rows], opts[0], unit, logits,
                                                    *opts[1:])  # fmt: skip
        if grads is None:
            continue
        g = cross_entropy_bwd(logits, logits, scale[rows])  # ∂loss/∂logits, these tokens
        dh, dw, db = grads
        torch.matmul(g, weight, out=dh[rows])
        dw.addmm_(g.t(), h)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
    return losses, lse


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


def _linear_grads(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
        grads = _linear_grads(hidden, weight, bias) if with_grads else None
        losses, lse = _linear_chunks(hidden, weight, bias, target, scale, opts, chunk, grads,
                                     vocab_chunk, z_scale)  # fmt: skip
    if grads is None:  # (distinct empty tensors: an op's outputs may not alias)
        return losses, lse, *(hidden.new_empty((0,), dtype=torch.float32) for _ in range(3))
    return losses, lse, grads[0], grads[1], _no_bias(grads[2], hidden)


_linear_fwd_op = torch.library.custom_op("flashlite::linear_cross_entropy_fwd",
                                         mutates_args=())(_linear_fwd)  # fmt: skip


@_linear_fwd_op.register_fake
def _(hidden, weight, bias, target, class_weight, scale, ignore_index, label_smoothing, z_loss,  # type: ignore[no-untyped-def]
      softcap, chunk, vocab_chunk, with_grads, z_scale=None):  # fmt: skip
    losses = hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
    if not with_grads:
        return losses, torch.empty_like(losses), *(hidden.new_empty((0,), dtype=torch.float32)
                                                   for _ in range(3))  # fmt: skip
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
    _, _, dh, dw, db = _linear_fwd(hidden, weight, bias, target, class_weight, dloss.float(),
                                   ignore_index, label_smoothing, z_loss, softcap, chunk,
                                   vocab_chunk, True)  # fmt: skip
    return dh, dw, db


_linear_bwd_op = torch.library.custom_op("flashlite::linear_cross_entropy_bwd",
                                         mutates_args=())(_linear_bwd)  # fmt: skip


@_linear_bwd_op.register_fake
def _(hidden, weight, bias, target, class_weight, dloss, ignore_index, label_smoothing, z_loss,  # type: ignore[no-untyped-def]
      softcap, chunk, vocab_chunk):  # fmt: skip
    return _grads_fake(hidden, weight, bias)


class _LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``hidden·weightᵀ + bias`` without the full logits: the gradients of
    hidden, weight and bias are accumulated in the forward's sweep over token chunks (mean and
    sum: the backward scales them by the incoming scalar); ``reduction="none"`` needs each
    token's incoming gradient, so its backward sweeps the chunks again. The sweeps are the
    custom ops ``flashlite::linear_cross_entropy_fwd``/``_bwd`` (``torch.compile`` traces
    through; eager calls their bodies directly)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, ignore_index, label_smoothing,  # type: ignore[no-untyped-def, override]
                z_loss, softcap, reduction, chunk, vocab_chunk):  # fmt: skip
        n, v = hidden.shape[0], weight.shape[0]
        opts = (ignore_index, label_smoothing, z_loss, softcap, chunk, vocab_chunk)
        z_scale = None
        if reduction == "mean":
            denom = _mean_divisor(target, class_weight, v, ignore_index)
            scale = (1.0 / denom).expand(n)
            if _z_scaled(class_weight, True, z_loss):
                z_scale = _z_ratio(target, denom, ignore_index).reshape(1)
        else:
            denom, scale = None, hidden.new_ones((n,), dtype=torch.float32)
        need = any(ctx.needs_input_grad[:3])
        with_grads = need and reduction != "none"
        args = (hidden, weight, bias, target, class_weight, scale, *opts, with_grads, z_scale)
        if skip_dispatcher(hidden, weight, target):
            losses, lse, dh, dw, db = _linear_fwd(*args)  # the op's own body
        else:
            losses, lse, dh, dw, db = torch.ops.flashlite.linear_cross_entropy_fwd.default(*args)
        ctx.mark_non_differentiable(lse)
        ctx.reduction, ctx.opts, ctx.has_bias = reduction, opts, bias is not None
        if with_grads:
            ctx.save_for_backward(dh, dw, db)
        elif need:  # "none": the backward sweeps again
            ctx.save_for_backward(hidden, weight, bias, target, class_weight)
        if reduction == "none":
            return losses, lse
        total = losses.sum()
        return (total / denom if denom is not None else total), lse

    @staticmethod
    def backward(ctx, dloss, _dlse):  # type: ignore[no-untyped-def, override]
        if ctx.reduction != "none":
            dh, dw, db = ctx.saved_tensors
            if skip_dispatcher(dh, dw, dloss):  # eager: scaled where they are (no second copy)
                dh, dw, db = dh.mul_(dloss), dw.mul_(dloss), db.mul_(dloss)
            else:
                dh, dw, db = dh * dloss, dw * dloss, db * dloss
            return dh, dw, db.to(dw.dtype) if ctx.has_bias else None, *([None] * 9)
        hidden, weight, bias, target, class_weight = ctx.saved_tensors
        args = (hidden, weight, bias, target, class_weight, dloss, *ctx.opts)
        if skip_dispatcher(hidden, weight, dloss):
            dh, dw, db = _linear_bwd(*args)
        else:
            dh, dw, db = torch.ops.flashlite.linear_cross_entropy_bwd.default(*args)
        return dh, dw, db.to(weight.dtype) if ctx.has_bias else None, *([None] * 9)


def _autocast(t: object, dtype: torch.dtype) -> Any:
    """``t`` cast as autocast casts a product's operands: floating tensors but fp64 (which
    autocast leaves alone) to ``dtype``; anything else as it is (the checks judge it)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t


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
    validate: bool = True,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy` of the output layer's logits ``hidden·weightᵀ + bias``, never
    materialising the ``(N, V)`` logits.

    The tokens are swept in chunks: each chunk's logits come from ``torch.matmul`` (tensor
    cores, cuBLAS's tuned GEMMs), the fused kernel turns them into that chunk's losses and
    writes their gradient over them, and the gradients of hidden, weight and bias are folded in
    with two more matmuls, all in the same sweep. At most one chunk of logits exists at a time
    (:data:`LINEAR_CHUNK_BYTES`, 256 MiB by default), plus the gradients themselves. When even
    :data:`LINEAR_MIN_TOKENS` tokens of whole-vocabulary logits would not fit that budget, or
    with ``vocab_chunk_size``, each token chunk's vocabulary is swept in slices too: their
    ``(m, s)`` pairs merged with :func:`flashlite.stats.merge`, then the gradient from the
    finished LSE, slice by slice (one more product per slice).

    Under ``torch.autocast`` the products run in autocast's dtype, as ``hidden @ weight.T``
    would: hidden, weight and bias are cast to it (differentiably, so their gradients come back
    in their own dtypes); the loss is fp32 as always.

    Args:
        hidden: ``(N, H)`` or ``(B, T, H)``.
        weight: ``(V, H)``, the output layer's matrix (class weights are ``class_weight``).
        target: ``(N,)`` or ``(B, T)`` class indices.
        bias: ``(V,)`` or None.
        class_weight: ``(V,)`` per-class weights (torch's ``weight``).
        ignore_index, reduction, label_smoothing, z_loss, softcap, return_lse: as
            :func:`cross_entropy`.
        validate: as :func:`cross_entropy`, but a bad target is always reported by this call
            (one host sync: the sweep takes far longer).
        chunk_size: tokens per chunk (default: as many as fit :data:`LINEAR_CHUNK_BYTES`).
        vocab_chunk_size: classes per vocabulary slice (default: the whole vocabulary, unless
            it does not fit the budget as said above).

    Returns:
        The fp32 loss (and the LSE per token), as :func:`cross_entropy`.
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device_type = hidden.device.type  # (other devices fail the checks below)
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        # as torch.matmul under autocast: the products in autocast's dtype (differentiable
        # casts: the gradients come back in the leaves' dtypes), the loss fp32; the sweep then
        # runs with autocast off, so that its products and its buffers agree on one dtype
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(
                _autocast(hidden, dtype), _autocast(weight, dtype), target,
                bias=_autocast(bias, dtype), class_weight=class_weight, ignore_index=ignore_index,
                reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap, return_lse=return_lse, validate=validate, chunk_size=chunk_size,
                vocab_chunk_size=vocab_chunk_size,
            )  # fmt: skip
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden (N, H) or (B, T, H) and weight (V, H) must agree on H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")  # fmt: skip
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got {hidden.dtype} and "
                        f"{weight.dtype}")  # fmt: skip
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ValueError(f"bias must be a ({weight.shape[0]},) tensor")
    v = weight.shape[0]
    fake = hidden.new_empty((1,) * hidden.dim()).expand(*hidden.shape[:-1], v)  # (no storage)
    _check(fake, target, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {size!r}")
    dev = moved_call_device(hidden.device)
    if dev is not None:  # the whole call on the GPU (see moved_call_device)
        out = linear_cross_entropy(
            hidden.to(dev), weight.to(dev), target.to(dev), bias=moved(bias, dev),
            class_weight=moved(class_weight, dev), ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            return_lse=return_lse, validate=validate, chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
        )  # fmt: skip
        return moved(out, hidden.device)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if validate and plain_eager(h2, t1):  # (at the call: a sweep takes far longer than a sync)
        _scale_and_check(t1, None, v, ignore_index, False)
    chunk, vocab_chunk = _linear_chunking(v, hidden.element_size(), chunk_size, vocab_chunk_size)
    loss, lse = _LinearCrossEntropy.apply(
        h2, weight, bias, t1, class_weight, ignore_index, float(label_smoothing), float(z_loss),
        check_softcap(softcap), reduction, chunk, vocab_chunk,
    )  # fmt: skip
    if reduction == "none":
        loss = loss.view(target.shape)
    return (loss, lse.view(target.shape)) if return_lse else loss
