"""Which backend runs an attention call, and its plan: the forward's and the backward's decision
trees, each read top to bottom, each branch saying why.

A :class:`~flashlite.ops.attention.request.Request` and the tensors' facts (shapes, device,
strides, alignment) go in; a :class:`~flashlite.ops.attention.plan.Plan` comes out: the backend,
its tile, grid, splits and scratch, and its bound launch, which the launchers
(:func:`~flashlite.ops.attention.ops.attention_fwd`,
:func:`~flashlite.ops.attention.ops.attention_bwd`) call and the traffic tools read. A plan made
for one kind of call is kept (:func:`forward`, :func:`backward`) and every later call of that kind
gets it back without walking the tree. The backends:

==============  ==============================================================================
``split_kv``    the decode kernel: few query rows (GQA heads packed), the keys split across
                programs, the partial results merged exactly (:mod:`.backends.split_kv`)
``tables``      flex's Gluon kernels over a block table; the built-in window as its band's
                table (:mod:`.backends.tables`)
``hopper``      the dense Gluon kernels (sm_90; :mod:`.backends.hopper`); a variant that
                fails to build here becomes its Triton plan after one warning
``triton``      the Triton kernels: every option, every GPU and the CPU's interpreter
                (:mod:`.backends.triton`)
``empty``       nothing to compute (no rows, or no keys: rows see only their sinks)
==============  ==============================================================================

Each backend takes only the requests it is written for (:meth:`Request.only`), so a new option
falls to the Triton kernels until a faster one supports it, and is never dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.backends import hopper
from flashlite.ops.attention.backends.common import (
    DESC_MIN_WORK,
    HOPPER_ENV,
    descriptor_ok,
    empty_fwd,
    empty_output,
    hopper_bwd_applies,
    hopper_config,
    hopper_entry,
    hopper_launch_config,
    kernel_switches,
    prescales_q,
    small_problem,
)
from flashlite.ops.attention.backends.common_bwd import empty_bwd
from flashlite.ops.attention.backends.split_kv import decode as split_kv
from flashlite.ops.attention.backends.tables import bwd as tables_bwd
from flashlite.ops.attention.backends.tables import fwd as tables_fwd
from flashlite.ops.attention.backends.triton import bwd as triton_bwd
from flashlite.ops.attention.backends.triton import fwd as triton_fwd
from flashlite.ops.attention.backends.triton.config import GPU_TABLES, table_config
from flashlite.ops.attention.plan import Plan
from flashlite.ops.attention.request import Request, tensor_meta

#: The fields the split-KV path takes (not packed sequences: those run the forward kernel).
DECODE_FIELDS = (
    "scale",
    "causal",
    "window_left",
    "window_right",
    "softcap",
    "seqlens_k",
    "num_splits",
    "sinks",
    "q_descale",
    "k_descale",
    "v_descale",
    "out_dtype",
)

#: The request fields the forward takes (a cache's are the decode step's).
FWD_FIELDS = Request._fields[: Request._fields.index("head_dim_v") + 1]

#: The request fields the backward takes (the split is the forward's alone).
BWD_FIELDS = (
    "causal",
    "scale",
    "window_left",
    "window_right",
    "softcap",
    "seqlens_k",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "sinks",
    "head_dim_v",
)


class Choice(NamedTuple):
    """What runs a call: the backend, whether the kernel loads through TMA descriptors, and the
    Gluon kernels' tile (a forward's :class:`~flashlite.kernels.attention.hopper.HopperConfig`,
    the backward's table block ``(block_m, block_n)``): :func:`dense`'s decision, which
    :func:`forward` turns into the backend's plan and :func:`gpu_config` reads without tensors."""

    backend: str
    use_desc: bool = False
    tile: KH.HopperConfig | tuple[int, int] | None = None


