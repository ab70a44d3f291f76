"""Planned launches of the cross-entropy kernels (kernel, options, grid, Triton's binding), kept
per everything they depend on but the tensors' addresses: a training loop's repeated calls skip
the planning, which cost more host time than the launch itself (``_launch.Launcher.bind``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashlite import _backend, _launch, _teams
from flashlite._caches import Cache
from flashlite.kernels import cross_entropy as K
from flashlite.kernels import cross_entropy_gluon as KG
from flashlite.kernels.configs import cdiv
from flashlite.ops.cross_entropy.checks import _host_flag
from flashlite.ops.prefetch import (
    prefetch_applies,
    prefetch_chunks,
    prefetch_plan,
    prefetch_words,
)

_INT32_LIMIT = 2**31
#: Columns per tile, and tiles per program, of the backward's scaling kernel (a row's tiles in
#: one program), and its most programs along the rows (each loops over rows: a skipped incoming
#: gradient costs one program, not one per row: 11-16 us -> a few at 8192 rows on the H200).
BWD_BLOCK = 4096
BWD_TILES = 16
BWD_PROGRAMS = 1024


#: Planned launches (kernel, launch options, grid, Triton's argument binding), per everything
#: they depend on but the tensors' addresses: a training loop's repeated calls skip the
#: planning, which cost more host time than the launch itself (``_launch.Launcher.bind``).
#: Fresh buffers (losses, LSE, the words) come from torch's allocator, 512-byte aligned. The
#: kernels' module constants (tile sizes) are taken as fixed: a test that patches them starts
#: an empty cache.
_plans = Cache("cross_entropy.plans", 1024)


def _aligned(*tensors: torch.Tensor | None) -> bool | tuple[bool, ...]:
    """True when every tensor starts on 16 bytes (the usual case, one test), else each one's."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    if bits % 16 == 0:
        return True
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _gluon_applies(
    logits: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor, softcap: float
) -> bool:
    """Whether the Gluon prefetching team takes these logits: long plain rows (no class
    weights, no soft cap) on a GPU that runs it."""
    return (
        weight is None
        and not softcap
        and logits.shape[1] >= KG.MIN_COLS
        and prefetch_applies(logits, grad)
    )


def fwd_reads(n_cols: int, elem_bytes: int, prefetch: bool) -> tuple[int, int]:
    """``(passes over a row of logits, programs per row)`` of the forward for rows of
    ``n_cols`` logits of ``elem_bytes`` bytes: the Gluon prefetching team (``prefetch``) reads a
    row once with :func:`flashlite.ops.prefetch.prefetch_chunks` programs; the Triton kernel
    once when a row is one tile (:func:`flashlite.kernels.cross_entropy.ce_config`), twice
    otherwise, with one program (the launcher and the traffic model both read this)."""
    if prefetch:
        return 1, prefetch_chunks(n_cols, elem_bytes)
    return (1 if K.ce_config(n_cols)["SINGLE"] else 2), 1


def _plan_triton_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    grad_scale: torch.Tensor,
    grad: torch.Tensor,
    opts: tuple[int, float, float, float],
    z_scale: bool = False,
) -> Callable[..., None]:
    """The Triton kernel's ``run(logits, target, weight, grad_scale, grad, losses, lse)``;
    ``z_scale``: ``grad_scale`` holds the z-loss's scale too (:func:`_z_scaled`)."""
    ignore_index, label_smoothing, z_loss, softcap = opts
    n, v = logits.shape
    col64 = any((v - 1) * abs(t.stride(1)) >= _INT32_LIMIT for t in (logits, grad))
    rest = (v, *logits.stride(), *grad.stride(), ignore_index, label_smoothing, z_loss, softcap)
    options = dict(
        HAS_WEIGHT=weight is not None,
        SOFTCAP=softcap > 0,
        SMOOTH=label_smoothing > 0,
        COL_INT64=col64,
        ROUND_BF16=_backend.round_bf16(logits.dtype),
        num_stages=1,
        Z_SCALE=z_scale,
        **K.ce_config(v),
    )
    stand_in = grad_scale  # (for the weights and their sum when there are none: never read)
    bound = _launch.launcher(K._cross_entropy_fwd_kernel).bind(
        (
            logits,
            target,
            weight if weight is not None else stand_in,
            stand_in,
            grad_scale,
            grad,
            stand_in,
            stand_in,
            *rest,
        ),
        options,
    )

    def run(logits, target, weight, grad_scale, grad, losses, lse) -> None:  # noqa: ANN001
        if weight is None:
            weight = wsum = losses
        else:  # Σ w on the device: no host sync for it
            wsum = weight.float().sum().reshape(1)
        bound((n, 1, 1), logits, target, weight, wsum, grad_scale, grad, losses, lse, *rest)

    return run


