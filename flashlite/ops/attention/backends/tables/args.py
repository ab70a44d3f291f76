"""A table call's request, key and kernel arguments, shared by the tables backend's forward and
backward plans: the request of a block mask's tables (:func:`table_request`), what a plan pins
(:func:`call_key`), the mods' buffer slots and constexprs, the block tables' strides, the Triton
forward's tiles, the grids' sizes and the bound Triton launch (one stage where the pipelined one
outgrows shared memory)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

from flashlite import _backend, _launch
from flashlite._caches import Cache, register
from flashlite.masking import block_mask as BM
from flashlite.masking import mods as M
from flashlite.masking.mod_args import (
    ModArgs,
    declared_fast_path,
    spec_entry,
    spec_mod,
    split_spec,
    unspec_mod,
)
from flashlite.masking.python_masks import BITS_NAME
from flashlite.ops.attention.backends.common import kernel_switches
from flashlite.ops.attention.request import Request, mod_fields

#: dQ, dK, dV.
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


#: Varlen's offsets ``(cu_seqlens_q, cu_seqlens_k)``, or None.
Offsets = tuple[torch.Tensor, torch.Tensor] | None


#: :class:`FwdPlan` and :class:`BwdPlan` per kind of call (:func:`call_key`).
fwd_plans = Cache("flex.fwd", 256)


bwd_plans = Cache("flex.bwd", 256)


# --------------------------------------------------------------------------- the ops
#: The request fields the flex ops take: the tables, the mods, the scale and packed sequences.
FLEX_FIELDS = (
    "scale",
    "causal",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "block_tables",
    "block_size",
    "mask_mod",
    "mask_tensors",
    "mask_nums",
    "score_mod",
    "score_tensors",
    "score_nums",
    "head_dim_v",
)


class TableCall(NamedTuple):
    """What a table request gives every plan, worked out once per request (:func:`table_call`):
    the eight tables, the block size, the scale, both mods as the plans take them (``""``:
    none), the mods' tensors, varlen's offsets, and the request's part of a plan's key
    (:func:`call_key`) with whether all its tensors are 16-byte aligned."""

    tables: tuple[torch.Tensor, ...]
    tbm: int
    tbn: int
    scale: float
    mask: ModArgs
    score: ModArgs
    tensors: list[torch.Tensor]
    cu: Offsets
    key: tuple
    aligned: bool


#: :func:`table_call`'s per request (while the mods' registry is unchanged): a loop reuses
#: its request (:func:`table_request` keeps one per block mask), so its call is worked out once.
#: A few at most (the oldest goes first): each holds its request's tables and buffers alive.
_calls = Cache("flex.calls", 8)


def table_call(request: Request) -> TableCall:
    """The request's :class:`TableCall`, after refusing what flex does not take."""
    found = _calls.get(id(request))
    if found is not None and found[0] is request and found[1] == M.registry_version():
        return found[2]
    call = _table_call(request)
    _calls.put(id(request), (request, M.registry_version(), call))
    return call


def _table_call(request: Request) -> TableCall:
    request.refuse("flex attention", FLEX_FIELDS)
    if request.causal or request.block_tables is None or request.block_size is None:
        raise ValueError("the flex ops take a block mask's tables and block size, not causal")
    tables = tuple(request.block_tables)
    tbm, tbn = request.block_size
    mask = request.mask_args or spec_mod(None)
    score = request.score_args or spec_mod(None)
    cu_q, cu_k = request.cu_seqlens_q, request.cu_seqlens_k
    cu = None if cu_q is None or cu_k is None else (cu_q, cu_k)
    tensors = [*mask[1], *score[1]]
    # the tables' shapes and strides, each mod's spec (its name and buffer kinds), registry
    # entry and numbers, its tensors' dtypes, the blocks and the scale
    key: list[Any] = [tbm, tbn, request.scale]
    for t in tables:
        key.append(t.shape)
        key.append(t.stride())
    for spec, mod_tensors, nums in (mask, score):
        key.extend((spec, spec_entry(spec), *nums, *(t.dtype for t in mod_tensors)))
    key.append(None if cu is None else cu[0].shape)
    every = (*tables, *tensors, *(cu or ()))
    aligned = not any(t.data_ptr() % 16 for t in every)
    return TableCall(tables, tbm, tbn, request.scale, mask, score, tensors, cu, tuple(key), aligned)


#: :func:`table_request`'s requests per block mask (frozen), then per scale and score function:
#: a loop over one mask builds its request once, not on every call. Keyed by the mask's id, the
#: entry dropped when the mask goes (a ``WeakKeyDictionary``'s lookup is Python code).
_requests: dict[int, tuple[weakref.ref, dict]] = register("flex.requests", {})


