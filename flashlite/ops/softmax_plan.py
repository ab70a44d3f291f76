"""Row softmax's launches on ``(rows, n)`` views: the kernel for a row (:func:`softmax_kernel_for`,
:func:`row_plan`) and the forward and backward launches, each planned once per kind of views
(:func:`plan_fwd`, :func:`plan_bwd`) and run by :func:`softmax_fwd` and :func:`softmax_bwd`.

The views live where kernels run: no checks, no autograd, no device moves here
(:mod:`flashlite.ops.softmax` owns those).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashlite import _backend, _launch, _teams
from flashlite._caches import Cache
from flashlite.kernels import softmax as K
from flashlite.kernels import softmax_gluon as KG
from flashlite.kernels.configs import cdiv
from flashlite.ops.prefetch import plan_prefetch, prefetch_applies

_INT32_LIMIT = 2**31


def _col_int64(n_cols: int, *tensors: torch.Tensor) -> bool:
    """Whether column offsets (col·stride) can pass 2^31 and need 64-bit arithmetic."""
    return any((n_cols - 1) * abs(t.stride(1)) >= _INT32_LIMIT for t in tensors)


def softmax_kernel_for(
    n_cols: int, elem_bytes: int, device: torch.device, prefetch_ok: bool = False
) -> str:
    """The kernel ``algorithm="auto"`` runs for rows of ``n_cols`` values of ``elem_bytes``
    bytes on ``device`` (``prefetch_ok``: :func:`prefetch_applies` holds for the views): the
    one decision, read by the launcher and by :mod:`flashlite.traffic` alike."""
    if prefetch_ok and n_cols > KG.SINGLE_READ_WINS[elem_bytes]:
        return "prefetch"
    if K.fits_single_read(n_cols, elem_bytes):
        return "single_read"
    if device.type == "cuda" and _teams.teams_fit(
        K.team_config(n_cols, elem_bytes)["n_chunks"], device
    ):  # the interpreter runs only single-program teams: CPU takes split
        return "team"
    return "split"


@dataclass(frozen=True)
class RowPlan:
    """A softmax forward's plan as data: the kernel and its launch config (tile, warps, and
    ``n_chunks``, the programs that share a row, for the kernels that split one), read by the
    launcher (:func:`plan_fwd`) and by :mod:`flashlite.traffic` alike."""

    kernel: str
    config: dict

    @property
    def chunks(self) -> int:
        """Programs per row (1 for the kernels that keep a row in one program)."""
        return int(self.config.get("n_chunks", 1))

    @property
    def num_warps(self) -> int:
        return int(self.config["num_warps"])


def row_plan(
    n_cols: int,
    elem_bytes: int,
    device: torch.device,
    algorithm: str = "auto",
    prefetch_ok: bool = False,
) -> RowPlan:
    """The :class:`RowPlan` of rows of ``n_cols`` values of ``elem_bytes`` bytes on ``device``:
    ``algorithm``'s kernel (``"auto"``: :func:`softmax_kernel_for`'s) with its config."""
    kernel = (
        softmax_kernel_for(n_cols, elem_bytes, device, prefetch_ok)
        if algorithm == "auto"
        else algorithm
    )
    if kernel == "single_read":
        cfg = K.single_read_config(n_cols, elem_bytes)
    elif kernel == "split":
        cfg = K.split_config(n_cols)
    elif kernel == "team":
        cfg = K.team_config(n_cols, elem_bytes)
    elif kernel == "prefetch":
        cfg = KG.prefetch_config(n_cols, elem_bytes)
    elif kernel in ("online", "three_pass"):
        cfg = K.loop_config(n_cols)
    else:
        raise ValueError(f"algorithm={algorithm!r} is not a softmax kernel")
    return RowPlan(kernel, dict(cfg))


#: The forward and backward launches per kind of ``(rows, n)`` views (shape, strides, dtype,
#: device, alignment) and options: every decision taken once.
_fwd_plans = Cache("softmax.fwd", 512)
_bwd_plans = Cache("softmax.bwd", 512)

Launch = Callable[..., None]


def softmax_fwd(x2: torch.Tensor, y2: torch.Tensor, log: bool, algorithm: str = "auto") -> None:
    """Launch the forward kernel for ``algorithm`` on the ``(rows, n)`` views ``x2 → y2``.

    Both views live where kernels run (no checks, no autograd, no device moves). ``algorithm``
    also takes the kernel names ``"single_read"``, ``"split"``, ``"team"`` (GPU) and
    ``"prefetch"`` (GPU with Gluon) that ``"auto"`` chooses from (:func:`softmax_kernel_for`).
    The launch is planned once per kind of views (:func:`plan_fwd`).
    """
    key = (
        x2.shape,
        x2.stride(),
        y2.stride(),
        x2.dtype,
        x2.device,
        x2.data_ptr() % 16,
        y2.data_ptr() % 16,
        log,
        algorithm,
    )
    launch = _fwd_plans.get(key)
    if launch is None:
        launch = _fwd_plans.put(key, plan_fwd(x2, y2, log, algorithm))
    launch(x2, y2)


def plan_fwd(x2: torch.Tensor, y2: torch.Tensor, log: bool, algorithm: str = "auto") -> Launch:
    """``launch(x2, y2)`` for views specialised as these are: the kernel, config, grid and
    bound launches decided here, once; only workspaces are allocated per call. Holds no
    tensor."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    col64 = _col_int64(n_cols, x2, y2)
    strides = (*x2.stride(), *y2.stride())
    flags = {"LOG": log, "COL_INT64": col64, "ROUND_BF16": _backend.round_bf16(y2.dtype)}
    prefetch_ok = (
        algorithm == "auto"
        and n_cols > KG.SINGLE_READ_WINS[x2.element_size()]
        and prefetch_applies(x2, y2)
    )
    plan = row_plan(n_cols, x2.element_size(), dev, algorithm, prefetch_ok)
    algorithm, cfg = plan.kernel, dict(plan.config)
    if algorithm == "single_read":
        grid = (cdiv(n_rows, cfg["ROWS"]), 1, 1)
        rest = (n_rows, n_cols, *strides)
        bound = _launch.launcher(K._softmax_single_read_fwd_kernel).bind(
            (x2, y2, *rest), {**flags, **cfg}
        )
        return lambda x, y: bound(grid, x, y, *rest)
    if algorithm == "split":
        n_chunks = cfg.pop("n_chunks")
        grid = (n_rows * n_chunks, 1, 1)
        ws = (n_rows, n_chunks)
        stats_opts = {"BLOCK_N": cfg["BLOCK_N"], "COL_INT64": col64, "num_warps": cfg["num_warps"]}
        m0 = torch.empty(ws, device=dev, dtype=torch.float32)
        stats = _launch.launcher(K._softmax_split_stats_kernel).bind(
            (x2, m0, m0, n_rows, n_cols, *x2.stride(), n_chunks), stats_opts
        )
        write = _launch.launcher(K._softmax_split_write_kernel).bind(
            (x2, y2, m0, m0, n_rows, n_cols, *strides, n_chunks), {**flags, **cfg}
        )
        x_strides = x2.stride()

        def split(x: torch.Tensor, y: torch.Tensor) -> None:
            m_ws = torch.empty(ws, device=dev, dtype=torch.float32)
            s_ws = torch.empty(ws, device=dev, dtype=torch.float32)
            stats(grid, x, m_ws, s_ws, n_rows, n_cols, *x_strides, n_chunks)
            write(grid, x, y, m_ws, s_ws, n_rows, n_cols, *strides, n_chunks)

        return split
    if algorithm == "team":
        return _plan_team(x2, y2, flags, cfg)
    if algorithm == "prefetch":
        if not prefetch_applies(x2, y2):
            raise ValueError("the prefetch kernel needs a GPU with Gluon and 16-byte aligned rows")
        return plan_prefetch(x2, y2, log)
    if algorithm in ("online", "three_pass"):  # one program per row, looping over tiles
        del cfg["ROWS"]
        rest = (n_rows, n_cols, *strides)
        bound = _launch.launcher(K._softmax_online_fwd_kernel).bind(
            (x2, y2, *rest), {"THREE_PASS": algorithm == "three_pass", **flags, **cfg}
        )
        return lambda x, y: bound((n_rows, 1, 1), x, y, *rest)
    raise AssertionError(f"row_plan gave an unknown kernel {algorithm!r}")


