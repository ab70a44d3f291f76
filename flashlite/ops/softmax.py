"""Row softmax and log_softmax: validation, layouts, dispatch, custom ops and autograd.

The kernels live in :mod:`flashlite.kernels.softmax`; this module picks one for the shape, hands it
a 2-D strided view of the rows (no copy when the layout allows one) and registers
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
from flashlite.kernels import softmax as K
from flashlite.kernels import softmax_gluon as KG
from flashlite.kernels.configs import cdiv
from flashlite.ops.common import on_compute_device, plain_eager, skip_dispatcher

ALGORITHMS = ("auto", "three_pass", "online")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_LIMIT = 2**31


def _check(x: object, dim: object, algorithm: object) -> int:
    """Validate the public arguments; return ``dim`` as a non-negative index."""
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


def _col_int64(n_cols: int, *tensors: torch.Tensor) -> bool:
    """Whether column offsets (col·stride) can pass 2^31 and need 64-bit arithmetic."""
    return any((n_cols - 1) * abs(t.stride(1)) >= _INT32_LIMIT for t in tensors)


def softmax_fwd(x2: torch.Tensor, y2: torch.Tensor, log: bool, algorithm: str = "auto") -> None:
    """Launch the forward kernel for ``algorithm`` on the ``(rows, n)`` views ``x2 → y2``.

    Both views live where kernels run (no checks, no autograd, no device moves). ``algorithm``
    also takes the kernel names ``"single_read"``, ``"split"``, ``"team"`` (GPU) and
    ``"prefetch"`` (GPU with Gluon) that ``"auto"`` chooses from.
    """
    n_rows, n_cols = x2.shape
    dev = x2.device
    col64 = _col_int64(n_cols, x2, y2)
    strides = (*x2.stride(), *y2.stride())
    flags = {"LOG": log, "COL_INT64": col64, "ROUND_BF16": _backend.round_bf16(y2.dtype)}
    if algorithm == "auto":
        if n_cols > KG.SINGLE_READ_WINS[x2.element_size()] and prefetch_applies(x2, y2):
            prefetch_fwd(x2, y2, log)  # (checked: not again below)
            return
        if K.fits_single_read(n_cols, x2.element_size()):
            algorithm = "single_read"
        elif dev.type == "cuda" and _backend.teams_fit(
            K.team_config(n_cols, x2.element_size())["n_chunks"], dev
        ):  # the interpreter runs only single-program teams: CPU takes split
            algorithm = "team"
        else:
            algorithm = "split"
    if algorithm == "single_read":
        cfg = K.single_read_config(n_cols, x2.element_size())
        grid = (cdiv(n_rows, cfg["ROWS"]),)
        kernel = _backend.launcher(K._softmax_single_read_fwd_kernel)
        kernel[grid](x2, y2, n_rows, n_cols, *strides, **flags, **cfg)
    elif algorithm == "split":
        cfg = K.split_config(n_cols)
        n_chunks = cfg.pop("n_chunks")
        m_ws = torch.empty((n_rows, n_chunks), device=dev, dtype=torch.float32)
        s_ws = torch.empty_like(m_ws)
        grid = (n_rows * n_chunks,)
        K._softmax_split_stats_kernel[grid](x2, m_ws, s_ws, n_rows, n_cols, *x2.stride(),
                                            n_chunks, BLOCK_N=cfg["BLOCK_N"], COL_INT64=col64,
                                            num_warps=cfg["num_warps"])  # fmt: skip
        K._softmax_split_write_kernel[grid](x2, y2, m_ws, s_ws, n_rows, n_cols, *strides,
                                            n_chunks, **flags, **cfg)  # fmt: skip
    elif algorithm == "team":
        _team_fwd(x2, y2, flags)
    elif algorithm == "prefetch":
        if not prefetch_applies(x2, y2):
            raise ValueError("the prefetch kernel needs a GPU with Gluon and 16-byte aligned rows")
        prefetch_fwd(x2, y2, log)
    elif algorithm in ("online", "three_pass"):  # one program per row, looping over tiles
        cfg = K.loop_config(n_cols)
        del cfg["ROWS"]
        K._softmax_online_fwd_kernel[(n_rows,)](x2, y2, n_rows, n_cols, *strides,
                                                THREE_PASS=algorithm == "three_pass", **flags,
                                                **cfg)  # fmt: skip
    else:
        raise ValueError(f"algorithm={algorithm!r} is not a softmax kernel")


def _team_fwd(x2: torch.Tensor, y2: torch.Tensor, flags: dict[str, bool]) -> None:
    """Launch the team kernel: co-resident programs that share each row and wait for each
    other."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    cfg = K.team_config(n_cols, x2.element_size())
    n_chunks = cfg.pop("n_chunks")
    m_ws = torch.empty((n_rows, n_chunks), device=dev, dtype=torch.float32)
    s_ws = torch.empty_like(m_ws)
    count = torch.zeros(n_rows, device=dev, dtype=torch.int32)
    args = [x2, y2, m_ws, s_ws, count, n_rows, n_cols, *x2.stride(), *y2.stride(), n_chunks]
    _backend.launch_teams(K._softmax_team_fwd_kernel, args, {**flags, **cfg}, n_chunks, n_rows,
                          dev)  # fmt: skip


