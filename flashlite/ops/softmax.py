"""Row softmax and log_softmax: validation, layouts, custom ops and autograd.

The kernels live in :mod:`flashlite.kernels.softmax` and their launches in
:mod:`flashlite.ops.softmax_plan`, which picks one for the shape; this module hands it a 2-D
strided view of the rows (no copy when the layout allows one) and registers
``flashlite::softmax_fwd`` / ``flashlite::softmax_bwd`` as ``torch.library`` custom ops (fakes
and autograd included), so ``torch.compile(fullgraph=True)`` traces through :func:`softmax` and
:func:`log_softmax` forward and backward. They are ``custom_op`` rather than ``triton_op`` for
the reason ``flashlite.ops.attention`` gives: one op serves the interpreter, the GPU and CPU tensors
moved to the GPU, with host-side dispatch per call.
"""

from __future__ import annotations

import math

import torch

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.ops._dispatch import Op
from flashlite.ops.softmax_plan import RowPlan as RowPlan
from flashlite.ops.softmax_plan import plan_bwd, plan_fwd, softmax_bwd, softmax_fwd
from flashlite.ops.softmax_plan import row_plan as row_plan
from flashlite.ops.softmax_plan import softmax_kernel_for as softmax_kernel_for

ALGORITHMS = ("auto", "three_pass", "online")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: object, dim: object, algorithm: object) -> int:
    """Validate the public arguments; return ``dim`` as a non-negative index."""
    if type(x) is torch.Tensor and type(dim) is int and algorithm == "auto":  # the usual call
        ndim = x.dim() or 1
        if x.dtype in DTYPES and -ndim <= dim < ndim and (x.is_cuda or x.is_cpu):
            return dim % ndim
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
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
    return int(dim) % ndim  # int(): torch.compile specialises the dim instead of tracing it


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor | None:
    """A 2-D ``(rows, n)`` view of ``t`` with ``dim`` last, or None if no view exists."""
    if dim == t.dim() - 1 and not torch.compiler.is_compiling() and t.is_contiguous():
        # the common case, decided in one check (eager only: see below)
        return t.view(math.prod(t.shape[:-1]), t.shape[-1])
    moved = t.movedim(dim, -1)
    # The leading dims merge into one row index when each (of size > 1) strides over exactly the
    # ones inside it. Decided from sizes and strides, not by trying .view(): the fake (meta)
    # implementation must take the same branch with symbolic shapes under torch.compile.
    inner = None
    lead = zip(moved.shape[:-1], moved.stride()[:-1], strict=True)
    for size, stride in reversed(list(lead)):
        if size == 0:
            break
        if size == 1:
            continue
        if inner is not None and stride != inner:
            return None
        inner = stride * size
    return moved.view(math.prod(moved.shape[:-1]), moved.shape[-1])


