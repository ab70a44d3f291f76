"""What every backend reads: when TMA descriptors pay
and can read a tensor, where the Hopper (Gluon) kernels apply and with which tile, the precision
flags, and the backward's preprocess (delta, Qs), which every backward runs first."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashlite import _backend, _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import bwd as KB
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB

#: packed sequences as the launchers take them: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#: max_seqlen_k)``
Varlen = tuple[torch.Tensor, torch.Tensor, int, int]


#: Problems with fewer multiply-adds than this (``B·Hq·Nq·Nk·D``) load through pointers. Tensor
#: descriptors cost host time on every call (built in Python, then encoded by the launcher:
#: about 35 µs per call on the H200 with Triton 3.6), more than TMA saves on a small problem;
#: from about a billion multiply-adds the kernel runs long enough for TMA to pay.
DESC_MIN_WORK = 1 << 30


def small_problem(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Too little work for TMA descriptors to pay (fewer than :data:`DESC_MIN_WORK`
    multiply-adds ``B·Hq·Nq·Nk·D`` for ``(B, H, N, D)`` views): pointer loads."""
    b, hq, nq, d = q.shape
    return b * hq * nq * k.shape[2] * d < DESC_MIN_WORK


def descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a CUDA tensor, unit stride along D, 16-byte aligned base and strides."""
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
            return False
    return True


def empty_output(
    q: torch.Tensor, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> torch.Tensor:
    """``O`` for ``q`` (``b h n d`` view): dense in the order of q's strides, so it keeps q's
    layout (``b n h d`` too, also for slices of a packed qkv buffer); in ``dtype`` where given
    (FP8 inputs), else q's; with ``head_dim`` columns where given (V's own head dim)."""
    if head_dim is None and (q.is_contiguous() or q.transpose(1, 2).is_contiguous()):
        return torch.empty_like(q, dtype=dtype)  # the usual layouts, quickly
    shape = [*q.shape[:3], q.shape[3] if head_dim is None else head_dim]
    order = sorted(range(4), key=lambda i: -q.stride(i))
    o = q.new_empty([shape[i] for i in order], dtype=dtype)
    return o.permute([order.index(i) for i in range(4)])


def empty_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: object,
) -> None:
    """The forward with nothing to compute (no row, or no key at all): every row sees nothing
    but its sink (``request.sinks``, fp32 ``(Hq,)``, or none)."""
    o.zero_()
    sinks = request.sinks  # type: ignore[attr-defined]
    if sinks is not None:
        lse.copy_(sinks.view(1, -1, 1).expand(lse.shape))
    else:
        lse.fill_(-math.inf)


#: ``FLASHLITE_HOPPER_KERNEL=0`` keeps every forward on the Triton kernel (A/B runs, debugging).
HOPPER_ENV = "FLASHLITE_HOPPER_KERNEL"

#: The raw ``FLASHLITE_HOPPER_KERNEL`` and ``FLASHLITE_ATTENTION_CONFIG`` as one tuple: the
#: switches that choose a forward's kernels, read for every forward plan's key.
kernel_switches = _backend.env_reader(HOPPER_ENV, C.PIN_ENV)


def hopper_config(q: torch.Tensor, n_keys: int) -> KH.HopperConfig | None:
    """The Gluon kernel's config for a plain forward of ``q`` ``(B, H, N, D)`` over ``n_keys``
    keys, or None where it does not apply: not a CUDA sm_90 device, not fp16/bf16, a head dim
    without a measured entry (:data:`~flashlite.kernels.attention.hopper.CONFIGS`) or fewer
    keys than the entry's ``min_keys``, no Gluon in this Triton, a config pinned through the
    environment, or ``FLASHLITE_HOPPER_KERNEL=0``."""
    if not _on_hopper(q, KH.available()):
        return None
    return hopper_entry(q.dtype, q.shape[-1], n_keys)


def _on_hopper(t: torch.Tensor, gluon_ok: bool) -> bool:
    """Whether ``t`` lives on a compiled (not interpreted) CUDA sm_90 device and this Triton
    can build the Gluon kernel in question (``gluon_ok``)."""
    if t.device.type != "cuda" or _backend.kernels_interpreted() or not gluon_ok:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _backend.capability(index)[0] == 9


def hopper_bwd_applies(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> bool:
    """Whether a plain backward (causal or not, GQA; no window, soft cap, per-batch lengths or
    packed sequences: the caller checks those) of these ``(B, H, N, D)`` tensors takes the fused
    Gluon kernel (:mod:`flashlite.kernels.attention.hopper_bwd`): a CUDA sm_90 device with
    Gluon, 16-bit inputs, a head dim in its ``HEAD_DIMS``, tensors TMA can read, gradients with
    a unit last stride, ``FLASHLITE_HOPPER_KERNEL`` not ``0``, and deterministic algorithms not
    requested (``torch.use_deterministic_algorithms``): its dQ is summed by atomic reductions
    in no fixed order, so there the two Triton kernels run instead."""
    if qs.dtype not in (torch.float16, torch.bfloat16) or qs.shape[-1] not in KHB.HEAD_DIMS:
        return False
    if v.shape[-1] != qs.shape[-1]:  # (V with a head dim of its own: the Triton kernels)
        return False
    if torch.are_deterministic_algorithms_enabled() or _backend.getenv(HOPPER_ENV) == "0":
        return False
    units = dk.stride(-1) == 1 and dv.stride(-1) == 1
    return _on_hopper(qs, KHB.available()) and descriptor_ok(qs, k, v, do) and units


def hopper_entry(dtype: torch.dtype, head_dim: int, n_keys: int) -> KH.HopperConfig | None:
    """The rule :func:`hopper_config` and :func:`gpu_config` share, from the problem alone: a
    16-bit problem whose head dim has a measured entry and at least its ``min_keys`` keys, with
    no config pinned and the kernel not switched off."""
    if dtype not in (torch.float16, torch.bfloat16) or C.pinned_text():
        return None
    if _backend.getenv(HOPPER_ENV) == "0":
        return None
    config = KH.CONFIGS.get(head_dim)
    return config if config is not None and n_keys >= config.min_keys else None


def hopper_launch_config(config: KH.HopperConfig) -> C.Config:
    """How launches of the Gluon kernel are reported (``LaunchInfo``, the traffic tools): its
    tiles, its 4-warp consumers and ring slots, ``warp_specialize`` on."""
    return C.Config(config.block_m, config.block_n, 4, config.stages, warp_specialize=True)


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """The attention kernels' precision constexprs for inputs of ``dtype``: fp32 operands for
    ``tl.dot`` where the backend needs them (the interpreter's bf16), three TF32 passes for fp32
    inputs (about fp32 accuracy on tensor cores), and the store-side bf16 rounding."""
    return {
        "DOT_FP32": _backend.dot_upcast(dtype),
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(dtype),
    }


def prescales_q(q: torch.Tensor) -> bool:
    return q.dtype != torch.float32  # as the forward computed the scores


def plan_preprocess(
    o: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    delta: torch.Tensor,
    q: torch.Tensor,
    qs: torch.Tensor,
    scale: float,
    acc: torch.Tensor | None = None,
    prescale_q: bool | None = None,
) -> Callable[..., None]:
    """``run(o, do, dlse, delta, q, qs, acc=None)`` for tensors of these kinds (``dlse`` dense
    fp32 or None): :func:`bwd_preprocess` into ``delta`` (and ``qs``), and, where ``acc`` is
    given (the fused kernel's dense fp32 dQ accumulator), zeros into it; its launch bound
    once. ``prescale_q``: write ``qs`` (default: for 16-bit inputs, as the forward prescaled
    them; False: delta only)."""
    b, hq, nq, dv = o.shape
    d = q.shape[3]
    bm = 64 if max(d, dv) <= 128 else 32
    grid = (C.cdiv(nq, bm), b * hq, 1)
    tail = (*o.stride(), *do.stride(), *q.stride(), *qs.stride(), hq, nq, scale)
    options = {
        "HEAD_DIM": d,
        "BLOCK_D": C.block_d(d),
        "BLOCK_M": bm,
        "HAS_DLSE": dlse is not None,
        "PRESCALE_Q": prescales_q(q) if prescale_q is None else prescale_q,
        "ROUND_BF16": _backend.round_bf16(q.dtype),
        "ZERO_ACC": acc is not None,
        "num_warps": 4,
        "num_stages": 1,
    }
    if dv != d:  # O's and dO's head dim, V's own
        options |= {"HEAD_DIM_V": dv, "BLOCK_DV": C.block_d(dv)}
    args = (
        o,
        do,
        dlse if dlse is not None else delta,
        delta,
        q,
        qs,
        acc if acc is not None else delta,
        *tail,
    )
    bound = _launch.launcher(KB._attention_bwd_preprocess_kernel).bind(args, options)

    def run(
        o: torch.Tensor,
        do: torch.Tensor,
        dlse: torch.Tensor | None,
        delta: torch.Tensor,
        q: torch.Tensor,
        qs: torch.Tensor,
        acc: torch.Tensor | None = None,
    ) -> None:
        bound(
            grid,
            o,
            do,
            dlse if dlse is not None else delta,
            delta,
            q,
            qs,
            acc if acc is not None else delta,
            *tail,
        )

    return run


def bwd_preprocess(
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    qs: torch.Tensor,
    scale: float,
    *,
    prescale_q: bool | None = None,
) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse``: fp32 ``(B, Hq, Nq)`` from ``(B, Hq, Nq, D)`` O, dO;
    for 16-bit inputs also ``qs = Q·scale·log2 e`` rounded as the forward rounded it (``qs`` is
    ``q`` itself for fp32, and not written; ``prescale_q=False``: never written, delta only)."""
    # an expanded or strided dlse (autograd may hand one over) is made dense here, O(N)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    delta = torch.empty(o.shape[:3], device=o.device, dtype=torch.float32)
    plan_preprocess(o, do, dlse, delta, q, qs, scale, prescale_q=prescale_q)(
        o, do, dlse, delta, q, qs
    )
    return delta
