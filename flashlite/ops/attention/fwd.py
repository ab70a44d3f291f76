"""The forward launcher :func:`attention_fwd` (the Triton kernel, or on Hopper the Gluon one) and
its custom op ``flashlite::attention_fwd``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _launch
from flashlite._caches import Cache, register
from flashlite.kernels import configs as C
from flashlite.kernels.attention import fwd as K
from flashlite.kernels.attention import hopper as KH
from flashlite.masking import masks
from flashlite.ops.attention import hopper as HP
from flashlite.ops.attention import planner
from flashlite.ops.attention import window as W
from flashlite.ops.attention.decode import attention_decode_fwd, planned_decode
from flashlite.ops.attention.plan import (
    LaunchInfo,
    empty_output,
    fixed_reference,
    hopper_launch_config,
    small_problem,
    triton_plan,
    tuned_kernel,
)
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
    planned = request.plain and not pinned
    key = None
    if planned:  # the plain call: planned once per kind of q, k, v (:data:`_fwd_plans`)
        key = _fwd_key(q, k, v, request)
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
        hopper = choice.tile
        km = request.mask.kernel(q.shape[2], k.shape[2])
        o, lse = W.window_fwd(q, k, v, km, request.scale, (hopper.block_m, hopper.block_n))
        return o, lse, LaunchInfo(hopper_launch_config(hopper), q.shape[-1], True)
    o = empty_output(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    if choice.backend == "empty":
        return _empty(o, lse, request.sinks)
    if choice.backend == "hopper":
        hopper = choice.tile
        causal = request.mask.is_causal
        run = _run_hopper(q, k, v, o, lse, causal, request.scale, hopper, request.sinks)
        if run is not None:
            info = LaunchInfo(hopper_launch_config(hopper), q.shape[-1], True)
            if key is not None:  # (it built and ran: later calls of this kind go straight to it)
                _fwd_plans.put(key, _Planned(run, q.shape[:3], info))
            return o, lse, info
    return _run_triton(q, k, v, o, lse, request, choice.use_desc, config, prescale_q, key)


def _empty(
    o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """No rows, or no key at all: every row sees nothing (but its sink)."""
    if sinks is not None:
        return o.zero_(), lse.copy_(sinks.view(1, -1, 1).expand(lse.shape)), None
    return o.zero_(), lse.fill_(-math.inf), None


def _run_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: Request,
    use_desc: bool,
    config: C.Config | None,
    prescale_q: bool | None,
    key: tuple | None,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo]:
    """The Triton forward kernel: its config (pinned, the measured table or the autotuner),
    bound and kept under ``key`` for a plain call (None: launched once)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    km = request.mask.kernel(nq, nk)
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    small = small_problem(q, k)
    config, launch = triton_plan(
        q.device,
        q.dtype,
        d,
        km.IS_CAUSAL,
        small and not use_desc,
        use_desc,
        prescale_q,
        config,
        km.WINDOW,
        km.SOFTCAP,
        seqlens_k is not None,
        varlen is not None,
        fixed_reference(q.dtype, request.softcap, sinks),
        sinks is not None,
    )
    block_d = launch["BLOCK_D"]
    if use_desc:  # block shapes are set per config (set_block_shapes), placeholders here
        bm, bn = (config.block_m, config.block_n) if config is not None else (16, 16)
        srcs = _descriptors(q, k, v, o, bm, bn, block_d)
        if varlen is not None:  # O is stored through pointers (blocks cross sequences)
            srcs[3] = o
    else:
        srcs = [q, k, v, o]
    args = _kernel_args(srcs, q, k, v, o, lse, km, request)
    # packed sequences: one program row per sequence, as many query blocks as the longest has
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    if config is None:  # no measured entry here: the autotuner, per length bucket
        tuned = tuned_kernel(rows, nk)
        tuned[lambda meta: (C.cdiv(rows, meta["BLOCK_M"]), seqs * hq)](*args, **launch)  # type: ignore[index]
        return o, lse, LaunchInfo(C.Config.of(tuned.best_config), block_d, use_desc)  # type: ignore[attr-defined]
    grid = (C.cdiv(rows, config.block_m), seqs * hq, 1)
    launcher = _launch.launcher(K._attention_fwd_kernel)
    info = LaunchInfo(config, block_d, use_desc)
    if key is None:
        launcher.bind(args, launch)(grid, *args)
        return o, lse, info
    # the plan's launch takes q, k, v, o themselves where its descriptors read them
    bound = launcher.bind_tensors(args, launch)
    tail = args[5:-4]  # strides, sizes, scale, mask values (then four placeholders)

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
    ) -> None:
        bound(grid, q, k, v, o, lse, *tail, lse, lse, lse, lse)

    run(q, k, v, o, lse)
    _fwd_plans.put(key, _Planned(run, q.shape[:3], info))
    return o, lse, info


