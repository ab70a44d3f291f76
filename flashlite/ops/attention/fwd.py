"""The forward :func:`attention_fwd`: the planner's choice carried out (the split-KV decode kernel,
the tables backend's window, the dense Gluon kernel or the Triton kernel), a call's plan kept
per kind of q, k, v; and the body of the custom op ``flashlite::attention_fwd``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.ops.attention import planner
from flashlite.ops.attention.backends import hopper
from flashlite.ops.attention.backends.common import (
    LaunchInfo,
    empty_output,
    hopper_launch_config,
    kernel_switches,
)
from flashlite.ops.attention.backends.split_kv.decode import attention_decode_fwd, planned_decode
from flashlite.ops.attention.backends.tables.fwd import window_fwd
from flashlite.ops.attention.backends.triton.fwd import run_triton
from flashlite.ops.attention.request import Request
from flashlite.ops.common import on_compute_device


@on_compute_device
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    request: Request,
    *,
    config: C.Config | None = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo | None]:
    """Launch the forward kernel on validated ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hkv, Nk, D)``; any strides, one dtype and device.
        request: the call (:class:`~flashlite.ops.attention.request.Request`): mask, scale,
            lengths, packed sequences, sinks. ``num_splits`` n >= 1 runs
            :func:`attention_decode_fwd` (GQA rows packed, the keys split across n programs per
            row block and merged; not with packed sequences). Sinks are fp32 ``(Hq,)``,
            contiguous: every row of head h starts from the state ``(sinks[h], 1)``.
        config: pin a :class:`~flashlite.kernels.configs.Config` (else :func:`fixed_config` or
            the autotuner chooses).
        use_desc: force descriptor (True) or pointer (False) loads.
        prescale_q: fold the scale into Q (default for 16-bit inputs).

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` strided like ``q``, the fp32 LSE ``(B, Hq, Nq)`` and what the
        launch used (None when nothing was launched). CPU tensors in a process that compiles its
        kernels run on the GPU: moved there once, results moved back.
    """
    pinned = config is not None or use_desc is not None or prescale_q is not None
    scalars = None if pinned else request.scalar_key
    key = None
    if scalars is not None:  # mask scalars only: planned once per kind of call (:data:`_fwd_plans`)
        key = _fwd_key(q, k, v, scalars)
        plan = _fwd_plans.get(key)
        if plan is not None:
            return plan(q, k, v)
    request.refuse("the attention forward", FWD_FIELDS)
    choice = planner.forward(
        q, k, v, request, config=config, use_desc=use_desc, prescale_q=prescale_q
    )
    if choice.backend == "split_kv":
        o, lse, _ = attention_decode_fwd(
            q,
            k,
            v,
            request.seqlens_k,
            request.mask,
            request.scale,
            num_splits=request.num_splits,
            sinks=request.sinks,
        )
        return o, lse, None
    if choice.backend == "tables":
        tile = choice.tile
        km = request.mask.kernel(q.shape[2], k.shape[2])
        o, lse, run = window_fwd(q, k, v, km, request.scale, (tile.block_m, tile.block_n))
        info = LaunchInfo(hopper_launch_config(tile), q.shape[-1], True)
        if key is not None:  # (a window and nothing else: its key is the call's kind)
            _fwd_plans.put(key, _PlannedTables(run, info))
        return o, lse, info
    o = empty_output(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    if choice.backend == "empty":
        return _empty(o, lse, request.sinks)
    if choice.backend == "hopper":
        tile = choice.tile
        causal = request.mask.is_causal
        run = hopper.run_fwd(q, k, v, o, lse, causal, request.scale, tile, request.sinks)
        if run is not None:
            info = LaunchInfo(hopper_launch_config(tile), q.shape[-1], True)
            if key is not None:  # (it built and ran: later calls of this kind go straight to it)
                _fwd_plans.put(key, _Planned(run, q.shape[:3], info))
            return o, lse, info
    o, lse, info, run = run_triton(
        q, k, v, o, lse, request, choice.use_desc, config, prescale_q, key is not None
    )
    if run is not None:  # (bound for later calls of this kind)
        _fwd_plans.put(key, _Planned(run, q.shape[:3], info))
    return o, lse, info


def _empty(
    o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """No rows, or no key at all: every row sees nothing (but its sink)."""
    if sinks is not None:
        return o.zero_(), lse.copy_(sinks.view(1, -1, 1).expand(lse.shape)), None
    return o.zero_(), lse.fill_(-math.inf), None


#: The request fields the forward takes (a cache's are the decode step's).
FWD_FIELDS = Request._fields[:12]


#: The forward's plans per kind of q, k, v (shapes, strides, dtype, device, alignment,
#: the request's mask scalars): what :func:`attention_fwd` decided and bound the first time.
_fwd_plans = Cache("attention.fwd", 1024)


def _fwd_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: tuple) -> tuple:
    """What a planned forward's plan depends on (:data:`_fwd_plans`): shapes, strides, dtype,
    device, each tensor's 16-byte alignment (one flag when all are aligned, the usual case), the
    request's scalars (:attr:`Request.scalar_key`) and the environment's switches
    (``FLASHLITE_HOPPER_KERNEL``, ``FLASHLITE_ATTENTION_CONFIG``)."""
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2]) & 15
    return (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        q.dtype,
        q.device,
        True if aligned else tuple(p % 16 for p in ptrs),
        scalars,
        kernel_switches(),
    )


class _Planned:
    """A planned forward (mask scalars only): allocates ``O`` (in q's layout) and the LSE,
    launches ``run``."""

    def __init__(
        self, run: Callable[..., None], lse_shape: tuple[int, ...], info: LaunchInfo
    ) -> None:
        self.run, self.lse_shape, self.info = run, lse_shape, info

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo]:
        o = empty_output(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.run(q, k, v, o, lse)
        return o, lse, self.info


class _PlannedTables:
    """A planned window forward on the tables backend: the band's flex plan, bound."""

    def __init__(
        self, run: Callable[..., tuple[torch.Tensor, torch.Tensor]], info: LaunchInfo
    ) -> None:
        self.run, self.info = run, info

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo]:
        o, lse = self.run(q, k, v)
        return o, lse, self.info


def attention_fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    # a call of a kind planned before goes straight to its plan (plans exist only for tensors
    # where kernels run, so nothing needs moving)
    scalars = request.scalar_key
    if scalars is not None:
        plan = _fwd_plans.get(_fwd_key(q, k, v, scalars))
        if plan is not None:
            o, lse, _ = plan(q, k, v)
            return o, lse
    if request.num_splits and request.cu_seqlens_q is None:  # the decode kernel, planned
        request.refuse("split-KV decoding", planner.DECODE_FIELDS)
        found = planned_decode(
            q,
            k,
            v,
            request.seqlens_k,
            request.mask,
            request.scale,
            request.num_splits,
            request.sinks,
        )
        if found is not None:
            return found
    o, lse, _ = attention_fwd(q, k, v, request)
    return o, lse


def attention_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)