class Facts(NamedTuple):
    """What the forward's tree reads of a call: of its tensors (:meth:`of`, the launcher's) or
    of a GPU it models (:meth:`on_gpu`, the traffic tools'), so both read one decision."""

    #: no query row, or no key (rows then see only their sinks)
    empty: bool
    #: enough work for TMA descriptors to pay: ``B·Hq·Nq·Nk·D`` of at least ``DESC_MIN_WORK``
    tma_pays: bool
    #: tensors TMA can read: on a CUDA device, unit stride along D, 16-byte aligned
    tma_reads: bool
    #: the dense Gluon forward's tile where it builds for this problem (sm_90), else None
    gluon: KH.HopperConfig | None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Facts:
        """The facts of ``(B, H, N, D)`` views on this machine."""
        return cls(
            _nothing(q, k),
            not small_problem(q, k),
            descriptor_ok(q, k, v),
            hopper_config(q, k.shape[2]),
        )

    @classmethod
    def on_gpu(cls, gpu: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> Facts:
        """The facts of a problem ``(B, Hq, Nq, Nk, D)`` of dense, aligned tensors on ``gpu``
        (:data:`GPU_TABLES`: ``"h200"`` runs the Gluon kernels where they apply)."""
        b, hq, nq, nk, d = shape
        work = b * hq * nq * nk * d
        gluon = hopper_entry(dtype, d, nk) if gpu == "h200" else None
        return cls(work == 0, work >= DESC_MIN_WORK, True, gluon)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: Request,
    *,
    config: C.Config | None = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> Plan:
    """The forward's plan for ``(B, H, N, D)`` views (``o``, ``lse``: this call's fresh
    outputs, the templates a new plan binds). ``config``, ``use_desc``, ``prescale_q``: the
    caller's pins, which only the Triton kernel takes; a pinned call's plan is not kept. A
    kind of call planned before (:func:`forward_key`) gets its plan back."""
    pinned = config is not None or use_desc is not None or prescale_q is not None
    key = None if pinned else forward_key(q, k, v, request)
    args = (q, k, v, o, lse, request, config, use_desc, prescale_q, key is not None)
    return _plan_forward(*args) if key is None else _fwd_plans.made(key, _plan_forward, *args)


def _plan_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    request: Request,
    config: C.Config | None,
    use_desc: bool | None,
    prescale_q: bool | None,
    keep: bool,
) -> Plan:
    """The forward's tree: split-KV, else :func:`dense`'s choice, as the backend's plan."""
    request.refuse("the attention forward", FWD_FIELDS)
    if request.num_splits and request.varlen is None:
        # few query rows against many keys: one tile of a GQA group's heads, the keys split
        request.refuse("split-KV decoding", DECODE_FIELDS)
        return split_kv.plan_decode(q, k, v, o, request)
    choice = dense(Facts.of(q, k, v), request, config, use_desc, prescale_q)
    if choice.backend == "tables":
        return tables_fwd.plan_window_fwd(q, k, v, request, choice.tile)  # type: ignore[arg-type]
    if choice.backend == "empty":
        return Plan("empty", empty_fwd)
    if choice.backend == "hopper":
        # its first launch builds it; where this Triton cannot, the Triton kernel's plan
        def fallback() -> Plan:
            return triton_fwd.plan_fwd(q, k, v, o, lse, request, True, bind=keep)

        return hopper.plan_fwd(q, k, request, choice.tile, fallback)  # type: ignore[arg-type]
    pins = (config, prescale_q, keep)
    return triton_fwd.plan_fwd(q, k, v, o, lse, request, choice.use_desc, *pins)