def prefetch_applies(x2: torch.Tensor, y2: torch.Tensor) -> bool:
    """Whether the Gluon prefetching team kernel can run on the ``(rows, n)`` views: a CUDA
    device of compute capability 8.0+ with Gluon, columns contiguous, rows and pointers
    aligned to 16 bytes (every copy moves 16), and teams that fit."""
    if x2.device.type != "cuda" or not KG.available():
        return False
    if _backend.capability(x2.device.index or 0)[0] < 8:
        return False
    n_rows, n_cols = x2.shape
    vec = 16 // x2.element_size()
    for t in (x2, y2):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (n_rows > 1 and t.stride(0) % vec):
            return False
    cfg = KG.prefetch_config(n_cols, x2.element_size())
    return (
        n_cols % vec == 0
        and cfg["n_chunks"] <= KG.MAX_CHUNKS
        and _backend.teams_fit(cfg["n_chunks"], x2.device)
    )


def prefetch_plan(
    x2: torch.Tensor, words_per_chunk: int = 1, cfg: KG.PrefetchConfig | None = None,
    control: int = 0,
) -> tuple[dict, int, int]:  # fmt: skip
    """What every launch of a prefetching team kernel on the ``(rows, n)`` view ``x2`` needs:
    its launch options, the programs per row, and how many int64 words its workspace holds
    (:func:`prefetch_words`): ``words_per_chunk`` per (row, chunk), row-major, then
    ``control`` more."""
    opts = KG.prefetch_config(x2.shape[1], x2.element_size(), cfg)
    n_chunks = opts.pop("n_chunks")
    return opts, n_chunks, x2.shape[0] * n_chunks * words_per_chunk + control


def prefetch_words(size: int, device: torch.device) -> torch.Tensor:
    """A team kernel's workspace of ``size`` int64 words, all −1: nothing published yet."""
    return torch.full((size,), -1, device=device, dtype=torch.int64)


def prefetch_fwd(x2: torch.Tensor, y2: torch.Tensor, log: bool,
                  cfg: KG.PrefetchConfig | None = None) -> None:  # fmt: skip
    """Launch the Gluon team kernel that prefetches each program's next row into shared
    memory (:mod:`flashlite.kernels.softmax_gluon`)."""
    n_rows, n_cols = x2.shape
    opts, n_chunks, size = prefetch_plan(x2, 1, cfg)
    words = prefetch_words(size, x2.device)
    vec = opts["VEC"]  # lengths and strides in 16-byte vectors (prefetch_applies checked)
    args = [x2, y2, words, n_rows, n_cols // vec, x2.stride(0) // vec, y2.stride(0) // vec,
            n_chunks]  # fmt: skip
    _backend.launch_teams(KG._softmax_prefetch_team_kernel, args, {"LOG": log, **opts},
                          n_chunks, n_rows, x2.device)  # fmt: skip


def softmax_bwd(y2: torch.Tensor, dy2: torch.Tensor, dx2: torch.Tensor, log: bool) -> None:
    """Launch the backward kernel on ``(rows, n)`` views: ``dx2`` from saved ``y2`` and ``dy2``."""
    n_rows, n_cols = y2.shape
    # y and dy both stay on chip as fp32: a 16-bit row of 64k (128k values, 512 KB) spilled and
    # ran at 0.33x the copy ceiling on the H200, where the two-pass loop ran fp32's at 0.61x
    one_tile = K.fits_single_read(n_cols, y2.element_size(), tensors=2)
    cfg = K.single_read_config(n_cols, y2.element_size()) if one_tile else K.loop_config(n_cols)
    _backend.launcher(K._softmax_bwd_kernel)[(cdiv(n_rows, cfg["ROWS"]),)](
        y2, dy2, dx2, n_rows, n_cols, *y2.stride(), *dy2.stride(), *dx2.stride(), LOG=log,
        ONE_TILE=one_tile, COL_INT64=_col_int64(n_cols, y2, dy2, dx2),
        ROUND_BF16=_backend.round_bf16(dx2.dtype), **cfg,
    )  # fmt: skip


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