def _empty_rows(like: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An output shaped like ``like`` and its ``(rows, n)`` view with ``dim`` last: ``like``'s
    memory layout (``empty_like``) when that gives a row view, else rows made dense."""
    out = torch.empty_like(like)
    out2 = _rows(out, dim)
    if out2 is None:
        moved_shape = like.movedim(dim, -1).shape
        out2 = like.new_empty((math.prod(moved_shape[:-1]), like.shape[dim]))
        out = out2.view(moved_shape).movedim(-1, dim)
    return out, out2


def _row_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``(rows, n)`` with ``dim`` last: a view when one exists, else a copy."""
    v = _rows(t, dim)
    return v if v is not None else t.movedim(dim, -1).reshape(-1, t.shape[dim])


# ----------------------------------------------------------------------------- the ops
#: Plans of dense calls along the last dim, by ``x``'s shape, dtype, device and alignment: the
#: launch takes ``x`` and ``y`` themselves (it reads only their addresses), no row views.
_dense_fwd_plans = Cache("softmax.fwd_dense", 512)
_dense_bwd_plans = Cache("softmax.bwd_dense", 512)


def _softmax_forward(x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:
    if x.is_contiguous() and dim == x.dim() - 1 and x.numel():  # the usual case, in one test
        y = torch.empty_like(x)  # (dense, from the allocator: aligned)
        key = (x.shape, x.dtype, x.device, x.data_ptr() % 16, log, algorithm)
        launch = _dense_fwd_plans.get(key)
        if launch is None:
            n = x.shape[-1]
            launch = _dense_fwd_plans.put(
                key, plan_fwd(x.view(-1, n), y.view(-1, n), log, algorithm)
            )
        launch(x, y)
        return y
    if x.dim() == 0:  # one value: a row of one
        return _softmax_forward(x.reshape(1), 0, algorithm, log).reshape(())
    y, y2 = _empty_rows(x, dim)
    if x.numel():
        softmax_fwd(_row_view(x, dim), y2, log, algorithm)
    return y


def _softmax_fwd_fake(x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:
    return _empty_rows(x.reshape(1), 0)[0].reshape(()) if x.dim() == 0 else _empty_rows(x, dim)[0]


def _check_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int) -> None:
    # autograd hands over a matching dy; a direct call of the op could pass any, and the kernel
    # reads dy through y's shape
    if dy.shape != y.shape:
        raise ValueError(
            f"softmax_bwd: dy must have the shape of the saved output y, {tuple(y.shape)}; got "
            f"{tuple(dy.shape)}"
        )
    if dy.device != y.device:
        raise ValueError(f"softmax_bwd: dy must be on y's device {y.device}, got {dy.device}")
    if not dy.is_floating_point():
        raise TypeError(f"softmax_bwd: dy must be a float tensor, got {dy.dtype}")
    ndim = max(y.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"softmax_bwd: dim={dim} is out of range for y of {y.dim()} dimensions")


def _softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    # the usual call (autograd's dy laid out as y, along the last dim of a dense y), in one
    # test that also passes every check of _check_bwd
    if (
        dy.dtype == y.dtype
        and dy.stride() == y.stride()
        and dy.shape == y.shape
        and dim == y.dim() - 1
        and y.is_contiguous()
        and _backend.same_device(dy, y)
        and y.numel()
    ):
        return _dense_backward(y, dy, log)
    _check_bwd(y, dy, dim)
    if dy.dtype != y.dtype:
        dy = dy.to(y.dtype)
    same = dy.stride() == y.stride()  # (autograd's dy is usually laid out as y)
    if same and y.is_contiguous() and dim == y.dim() - 1 and y.numel():
        return _dense_backward(y, dy, log)
    if y.dim() == 0:
        return _softmax_backward(y.reshape(1), dy.reshape(1), 0, log).reshape(())
    dx, dx2 = _empty_rows(y, dim)
    if y.numel():
        softmax_bwd(_row_view(y, dim), _row_view(dy, dim), dx2, log)
    return dx


def _dense_backward(y: torch.Tensor, dy: torch.Tensor, log: bool) -> torch.Tensor:
    """dx along the last dim of a dense, non-empty ``y`` and a ``dy`` strided as it (same
    dtype, where kernels run), planned by shape (no row views)."""
    dx = torch.empty_like(y)
    key = (y.shape, y.dtype, y.device, y.data_ptr() % 16, dy.data_ptr() % 16, log)
    launch = _dense_bwd_plans.get(key)
    if launch is None:
        n = y.shape[-1]
        launch = _dense_bwd_plans.put(
            key, plan_bwd(y.view(-1, n), dy.view(-1, n), dx.view(-1, n), log)
        )
    launch(y, dy, dx)
    return dx


def _softmax_bwd_fake(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    _check_bwd(y, dy, dim)
    return _empty_rows(y.reshape(1), 0)[0].reshape(()) if y.dim() == 0 else _empty_rows(y, dim)[0]


def _bwd_setup_context(ctx, args, output) -> None:  # type: ignore[no-untyped-def]
    # (args: _softmax_backward's arguments by name, from Op)
    ctx.save_for_backward(args.y, args.dy)
    ctx.dim, ctx.log = args.dim, args.log


def _bwd_backward(ctx, ddx):  # type: ignore[no-untyped-def]
    """Second derivatives: the backward's own derivative, in torch ops (so differentiable again),
    fp32 for 16-bit tensors. With ``p = e^y`` and ``S = Σ dy`` for log_softmax
    (``dx = dy − p·S``), and ``c = Σ dy·y`` for softmax (``dx = y·(dy − c)``), along ``dim``::

        log_softmax:  ∂/∂dy = ddx − Σ ddx·p            ∂/∂y = −ddx·p·S
        softmax:      ∂/∂dy = y·(ddx − Σ ddx·y)        ∂/∂y = ddx·(dy − c) − dy·Σ ddx·y
    """
    y, dy = ctx.saved_tensors
    dim = ctx.dim
    wide = torch.promote_types(y.dtype, torch.float32)
    yf, dyf, ddxf = y.to(wide), dy.to(wide), ddx.to(wide)
    if ctx.log:
        p = yf.exp()
        g_dy = ddxf - (ddxf * p).sum(dim, keepdim=True)
        g_y = -ddxf * p * dyf.sum(dim, keepdim=True)
    else:
        ddx_y = (ddxf * yf).sum(dim, keepdim=True)
        g_dy = yf * (ddxf - ddx_y)
        g_y = ddxf * (dyf - (dyf * yf).sum(dim, keepdim=True)) - dyf * ddx_y
    return g_y.to(y.dtype), g_dy.to(dy.dtype), None, None


#: ``flashlite::softmax_bwd``: dx from the saved output and dy, differentiable again.
SOFTMAX_BWD = Op(
    "softmax_bwd",
    _softmax_backward,
    fake=_softmax_bwd_fake,
    inputs=2,
    setup_context=_bwd_setup_context,
    backward=_bwd_backward,
)


def _setup_context(ctx, args, output) -> None:  # type: ignore[no-untyped-def]
    # (args: _softmax_forward's arguments by name, from Op)
    ctx.save_for_backward(output)
    ctx.dim, ctx.log = args.dim, args.log


def _backward(ctx, dy):  # type: ignore[no-untyped-def]
    (y,) = ctx.saved_tensors
    return SOFTMAX_BWD(y, dy, ctx.dim, ctx.log), None, None, None


#: ``flashlite::softmax_fwd``: softmax or log_softmax along ``dim``, with autograd.
SOFTMAX_FWD = Op(
    "softmax_fwd",
    _softmax_forward,
    fake=_softmax_fwd_fake,
    inputs=1,
    setup_context=_setup_context,
    backward=_backward,
)


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
    return SOFTMAX_FWD(x, _check(x, dim, algorithm), algorithm, False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, computed as ``(x − m) − log s`` (no log of 0).

    Args, returns and errors as :func:`softmax`. A row that is entirely −inf gives NaN.
    """
    return SOFTMAX_FWD(x, _check(x, dim, algorithm), algorithm, True)