def dense(
    facts: Facts,
    request: Request,
    config: object = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> Choice:
    """The forward's tree past split-KV, from the call's :class:`Facts` alone."""
    pinned = config is not None or use_desc is not None or prescale_q is not None
    if not pinned and not request.plain and request.only("window_left", "window_right"):
        # a window and nothing else: on Hopper, flex's Gluon kernel over the band's tables
        tile = window_fwd_config(facts)
        if tile is not None:
            return Choice("tables", True, tile)
    if facts.empty:
        return Choice("empty")
    if use_desc is None:
        # descriptors cost host time per call: they pay from about a billion multiply-adds
        use_desc = facts.tma_pays and facts.tma_reads
    unpinned = config is None and prescale_q is not False
    if request.only("sinks") and use_desc and unpinned and facts.gluon is not None:
        # plain (or causal, sinks allowed) on sm_90: the dense Gluon kernel, where it builds
        return Choice("hopper", True, facts.gluon)
    return Choice("triton", use_desc)


def gpu_config(
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    causal: bool,
    gpu: str = "h200",
) -> tuple[C.Config, bool]:
    """The tile config a GPU runs for a plain (or causal) forward, known without one: what the
    traffic tools count and model (the interpreter runs any tile), read from :func:`dense`'s
    choice on :meth:`Facts.on_gpu`.

    Args:
        shape: ``(B, Hq, Nq, Nk, D)``.
        dtype: the inputs' dtype.
        causal: the mask.
        gpu: ``"h200"`` or ``"generic"`` (:data:`GPU_TABLES`).

    Returns:
        The config (the pinned one when ``$FLASHLITE_ATTENTION_CONFIG`` is set) and whether that
        GPU loads through tensor descriptors. Where the H200 runs the Gluon kernel, its tiles as
        a ``warp_specialize`` config: the Triton kernel with those tiles issues the same bytes
        (Q and O once, K and V once per 128-row block), so the interpreter counts them.
    """
    if gpu not in GPU_TABLES:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(map(repr, GPU_TABLES))}")
    choice = dense(Facts.on_gpu(gpu, shape, dtype), Request(1.0, causal))  # (scale: no choice)
    if choice.backend == "hopper":
        return hopper_launch_config(choice.tile), True  # type: ignore[arg-type]
    return table_config(shape[4], causal, dtype, choice.use_desc, gpu == "h200"), choice.use_desc


def forward_key(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple | None:
    """The key of a forward's kept plan, or None where none is kept. A request of mask scalars
    only: shapes, strides, dtype, device, each tensor's 16-byte alignment (one flag when all are
    aligned, the usual case), the five scalars and the environment's kernel switches
    (``FLASHLITE_HOPPER_KERNEL``, ``FLASHLITE_ATTENTION_CONFIG``). A split-KV request: every
    tensor's kind and the request's key. Any other (lengths, packing, sinks without splits):
    None, its launch built per call."""
    scalars = request.scalar_key
    if scalars is not None:
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
    if request.num_splits and request.varlen is None and request.only(*DECODE_FIELDS):
        # (its other fields unset: the five scalars, the lengths', the sinks' kinds and splits,
        # FP8's factors (one stride pair for the three) and output dtype)
        lengths, sinks = tensor_meta(request.seqlens_k), tensor_meta(request.sinks)
        metas = (tensor_meta(q), tensor_meta(k), tensor_meta(v), lengths, sinks)
        fp8 = (tensor_meta(request.k_descale), request.out_dtype) if request.fp8 else None
        return ("split_kv", *metas, request[:5], request.num_splits, fp8)
    return None


#: The forward's kept plans (:func:`forward_key`), and the plain backward's (:func:`backward_key`).
_fwd_plans = Cache("attention.fwd", 1024)
_bwd_plans = Cache("attention.bwd", 1024)


def kept_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> Plan | None:
    """The plan kept for a forward of this kind (:func:`forward_key`), else None: what the
    op's body looks up before anything else."""
    key = forward_key(q, k, v, request)
    return None if key is None else _fwd_plans.get(key)


def kept_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> Plan | None:
    """The plan kept for a plain backward of this kind (:func:`backward_key`), else None."""
    return _bwd_plans.get(backward_key(do, q, k, v, o, lse, dlse, request))


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
    *,
    config: C.BwdConfig | None = None,
) -> Plan:
    """The backward's plan (``config``: the caller's pinned tiles, which only the Triton pair
    takes). A plain backward (sinks allowed) is planned once per kind of tensors
    (:func:`backward_key`)."""
    if config is not None or not request.only("sinks"):
        return _plan_backward(do, q, k, v, request, config)
    key = backward_key(do, q, k, v, o, lse, dlse, request)
    return _bwd_plans.made(key, _plan_backward, do, q, k, v, request, config)