def _plan_team(
    x2: torch.Tensor, y2: torch.Tensor, flags: dict[str, bool], cfg: dict[str, int]
) -> Launch:
    """The team kernel: co-resident programs that share each row and wait for each other."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    n_chunks = cfg.pop("n_chunks")
    ws = (n_rows, n_chunks)
    m0 = torch.empty(ws, device=dev, dtype=torch.float32)
    c0 = torch.zeros(n_rows, device=dev, dtype=torch.int32)
    strides = (*x2.stride(), *y2.stride())
    args = [x2, y2, m0, m0, c0, n_rows, n_cols, *strides, n_chunks]
    bound = _teams.bind_teams(
        K._softmax_team_fwd_kernel, args, {**flags, **cfg}, n_chunks, n_rows, dev
    )

    def team(x: torch.Tensor, y: torch.Tensor) -> None:
        m_ws = torch.empty(ws, device=dev, dtype=torch.float32)
        s_ws = torch.empty(ws, device=dev, dtype=torch.float32)
        count = torch.zeros(n_rows, device=dev, dtype=torch.int32)
        bound(x, y, m_ws, s_ws, count, n_rows, n_cols, *strides, n_chunks)

    return team


def softmax_bwd(y2: torch.Tensor, dy2: torch.Tensor, dx2: torch.Tensor, log: bool) -> None:
    """Launch the backward kernel on ``(rows, n)`` views: ``dx2`` from saved ``y2`` and ``dy2``
    (planned once per kind of views)."""
    key = (
        y2.shape,
        y2.stride(),
        dy2.stride(),
        dx2.stride(),
        y2.dtype,
        y2.device,
        y2.data_ptr() % 16,
        dy2.data_ptr() % 16,
        dx2.data_ptr() % 16,
        log,
    )
    launch = _bwd_plans.get(key)
    if launch is None:
        launch = _bwd_plans.put(key, plan_bwd(y2, dy2, dx2, log))
    launch(y2, dy2, dx2)


def plan_bwd(y2: torch.Tensor, dy2: torch.Tensor, dx2: torch.Tensor, log: bool) -> Launch:
    """``launch(y2, dy2, dx2)`` of the backward kernel for views specialised as these are."""
    n_rows, n_cols = y2.shape
    # y and dy both stay on chip as fp32: a 16-bit row of 64k (128k values, 512 KB) spilled and
    # ran at 0.33x the copy ceiling on the H200, where the two-pass loop ran fp32's at 0.61x
    one_tile = K.fits_single_read(n_cols, y2.element_size(), tensors=2)
    cfg = K.single_read_config(n_cols, y2.element_size()) if one_tile else K.loop_config(n_cols)
    grid = (cdiv(n_rows, cfg["ROWS"]), 1, 1)
    rest = (n_rows, n_cols, *y2.stride(), *dy2.stride(), *dx2.stride())
    options = {
        "LOG": log,
        "ONE_TILE": one_tile,
        "COL_INT64": _col_int64(n_cols, y2, dy2, dx2),
        "ROUND_BF16": _backend.round_bf16(dx2.dtype),
        **cfg,
    }
    bound = _launch.launcher(K._softmax_bwd_kernel).bind((y2, dy2, dx2, *rest), options)
    return lambda y, dy, dx: bound(grid, y, dy, dx, *rest)