def _plan_prefetch(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad: torch.Tensor,
    opts: tuple[int, float, float, float],
    mode: tuple[bool, bool, int],
) -> Callable[..., None]:
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
    rest = (
        n,
        v,
        v // vec,
        logits.stride(0) // vec,
        grad.stride(0) // vec,
        n_chunks,
        ignore_index,
        label_smoothing,
        z_loss,
    )
    # (stand-ins for the binding, which reads only their dtypes and alignment)
    f32, i64 = torch.empty(1, device=device), torch.empty(1, device=device, dtype=torch.int64)
    launch = _teams.bind_teams(
        KG._cross_entropy_prefetch_kernel,
        [logits, target, f32, grad, f32, f32, i64, i64, i64, f32, *rest],
        {
            "SMOOTH": smooth,
            "COUNT": count,
            "CHECK": check,
            "REDUCE": reduce,
            "EVEN": v % options["CHUNK"] == 0,
            **options,
        },
        n_chunks,
        n,
        device,
    )

    def run(logits, target, grad_scale, grad, losses, lse, bad, out) -> None:  # noqa: ANN001
        words = prefetch_words(size, device)  # (the control words: no program in, none done)
        if bad is None:
            seen = bad = words
        else:
            seen = _host_flag(bad)
        launch(
            logits,
            target,
            losses if grad_scale is None else grad_scale,
            grad,
            losses,
            lse,
            words,
            seen,
            bad,
            losses if out is None else out,
            *rest,
        )

    return run


def _reduced(losses: torch.Tensor, grad_scale: torch.Tensor, reduction: str) -> torch.Tensor | None:
    """The loss of the per-row ``losses`` in torch ops (None for ``"none"``): their sum, times
    ``grad_scale`` (``1/Σ``, the scale the gradient was stored with) for a mean."""
    if reduction == "none":
        return None
    total = losses.sum()
    if reduction != "mean":
        return total
    return total * (grad_scale if grad_scale.numel() == 1 else grad_scale[0])


def bwd_tiling(n_rows: int, n_cols: int) -> tuple[int, int, tuple[int, int, int]]:
    """The backward kernel's ``(BLOCK_N, TILES, grid)`` for ``(n_rows, n_cols)`` gradients: a
    program scales ``TILES`` blocks of ``BLOCK_N`` columns of up to :data:`BWD_PROGRAMS` rows
    at a time (the launcher and the traffic model both read this)."""
    block = min(BWD_BLOCK, 1 << max(4, (n_cols - 1).bit_length()))
    tiles = min(BWD_TILES, cdiv(n_cols, block))
    return block, tiles, (min(n_rows, BWD_PROGRAMS), cdiv(n_cols, block * tiles), 1)


def _plan_bwd(
    grad: torch.Tensor, out: torch.Tensor, d: torch.Tensor, stride_l: int, skip: bool
) -> Callable[..., None]:
    n, v = grad.shape
    block, tiles, grid = bwd_tiling(n, v)
    col64 = (v - 1) * max(abs(grad.stride(1)), abs(out.stride(1))) >= _INT32_LIMIT
    rest = (n, v, *grad.stride(), *out.stride(), stride_l)
    bound = _launch.launcher(K._cross_entropy_bwd_kernel).bind(
        (grad, out, d, *rest),
        dict(
            SCALAR=d.numel() == 1,
            SKIP_UNIT=skip,
            BLOCK_N=block,
            TILES=tiles,
            COL_INT64=col64,
            ROUND_BF16=_backend.round_bf16(grad.dtype),
            num_warps=4,
            num_stages=1,
        ),
    )
    return lambda grad, out, d: bound(grid, grad, out, d, *rest)


_unit_scales = Cache("cross_entropy.unit_scales", 16)


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 one on ``device``, kept (the kernels only read it)."""
    found = _unit_scales.get(device)
    if found is None:
        found = _unit_scales.put(device, torch.ones((), dtype=torch.float32, device=device))
    return found