def _plan_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    request: Request,
    config: C.BwdConfig | None,
) -> Plan:
    """The backward's tree."""
    request.refuse("the attention backward", BWD_FIELDS)
    if _nothing(q, k):
        return Plan("empty", empty_bwd)
    if config is not None:  # pinned tiles: only the Triton pair takes them
        return triton_bwd.plan_masked(q, request, config)
    if request.only("sinks"):
        # plain (sinks' gradient beside it): the fused Gluon kernel where it applies and
        # builds, else the Triton pair
        if fused_bwd_applies(q, k, v, do):
            fallback = lambda: triton_bwd.plan_plain(q, k, request)  # noqa: E731
            return hopper.plan_bwd(q, k, request, fallback)
        return triton_bwd.plan_plain(q, k, request)
    if request.only("window_left", "window_right"):
        # a window and nothing else: the fused flex backward over its band, where it applies
        block = window_bwd_block(q, k, v, do)
        if block is not None:
            return tables_bwd.plan_window_bwd(request, block)
    return triton_bwd.plan_masked(q, request, None)


def backward_key(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple:
    """What a plain backward's plan depends on: the shapes it reads (q's and k's; v, o, do and
    the LSE are read as k, q and q's rows are), every tensor's strides and dtype, q's device,
    each tensor's 16-byte alignment (one flag when all are aligned, the usual case), the
    request's five scalars (a kept plan's request sets no other field but its sinks, which each
    launch reads), and the switches that choose the kernels (deterministic algorithms,
    ``FLASHLITE_HOPPER_KERNEL``)."""
    ptrs = (do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5]) & 15
    return (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        o.stride(),
        do.stride(),
        lse.stride(),
        tensor_meta(dlse),
        q.dtype,
        k.dtype,
        v.dtype,
        o.dtype,
        lse.dtype,
        q.device,
        True if aligned else tuple(p % 16 for p in ptrs),
        request[:5],
        torch.are_deterministic_algorithms_enabled(),
        _backend.getenv(HOPPER_ENV),
    )


def fused_bwd_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Whether a plain backward of these views takes the fused Gluon kernel
    (:func:`~flashlite.ops.attention.backends.common.hopper_bwd_applies`), its gradients
    allocated as every launch allocates them (the probes are made once per plan)."""
    dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
    return hopper_bwd_applies(dq if prescales_q(q) else q, k, v, do, dk, dv)


def _nothing(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query row, or no key (rows then see only their sinks)."""
    return q.shape[0] * q.shape[1] * q.shape[2] == 0 or k.shape[2] == 0


def window_fwd_config(facts: Facts) -> KH.HopperConfig | None:
    """The Gluon forward's config where a window forward runs the flex Hopper kernel over its
    band's tables, else None: the dense forward's rule (enough work for TMA to pay, tensors TMA
    can read, the Gluon kernel built for the problem)."""
    return facts.gluon if facts.tma_pays and facts.tma_reads else None


def window_bwd_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
) -> tuple[int, int] | None:
    """The tables' tile where a window backward of these views runs the fused flex backward
    (:func:`~flashlite.ops.attention.backends.common.hopper_bwd_applies`; its gradients are
    allocated like ``q``, ``k`` and ``v``), else None."""
    return (2 * KHB.BLOCK_M, KHB.BLOCK_N) if hopper_bwd_applies(q, k, v, do, k, v) else None
