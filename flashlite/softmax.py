"""Row softmax and log_softmax: validation, layouts, dispatch and autograd.

The kernels live in :mod:`flashlite.kernels.softmax`; this module picks one for the shape, hands it
a 2-D strided view of the rows (no copy when the layout allows one) and wires up autograd.
"""

from __future__ import annotations

import torch
import triton

from flashlite import _backend
from flashlite.kernels import softmax as K

ALGORITHMS = ("auto", "three_pass", "online")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_LIMIT = 2**31


def _check(x: object, dim: object, algorithm: object) -> int:
    """Validate the public arguments; return ``dim`` as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; flashlite softmax accepts torch.float16, torch.bfloat16 "
            "and torch.float32 (statistics are fp32; use torch.softmax for float64)"
        )
    _backend.check_device(x, "x")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"dim={dim} is out of range for a tensor with {x.dim()} dimensions "
            f"(expected -{ndim} <= dim < {ndim})"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return dim % ndim


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor | None:
    """A 2-D ``(rows, n)`` view of ``t`` with ``dim`` last, or None if no view exists."""
    moved = t.movedim(dim, -1)
    try:
        return moved.view(-1, moved.shape[-1])
    except RuntimeError:
        return None


def _col_int64(n_cols: int, *tensors: torch.Tensor) -> bool:
    """Whether column offsets (col·stride) can pass 2^31 and need 64-bit arithmetic."""
    return any((n_cols - 1) * abs(t.stride(1)) >= _INT32_LIMIT for t in tensors)


def _softmax_fwd(x2: torch.Tensor, y2: torch.Tensor, log: bool, algorithm: str) -> None:
    """Launch the forward kernel for ``algorithm`` on the ``(rows, n)`` views ``x2 → y2``."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    col64 = _col_int64(n_cols, x2, y2)
    strides = (*x2.stride(), *y2.stride())
    if algorithm == "auto":
        if K.fits_single_read(n_cols, x2.element_size()):
            algorithm = "single_read"
        elif _team_kernel_usable(dev, K.team_config(n_cols, x2.element_size())["n_chunks"]):
            algorithm = "team"
        else:
            algorithm = "split"
    if algorithm == "single_read":
        cfg = K.single_read_config(n_cols)
        grid = (triton.cdiv(n_rows, cfg["ROWS"]),)
        kernel = _backend.launcher(K._softmax_single_read_fwd_kernel, dev)
        kernel[grid](x2, y2, n_rows, n_cols, *strides, LOG=log, COL_INT64=col64, **cfg)
    elif algorithm == "split":
        cfg = K.split_config(n_cols)
        n_chunks = cfg.pop("n_chunks")
        m_ws = torch.empty((n_rows, n_chunks), device=dev, dtype=torch.float32)
        s_ws = torch.empty_like(m_ws)
        grid = (n_rows * n_chunks,)
        stats = _backend.launcher(K._softmax_split_stats_kernel, dev)
        stats[grid](x2, m_ws, s_ws, n_rows, n_cols, *x2.stride(), n_chunks, BLOCK_N=cfg["BLOCK_N"],
                    COL_INT64=col64, num_warps=cfg["num_warps"])  # fmt: skip
        write = _backend.launcher(K._softmax_split_write_kernel, dev)
        write[grid](x2, y2, m_ws, s_ws, n_rows, n_cols, *strides, n_chunks, LOG=log,
                    COL_INT64=col64, **cfg)  # fmt: skip
    elif algorithm == "team":
        if dev.type != "cuda":  # its programs wait for each other: the interpreter runs them
            raise ValueError("the team kernel needs a CUDA device")  # one after another
        cfg = K.team_config(n_cols, x2.element_size())
        n_chunks = cfg.pop("n_chunks")
        m_ws = torch.empty((n_rows, n_chunks), device=dev, dtype=torch.float32)
        s_ws = torch.empty_like(m_ws)
        count = torch.zeros(n_rows, device=dev, dtype=torch.int32)
        args = [x2, y2, m_ws, s_ws, count, n_rows, n_cols, *strides, n_chunks, n_rows]
        opts = dict(LOG=log, COL_INT64=col64, launch_cooperative_grid=True, **cfg)
        # Every program of a team waits for the others, so all must be resident at once: size
        # the grid from the compiled kernel's registers and shared memory. The cooperative
        # launch makes the driver refuse, rather than hang, should that ever fall short.
        compiled = K._softmax_team_fwd_kernel.warmup(*args, grid=(1,), **opts)
        capacity = _backend.resident_programs(compiled, dev)
        args[-1] = n_teams = max(1, min(n_rows, capacity // n_chunks))
        K._softmax_team_fwd_kernel[(n_teams * n_chunks,)](*args, **opts)
    else:  # "online" or "three_pass": one program per row, looping over tiles
        cfg = K.loop_config(n_cols)
        del cfg["ROWS"]
        kernel = _backend.launcher(K._softmax_online_fwd_kernel, dev)
        kernel[(n_rows,)](x2, y2, n_rows, n_cols, *strides, LOG=log,
                          THREE_PASS=algorithm == "three_pass", COL_INT64=col64, **cfg)  # fmt: skip


def _team_kernel_usable(dev: torch.device, n_chunks: int) -> bool:
    """The team kernel needs a GPU, cooperative launches, and a team no larger than the SMs."""
    return (
        dev.type == "cuda"
        and _backend.cooperative_launch_supported()
        and n_chunks <= _backend.num_sms(dev)
    )


def _softmax_bwd(y2: torch.Tensor, dy2: torch.Tensor, dx2: torch.Tensor, log: bool) -> None:
    """Launch the backward kernel on ``(rows, n)`` views: ``dx2`` from saved ``y2`` and ``dy2``."""
    n_rows, n_cols = y2.shape
    one_tile = K.fits_single_read(n_cols, y2.element_size())
    cfg = K.single_read_config(n_cols) if one_tile else K.loop_config(n_cols)
    kernel = _backend.launcher(K._softmax_bwd_kernel, y2.device)
    kernel[(triton.cdiv(n_rows, cfg["ROWS"]),)](
        y2, dy2, dx2, n_rows, n_cols, *y2.stride(), *dy2.stride(), *dx2.stride(), LOG=log,
        ONE_TILE=one_tile, COL_INT64=_col_int64(n_cols, y2, dy2, dx2), **cfg,
    )  # fmt: skip


def _apply_rows(inputs: tuple[torch.Tensor, ...], dim: int, launch: object) -> torch.Tensor:
    """Run ``launch(*row_views, out_rows)`` with ``dim`` moved last; copy only when no view exists.

    The output takes the first input's memory layout (``empty_like``) when that gives a row view.
    """
    like = inputs[0]
    views = []
    for t in inputs:
        v = _rows(t, dim)
        views.append(v if v is not None else t.movedim(dim, -1).reshape(-1, t.shape[dim]))
    out = torch.empty_like(like)
    out2 = _rows(out, dim)
    if out2 is None:
        moved_shape = like.movedim(dim, -1).shape
        out2 = torch.empty((views[0].shape[0], like.shape[dim]), device=like.device,
                           dtype=like.dtype)  # fmt: skip
        out = out2.view(moved_shape).movedim(-1, dim)
    launch(*views, out2)  # type: ignore[operator]
    return out


class SoftmaxFunction(torch.autograd.Function):
    """Autograd for softmax (``log=False``) and log_softmax (``log=True``); saves the output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:  # type: ignore[override]
        squeeze = x.dim() == 0
        xs = x.reshape(1) if squeeze else x
        if xs.numel() == 0:
            y = torch.empty_like(xs)
        else:
            y = _apply_rows((xs,), dim, lambda x2, y2: _softmax_fwd(x2, y2, log, algorithm))
        y = y.reshape(()) if squeeze else y
        ctx.save_for_backward(y)
        ctx.dim, ctx.log = dim, log
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        squeeze = y.dim() == 0
        ys, dys = (y.reshape(1), dy.reshape(1)) if squeeze else (y, dy)
        if ys.numel() == 0:
            dx = torch.empty_like(ys)
        else:
            dx = _apply_rows(
                (ys, dys.to(ys.dtype)), ctx.dim,
                lambda y2, dy2, dx2: _softmax_bwd(y2, dy2, dx2, ctx.log),
            )  # fmt: skip
        return (dx.reshape(()) if squeeze else dx), None, None, None


def softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """Softmax along ``dim``, with the online-softmax kernels.

    Args:
        x: ``(*, n, *)`` tensor, fp16 / bf16 / fp32, on CUDA (compiled Triton) or CPU (Triton
            interpreter); any strides.
        dim: the dimension to normalise; negative values count from the end.
        algorithm: ``"auto"`` (fastest correct kernel for the shape: one read when the row fits
            on chip, rows split across programs and merged when it does not), ``"online"``
            (one tiled pass for (m, s), then the write) or ``"three_pass"`` (max, sum, write).

    Returns:
        ``(*, n, *)`` tensor of ``x``'s dtype and shape. Statistics are fp32. As in torch, a row
        that is entirely −inf gives NaN and −inf entries give exact zeros.

    Raises:
        TypeError: ``x`` is not a float16/bfloat16/float32 tensor, or ``dim`` is not an int.
        IndexError: ``dim`` is out of range.
        ValueError: unknown ``algorithm`` or device.
    """
    d = _check(x, dim, algorithm)
    return SoftmaxFunction.apply(x, d, algorithm, False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, computed as ``(x − m) − log s`` (no log of 0).

    Args, returns and errors as :func:`softmax`. A row that is entirely −inf gives NaN.
    """
    d = _check(x, dim, algorithm)
    return SoftmaxFunction.apply(x, d, algorithm, True)
