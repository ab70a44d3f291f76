"""The Triton forward kernel's plan: its config (pinned, the measured table or the autotuner), its
arguments (descriptors or pointers), its launch bound once for a call of mask scalars only."""

from __future__ import annotations

import os

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import fwd as K
from flashlite.masking import masks
from flashlite.ops.attention.backends.common import small_problem
from flashlite.ops.attention.backends.triton.config import (
    fixed_reference,
    triton_plan,
    tuned_kernel,
)
from flashlite.ops.attention.plan import LaunchInfo, Plan
from flashlite.ops.attention.request import Request


def plan_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: Request,
    use_desc: bool,
    config: C.Config | None = None,
    prescale_q: bool | None = None,
    bind: bool = False,
) -> Plan:
    """The Triton forward kernel's plan for tensors of these kinds (``o``, ``lse``: a call's
    fresh outputs): its config (pinned, the measured table or, where neither has one, the
    autotuner at the first launch), grid and launch. With ``bind`` (a request of mask scalars
    only, whose plan is kept) the launch is bound here, every argument fixed but the tensors;
    otherwise it builds its arguments per launch."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    km = request.mask.kernel(nq, nk)
    n_major = request.fp8 and fp8_v_n_major(v)
    if n_major:  # (pointer loads, as a descriptor needs unit stride along D; per-call arguments)
        use_desc, bind = False, False
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    small = small_problem(q, k)
    config, options = triton_plan(
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
        o.dtype,
        request.head_dim_v,
    )
    make = _Args(km, use_desc, options["BLOCK_D"], options.get("BLOCK_DV"), n_major)
    # packed sequences: one program row per sequence, as many query blocks as the longest has
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    if config is None:  # no measured entry here: the autotuner, per length bucket
        return _autotuned(make, options, rows, seqs * hq, nk)
    grid = (C.cdiv(rows, config.block_m), seqs * hq, 1)
    launcher = _launch.launcher(K._attention_fwd_kernel)
    info = LaunchInfo(config, make.block_d, use_desc)
    if not bind:  # the arguments built per launch

        def per_call(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
            args = make(q, k, v, o, lse, r, config)
            launcher.bind(args, options)(grid, *args)

        return Plan("triton", per_call, config, use_desc, grid, info=info)
    # one bound launch, which takes q, k, v, o themselves where its descriptors read them
    args = make(q, k, v, o, lse, request, config)
    bound = launcher.bind_tensors(args, options)
    tail = args[5:-9]  # strides, sizes, scale, mask values (then the placeholders)
    rest = args[-9:]  # (the LSE standing in for absent tensors, the descales' zero strides)

    def run(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
        bound(grid, q, k, v, o, lse, *tail, *rest)

    return Plan("triton", run, config, use_desc, grid, info=info)


class _Args:
    """The kernel's arguments for one call: its tensors, or their TMA descriptors."""

    def __init__(
        self,
        km: masks.KernelMask,
        use_desc: bool,
        block_d: int,
        block_dv: int | None = None,
        n_major: bool = False,
    ) -> None:
        self.km, self.use_desc, self.block_d = km, use_desc, block_d
        self.block_dv = block_d if block_dv is None else block_dv
        self.n_major = n_major  # (FP8 on Hopper: V copied keys-contiguous, FLASHLITE_FP8_V)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        request: Request,
        config: C.Config | None,
    ) -> tuple:
        if self.n_major:
            v = v.transpose(2, 3).contiguous().transpose(2, 3)
        if self.use_desc:  # block shapes are set per config (set_block_shapes): placeholders
            bm, bn = (config.block_m, config.block_n) if config is not None else (16, 16)
            srcs = _descriptors(q, k, v, o, bm, bn, self.block_d, self.block_dv)
            if request.varlen is not None:  # O is stored through pointers (blocks cross rows)
                srcs[3] = o
        else:
            srcs = [q, k, v, o]
        return _kernel_args(srcs, q, k, v, o, lse, self.km, request)


#: How the FP8 forward hands V to its ``p·v`` product on Hopper: ``"as-is"`` (default) leaves
#: the layout to Triton, which builds FP8 wgmma for both products either way; ``"n-major"``
#: copies V keys-contiguous first (FP8 wgmma reads its B operand K-major only, and V's K
#: dimension is the keys), which spilled more registers in sm_90 builds.
FP8_V_ENV = "FLASHLITE_FP8_V"


def fp8_v_n_major(v: torch.Tensor) -> bool:
    """Whether the FP8 forward copies V keys-contiguous first: on sm_90 with
    ``$FLASHLITE_FP8_V`` set to ``"n-major"``, and not where it already is."""
    if not v.is_cuda or v.stride(2) == 1 or os.environ.get(FP8_V_ENV) != "n-major":
        return False
    return _backend.capability(v.device.index or 0) >= (9, 0)


def _autotuned(make: _Args, options: dict, rows: int, programs: int, nk: int) -> Plan:
    """The plan where no table has an entry: the autotuner's kernel for this length bucket,
    whose pick (the plan's config) is known from its first launch."""
    tuned = tuned_kernel(rows, nk)

    def autotuned(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
        args = make(q, k, v, o, lse, r, None)
        tuned[lambda meta: (C.cdiv(rows, meta["BLOCK_M"]), programs)](*args, **options)  # type: ignore[index]
        if plan.config is None:
            plan.config = C.Config.of(tuned.best_config)  # type: ignore[attr-defined]
            plan.info = LaunchInfo(plan.config, make.block_d, make.use_desc)

    plan = Plan("triton", autotuned, use_desc=make.use_desc)
    return plan


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
    strides, sizes, the scale, the mask's values, then lengths, offsets, sinks and FP8's
    descale factors with their strides (the LSE stands in for an absent tensor: never read)."""
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    seqlens_k, varlen, sinks = request.seqlens_k, request.varlen, request.sinks
    lengths = seqlens_k if seqlens_k is not None else lse
    offsets = varlen[:2] if varlen is not None else (lse, lse)
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    sizes = (hq, hq // k.shape[1], nq, nk)
    mask = (request.scale, km.left, km.right, km.softcap)
    if request.q_descale is not None:
        descales = (request.q_descale, request.k_descale, request.v_descale)
        descale_strides = request.q_descale.stride()
    else:
        descales, descale_strides = (lse, lse, lse), (0, 0)
    return (
        *srcs,
        lse,
        *strides,
        *sizes,
        *mask,
        lengths,
        *offsets,
        sinks if sinks is not None else lse,
        *descales,
        *descale_strides,
    )


def _descriptors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    bm: int,
    bn: int,
    block_d: int,
    block_dv: int,
) -> list[TensorDescriptor]:
    """The forward kernel's 4-D TMA descriptors of q, k, v, o (``[1, 1, rows, BLOCK_D]``
    blocks: ``bm`` query rows, ``bn`` keys; V's and O's ``block_dv`` columns)."""
    return [
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, cols])
        for t, r, cols in ((q, bm, block_d), (k, bn, block_d), (v, bn, block_dv), (o, bm, block_dv))
    ]