def table_request(bm: Any, scale: float, smod: M.ScoreMod | None = None, **fields: Any) -> Request:
    """The :class:`Request` of checked tables ``bm`` (a
    :class:`~flashlite.masking.block_mask.BlockMask`), ``scale`` and a score function: the
    eight tables, the block size and both mods as the ops carry them
    (:func:`~flashlite.masking.mod_args.spec_mod`), and ``fields`` (packed sequences). Kept
    per block mask, scale and score function when there are no ``fields``."""
    if fields:
        return _table_request(bm, scale, smod, fields)
    entry = _requests.get(id(bm))
    if entry is None or entry[0]() is not bm:
        entry = _requests[id(bm)] = (weakref.ref(bm, _forget(id(bm))), {})
    per_mask = entry[1]
    found = per_mask.get((scale, id(smod)))
    if found is not None and found[0] is smod:  # (the id of a live score function)
        return found[1]
    request = _table_request(bm, scale, smod, fields)
    if len(per_mask) < 16:  # (a loop over many scales or score functions: built each time)
        per_mask[(scale, id(smod))] = (smod, request)
    return request


def _forget(key: int) -> Callable[[weakref.ref], None]:
    """The callback that drops a dead block mask's requests (unless its id was reused)."""

    def forget(ref: weakref.ref) -> None:
        entry = _requests.get(key)
        if entry is not None and entry[0] is ref:
            del _requests[key]

    return forget


def _table_request(
    bm: Any, scale: float, smod: M.ScoreMod | None, fields: dict[str, Any]
) -> Request:
    mods = {**mod_fields("mask", bm.mask_mod), **mod_fields("score", smod)}
    tables = [getattr(bm, name) for name in BM._TABLES]
    return Request(scale, block_tables=tables, block_size=list(bm.BLOCK_SIZE), **mods, **fields)


def call_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: TableCall,
    more: tuple[torch.Tensor | None, ...] = (),
) -> list[Any]:
    """What a plan depends on: q's, k's and v's shapes and strides, the dtype and device, the
    switches that choose kernels, the request's part (:attr:`TableCall.key`), and every
    tensor's 16-byte alignment (one flag when all are aligned, the usual case), ``more``'s
    tensors' too (None where absent). The caller appends what else its plan pins."""
    key: list[Any] = [
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        q.dtype,
        q.device,
        kernel_switches(),
        call.key,
    ]
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr()
    for t in more:
        if t is not None:
            ptrs |= t.data_ptr()
    if ptrs & 15 or not call.aligned:  # (rare: then each pointer's own)
        every = (q, k, v, *call.tables, *call.tensors, *(call.cu or ()), *more)
        key.append(tuple(t.data_ptr() % 16 for t in every if t is not None))
    return key


def mod_args(mask: ModArgs, score: ModArgs, grad: bool) -> tuple[list[Any], dict[str, Any]]:
    """The kernels' eight buffer slots and their mod constexprs (``SCORE_GRAD`` with ``grad``;
    an absent score function's slots hold the mask, never called)."""
    (mfn, *_), mbufs, n_mbuf = unspec_mod(*mask)
    sfns, sbufs, n_sbuf = unspec_mod(*score)
    if grad and sfns is not None and sfns[2] is None:
        raise NotImplementedError(
            f"score_mod {split_spec(score[0])[0]} has no derivative: make it with "
            "flashlite.mods.score_mod(fn, ..., grad=...) to differentiate through it"
        )
    consts = {
        "MASK_MOD": mfn,
        "N_MASK_BUF": n_mbuf,
        "SCORE_MOD": sfns[0] if sfns else mfn,
        "N_SCORE_BUF": n_sbuf,
        "HAS_SCORE": sfns is not None,
    }
    if grad:
        consts["SCORE_GRAD"] = sfns[2] if sfns else mfn
    return [*mbufs, *sbufs], consts


def head_linear_bias(score: ModArgs) -> bool:
    """Whether the score function declares the ``"head_linear_bias"`` fast path
    (:func:`flashlite.masking.mods.score_mod`'s ``fast_path``; the gallery's ALiBi does): its
    first buffer is then the fp32 per-head slopes, which the Hopper forward applies as a column
    and a row term (:func:`flashlite.kernels.attention.hopper_parts._fold`), not calling it."""
    return declared_fast_path(score[0]) == "head_linear_bias"


def table_args(num: torch.Tensor, idx: torch.Tensor) -> tuple[int, ...]:
    """Strides of ``(B|1, H|1, n)`` counts and ``(B|1, H|1, n, m)`` indices as ``(B, H, …)``
    views take them: 0 along a broadcast (size 1) dimension, as ``expand`` would give."""
    ns, is_ = num.stride(), idx.stride()
    one_b, one_h = num.shape[0] == 1, num.shape[1] == 1
    return (
        0 if one_b else ns[0],
        0 if one_h else ns[1],
        ns[2],
        0 if one_b else is_[0],
        0 if one_h else is_[1],
        is_[2],
    )