#: The request fields the forward takes (a cache's are the decode step's).
FWD_FIELDS = Request._fields[:12]


def _kernel_args(
    srcs: list,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    km: masks.KernelMask,
    request: Request,
) -> tuple:
    """The forward kernel's arguments: q, k, v, o (or their descriptors ``srcs``), the LSE,
    strides, sizes, the scale, the mask's values, then lengths, offsets and sinks (the LSE
    stands in for an absent one: never read)."""
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    lengths = seqlens_k if seqlens_k is not None else lse
    offsets = varlen[:2] if varlen is not None else (lse, lse)
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    sizes = (hq, hq // k.shape[1], nq, nk)
    mask = (request.scale, km.left, km.right, km.softcap)
    return (
        *srcs,
        lse,
        *strides,
        *sizes,
        *mask,
        lengths,
        *offsets,
        sinks if sinks is not None else lse,
    )


def _descriptors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    bm: int,
    bn: int,
    block_d: int,
) -> list[TensorDescriptor]:
    """The forward kernel's 4-D TMA descriptors of q, k, v, o (``[1, 1, rows, BLOCK_D]``
    blocks: ``bm`` query rows, ``bn`` keys)."""
    return [
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
        for t, r in ((q, bm), (k, bn), (v, bn), (o, bm))
    ]


#: The plain forward's plans per kind of q, k, v (shapes, strides, dtype, device, alignment,
#: causal, scale): what :func:`attention_fwd` decided and bound the first time.
_fwd_plans = Cache("attention.fwd", 1024)


def _fwd_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request) -> tuple:
    """What a plain forward's plan depends on (:data:`_fwd_plans`): shapes, strides, dtype,
    device, each tensor's 16-byte alignment (one flag when all are aligned, the usual case), and
    the request's key."""
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
        request.key,
    )


class _Planned:
    """A planned plain forward: allocates ``O`` (in q's layout) and the LSE, launches ``run``."""

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


#: Kernel variants whose first launch failed (a Triton whose Gluon differs): the Triton kernel
#: runs them instead, after one warning.
_hopper_failed: set[tuple] = register("attention.hopper_failed", set())


def _run_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    config: KH.HopperConfig,
    sinks: torch.Tensor | None = None,
) -> Callable[..., None] | None:
    """Plan and launch the Gluon kernel: its ``run`` for later calls of this kind, or None
    (after one warning) if it fails to compile here."""
    key = (q.dtype, causal, config, sinks is not None)

    def build() -> Callable[..., None]:
        run = HP.plan_fwd_hopper(q, k, causal, scale, config, sinks is not None)
        run(q, k, v, o, lse, sinks)
        return run

    return HP.first_build(_hopper_failed, key, "attention", build, stacklevel=4)


def attention_fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    # a call of a kind planned before goes straight to its plan (plans exist only for tensors
    # where kernels run, so nothing needs moving)
    if request.plain:
        plan = _fwd_plans.get(_fwd_key(q, k, v, request))
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