# ----------------------------------------------------------------------------- custom ops
def _softmax_forward(x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:
    if x.dim() == 0:  # one value: a row of one
        return _softmax_forward(x.reshape(1), 0, algorithm, log).reshape(())
    y, y2 = _empty_rows(x, dim)
    if x.numel():
        softmax_fwd(_row_view(x, dim), y2, log, algorithm)
    return y


_softmax_fwd_op_body = on_compute_device(_softmax_forward)
_softmax_fwd_op = torch.library.custom_op("flashlite::softmax_fwd", mutates_args=())(
    _softmax_fwd_op_body
)


@_softmax_fwd_op.register_fake
def _(x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:
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
    _check_bwd(y, dy, dim)
    if y.dim() == 0:
        return _softmax_backward(y.reshape(1), dy.reshape(1), 0, log).reshape(())
    dx, dx2 = _empty_rows(y, dim)
    if y.numel():
        softmax_bwd(_row_view(y, dim), _row_view(dy.to(y.dtype), dim), dx2, log)
    return dx


_softmax_bwd_op_body = on_compute_device(_softmax_backward)
_softmax_bwd_op = torch.library.custom_op("flashlite::softmax_bwd", mutates_args=())(
    _softmax_bwd_op_body
)


@_softmax_bwd_op.register_fake
def _(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    _check_bwd(y, dy, dim)
    return _empty_rows(y.reshape(1), 0)[0].reshape(()) if y.dim() == 0 else _empty_rows(y, dim)[0]


def _bwd_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    y, dy, dim, log = inputs
    ctx.save_for_backward(y, dy)
    ctx.dim, ctx.log = dim, log


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


_softmax_bwd_op.register_autograd(_bwd_backward, setup_context=_bwd_setup_context)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    _, dim, _, log = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.log = dim, log


def _backward(ctx, dy, bwd=None):  # type: ignore[no-untyped-def]
    """The gradient of x through ``bwd`` (default: the op)."""
    (y,) = ctx.saved_tensors
    return (bwd or _SOFTMAX_BWD)(y, dy, ctx.dim, ctx.log), None, None, None


_softmax_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_SOFTMAX_FWD = torch.ops.flashlite.softmax_fwd.default
_SOFTMAX_BWD = torch.ops.flashlite.softmax_bwd.default


class SoftmaxFunction(torch.autograd.Function):
    """Eager autograd of softmax and log_softmax around the ops' bodies: the same forward, saved
    output and backward as the custom ops' autograd, without the dispatcher's autograd wrapper
    and redispatch (about 50 µs of host time per forward + backward here, several times the
    kernels' time at small shapes). Traced and observed calls take the ops (:func:`plain_eager`).
    """

    @staticmethod
    def forward(ctx, x, dim, algorithm, log):  # type: ignore[no-untyped-def, override]
        y = _softmax_fwd_op_body(x, dim, algorithm, log)
        _setup_context(ctx, (x, dim, algorithm, log), y)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        # create_graph: the op, which refuses a second derivative; else its body
        return _backward(ctx, dy, _SOFTMAX_BWD if torch.is_grad_enabled() else _softmax_bwd_op_body)


def _forward(x: torch.Tensor, dim: int, algorithm: str, log: bool) -> torch.Tensor:
    """The cheapest correct path: the op's body when nothing records or traces, the autograd
    function when only autograd records, the custom op otherwise."""
    if skip_dispatcher(x):  # the op's own body, minus the dispatcher's host cost
        return _softmax_fwd_op_body(x, dim, algorithm, log)
    if plain_eager(x):
        return SoftmaxFunction.apply(x, dim, algorithm, log)
    return _SOFTMAX_FWD(x, dim, algorithm, log)


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
    return _forward(x, _check(x, dim, algorithm), algorithm, False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto") -> torch.Tensor:
    """``log(softmax(x))`` along ``dim``, computed as ``(x − m) − log s`` (no log of 0).

    Args, returns and errors as :func:`softmax`. A row that is entirely −inf gives NaN.
    """
    return _forward(x, _check(x, dim, algorithm), algorithm, True)