def triton_fwd_tiles(d: int, table: tuple[int, int], varlen: bool) -> tuple[int, int]:
    """The Triton forward's ``(BLOCK_M, BLOCK_N)`` on a GPU for head dim ``d`` and tables of
    ``table`` tiles (the traffic model takes them from here)."""
    return min(table[0], 128), min(table[1], 32 if varlen and d > 64 else 64)


def grid_blocks(n: int, num: torch.Tensor, table_block: int, block: int, varlen: bool) -> int:
    """Programs along ``n`` rows (or keys) in blocks of ``block``; varlen: along the tables'
    ``(…, rows)`` counts of ``table_block`` (the longest sequence's; ``block`` divides it),
    programs past a shorter sequence returning at once."""
    return num.shape[-1] * (table_block // block) if varlen else triton.cdiv(n, block)


def grid_batch(q: torch.Tensor, cu: tuple[torch.Tensor, torch.Tensor], varlen: bool) -> int:
    """The grid's batch: q's, or varlen's number of sequences."""
    return cu[0].shape[0] - 1 if varlen else q.shape[0]


#: (kernel, mods, head dim, dtype) launched with one stage: see :func:`bind_triton`.
one_stage: set[tuple[Any, ...]] = register("flex.one_stage", set())


def bind_triton(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple[Any, ...],
    mods: dict[str, Any],
    opts: dict[str, Any],
) -> Callable[..., None]:
    """Launch a Triton flex kernel once and return its bound launch for later calls of the
    kind. Triton's software pipeliner stages a loop's loads in shared memory, a mod's gathers
    too (a bias table read per score): those can outgrow it. Then the kernel runs (this time
    and for later calls of the mod) with one stage, unpipelined."""
    key = (kernel, *mods.values(), opts["HEAD_DIM"], opts.get("HEAD_DIM_V"), args[0].dtype)
    if key in one_stage:
        opts = {**opts, "num_stages": 1}
    launcher = _launch.launcher(kernel)
    try:
        bound = launcher.bind(args, {**mods, **opts})
        bound(grid, *args)
    except triton.OutOfResources:
        if opts["num_stages"] == 1:
            raise
        one_stage.add(key)
        bound = launcher.bind(args, {**mods, **opts, "num_stages": 1})
        bound(grid, *args)
    return bound


#: Whether the Hopper (Gluon) flex kernels read a plain Python mask's bits
#: (:data:`flashlite.masking.python_masks.BITS_NAME`), as they read any mask's buffers; False
#: sends those calls to the Triton flex kernels (the GPU tests run both). Plans are kept per
#: kind of call: clear them (``flashlite._caches.clear()``) after changing it.
GLUON_TAKES_BITS = True


def gluon_takes(mask: ModArgs) -> bool:
    """Whether the Hopper (Gluon) flex kernels take this mask (:data:`GLUON_TAKES_BITS`)."""
    return GLUON_TAKES_BITS or split_spec(mask[0])[0] != BITS_NAME


def plan_options(
    q: torch.Tensor,
    tbm: int,
    tbn: int,
    bwd: bool,
    varlen: bool = False,
    head_dim_v: int | None = None,
) -> dict[str, Any]:
    """The Triton kernels' tiles (dividing the table's) and numerics. Varlen at head dims
    above 64: 32-key tiles (and 8 warps backward), which built for sm_90 with at most 56 bytes
    of spills where 64-key tiles spilled 136–216 B forward and 0.9–4 KB backward (Triton 3.9's
    ptxas, D 128); not yet timed. ``head_dim_v``: V's (and O's) head dim, where it is not
    Q's."""
    d = q.shape[-1]
    if _backend.INTERPRETED:
        bm, bn, warps, stages = tbm, tbn, 4, 1
    elif bwd:
        bm, bn, warps, stages = min(tbm, 64), min(tbn, 64), 4, 2
        if varlen and d > 64:
            bn, warps = min(tbn, 32), 8
    else:
        bm, bn = triton_fwd_tiles(d, (tbm, tbn), varlen)
        warps, stages = (8 if d > 64 else 4), 3
    extra = {}
    if head_dim_v is not None and head_dim_v != d:
        extra = {"HEAD_DIM_V": head_dim_v, "BLOCK_DV": max(16, triton.next_power_of_2(head_dim_v))}
    return {
        **extra,
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "TBM": tbm,
        "TBN": tbn,
        "DOT_FP32": _backend.dot_upcast(q.dtype),
        "DOT_PRECISION": "tf32x3" if q.dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(q.dtype),
        "num_warps": warps,
        "num_stages": stages,
    }
