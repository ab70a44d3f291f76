"""The host side of the Hopper (Gluon) attention kernels: their TMA descriptors and their launch
plans, the forward's (:func:`plan_fwd_hopper`) and the fused backward's (:func:`plan_bwd_hopper`).
The kernels and their tables live in :mod:`flashlite.kernels.attention.hopper` and
:mod:`~flashlite.kernels.attention.hopper_bwd`; nothing here runs unless their ``available()``
says Gluon is there."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton

from flashlite import _launch
from flashlite._caches import Cache
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB

try:  # Gluon's host descriptor (where Gluon is absent, nothing here runs)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # noqa: BLE001
    TensorDescriptor = None

_layouts = Cache("hopper.layouts", 64)

#: What a Gluon kernel that this Triton cannot build raises (its Gluon API differs).
BUILD_ERRORS = (triton.CompilationError, TypeError, ValueError, AttributeError)


def first_build(
    failed: set[Any], key: Any, what: str, build: Callable[[], Any], stacklevel: int = 3
) -> Any:
    """``build()`` (it builds and launches a Gluon kernel) unless it failed before for ``key``:
    on a build error, ``key`` joins ``failed``, one warning names ``what``, and None comes
    back: the caller runs its Triton kernel instead."""
    if key in failed:
        return None
    try:
        return build()
    except BUILD_ERRORS as err:
        failed.add(key)
        warnings.warn(
            f"flashlite: the Hopper {what} kernel failed to build ({err!r:.300}); "
            "the Triton kernel runs instead",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
        return None


def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> object:
    """The swizzled shared-memory layout TMA fills with ``block`` of ``dtype`` (made once)."""
    key = (block, dtype)
    found = _layouts.get(key)
    if found is None:
        gl = KH.gl
        gl_dtype = {
            torch.bfloat16: gl.bfloat16,
            torch.float16: gl.float16,
            torch.float32: gl.float32,
        }[dtype]
        found = _layouts.put(key, gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype))
    return found


def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None) -> Any:
    """A 4-D Gluon TMA descriptor of ``t`` ``(B, H, N, D)`` (any 16-byte aligned strides)
    reading ``[1, 1, rows, cols]`` blocks (``cols``: D when None)."""
    block = [1, 1, rows, t.shape[-1] if cols is None else cols]
    layout = shared_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


#: The kernels' block-table and mod arguments when they run without tables (never read).
_NO_TABLES = (0,) * 18


def plan_fwd_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float,
    config: KH.HopperConfig,
    sinks: bool = False,
) -> Callable[..., None]:
    """``run(q, k, v, o, lse, sinks=None)`` for tensors shaped, strided and aligned as ``q``,
    ``k`` are (and ``v`` as ``k``, ``o`` as ``q``): the grid, options and bound launch fixed
    here. Writes ``o`` ``(B, Hq, Nq, D)`` and the contiguous fp32 ``lse`` ``(B, Hq, Nq)``;
    with ``sinks`` every call passes the fp32 ``(Hq,)`` sink logits. No checks:
    the caller has validated the inputs and that TMA can read them (16-bit, a head dim with a
    :data:`~flashlite.kernels.attention.hopper.CONFIGS` entry, 16-byte aligned strides). The
    descriptors are the launcher's business (:meth:`~flashlite._launch.Launcher.bind_tensors`)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    half, bn = config.block_m // 2, config.block_n
    grid = (triton.cdiv(nq, config.block_m), b * hq, 1)
    rest = (hq, hq // hkv, nq, nk, scale, *_NO_TABLES)
    options = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": bn,
        "STAGES": config.stages,
        "IS_CAUSAL": causal,
        "HAS_SINKS": sinks,
        "num_warps": 4,
    }
    kernel = _launch.launcher(KH._attention_fwd_hopper_kernel)
    bound: list[Callable[..., None]] = []

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> None:
        sink_src = lse if sinks is None else sinks  # (a placeholder without sinks: never read)
        if not bound:  # the first call binds (descriptors of these tensors as templates)
            templates = (
                _descriptor(q, half),
                _descriptor(k, bn),
                _descriptor(v, bn),
                _descriptor(o, half),
            )
            bound.append(kernel.bind_tensors((*templates, lse, sink_src, *rest), options))
        bound[0](grid, q, k, v, o, lse, sink_src, *rest)

    return run


def plan_bwd_hopper(
    qs: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
) -> Callable[..., None]:
    """``run(qs, k, v, do, lse, delta, dq, dk, dv, acc)`` for tensors shaped, strided and aligned
    as these are (``v`` as ``k``, ``dq`` as ``qs``): dQ, dK, dV into ``dq``, ``dk``, ``dv``.
    ``qs``: the preprocess's ``Q·scale·log2 e`` ``(B, Hq, Nq, D)`` (it may be ``dq``'s memory:
    the kernel reads it before dQ is written); ``lse`` and ``delta``: dense fp32 ``(B, Hq, Nq)``.
    ``acc``: dQ's dense fp32 accumulator ``(B, Hq, Nq, D)``, zeros (the preprocess wrote them),
    the extra memory this kernel needs. The grid, options, descriptor
    blocks and bound launch are fixed here. No checks: the caller has validated the inputs and
    that TMA can read them (16-bit, D in the kernel's ``HEAD_DIMS``, 16-byte aligned strides,
    unit last strides)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(nk, KHB.BLOCK_N) * b * hkv, 1, 1)
    rest = (*dk.stride()[:3], *dv.stride()[:3], hq, hkv, hq // hkv, nq, nk, scale, *_NO_TABLES)
    options = {
        "STAGES": KHB.STAGES,
        "GROUP_H": KHB.CAUSAL_GROUP_H if causal else 1,
        "IS_CAUSAL": causal,
        "num_warps": 4,
    }
    kernel = _launch.launcher(KHB._attention_bwd_hopper_kernel)
    bound: list[Callable[..., None]] = []

    def run(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        acc: torch.Tensor,
    ) -> None:
        if not bound:  # the first call binds (descriptors of these tensors as templates)
            templates = (
                _descriptor(qs, KHB.BLOCK_M, d),
                _descriptor(do, KHB.BLOCK_M, d),
                _descriptor(k, KHB.BLOCK_N, d),
                _descriptor(v, KHB.BLOCK_N, d),
                _descriptor(acc, KHB.BLOCK_M, d // 2),
            )
            bound.append(kernel.bind_tensors((*templates, lse, delta, dk, dv, *rest), options))
        bound[0](grid, qs, do, k, v, acc, lse, delta, dk, dv, *rest)
        dq.copy_(acc)  # the kernel added scale·dS·K: only the rounding is left

    return run


def plan_flex_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    table_strides: tuple[int, ...],
    scale: float,
    config: KH.HopperConfig,
    mod_args: list[Any],
    mods: dict[str, Any],
) -> Callable[..., None]:
    """The Gluon forward over block tables (``LISTED``), launched once for these tensors, and
    ``run(q, k, v, o, lse, tables, mod_args)`` for later calls of their kind (the caller's
    plan key pins shapes, strides, dtypes, alignment and the mods). It writes ``o`` and
    ``lse`` as :func:`plan_fwd_hopper`'s, visiting the key blocks ``tables`` = ``(kv_num,
    kv_idx, full_num, full_idx)`` list for each query block, with ``mask_mod``/``score_mod`` as
    the Triton flex kernel takes them (``mod_args``: the eight buffer slots; ``mods``: their
    constexprs). The tables' blocks are ``config``'s tiles. No checks: the caller has validated
    everything and that TMA can read the tensors."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    half, bn = config.block_m // 2, config.block_n
    grid = (triton.cdiv(nq, config.block_m), b * hq, 1)
    sizes = (hq, hq // hkv, nq, nk, scale)
    options = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": bn,
        "STAGES": config.stages,
        "IS_CAUSAL": False,
        "LISTED": True,
        "num_warps": 4,
        **mods,
    }
    templates = (_descriptor(q, half), _descriptor(k, bn), _descriptor(v, bn), _descriptor(o, half))
    kernel = _launch.launcher(KH._attention_fwd_hopper_kernel)
    bound = kernel.bind_tensors(
        (*templates, lse, lse, *sizes, *tables, *table_strides, *mod_args), options
    )

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        mod_args: list[Any],
    ) -> None:
        bound(grid, q, k, v, o, lse, lse, *sizes, *tables, *table_strides, *mod_args)

    run(q, k, v, o, lse, tables, mod_args)
    return run


def plan_flex_bwd(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    acc: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    table_strides: tuple[int, ...],
    scale: float,
    mod_args: list[Any],
    mods: dict[str, Any],
) -> Callable[..., None]:
    """The fused Gluon backward over block tables (``LISTED``), launched once for these
    tensors, and ``run(qs, k, v, do, lse, delta, dq, dk, dv, acc, tables, mod_args)`` for later
    calls of their kind. dQ, dK, dV go into ``dq``, ``dk``, ``dv`` as :func:`plan_bwd_hopper`'s
    ``run`` writes them (``qs``, ``lse``, ``delta`` and the zeroed accumulator ``acc`` from the
    preprocess), each key block walking the query blocks ``tables`` = ``(q_num, q_idx,
    full_q_num, full_q_idx)`` list for it, with ``mask_mod``/``score_mod`` (and ``SCORE_GRAD``)
    as the Triton flex kernels take them. The tables' blocks are 128 × 128. No checks: the
    caller has validated everything and that TMA can read the tensors."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(nk, KHB.BLOCK_N) * b * hkv, 1, 1)
    q_num, q_idx, full_num, full_idx = tables
    sizes = (*dk.stride()[:3], *dv.stride()[:3], hq, hkv, hq // hkv, nq, nk, scale)
    options = {
        "STAGES": KHB.STAGES,
        "GROUP_H": KHB.CAUSAL_GROUP_H,
        "IS_CAUSAL": False,
        "LISTED": True,
        "num_warps": 4,
        **mods,
    }
    templates = (
        _descriptor(qs, KHB.BLOCK_M, d),
        _descriptor(do, KHB.BLOCK_M, d),
        _descriptor(k, KHB.BLOCK_N, d),
        _descriptor(v, KHB.BLOCK_N, d),
        _descriptor(acc, KHB.BLOCK_M, d // 2),
    )
    bound = _launch.launcher(KHB._attention_bwd_hopper_kernel).bind_tensors(
        (
            *templates,
            lse,
            delta,
            dk,
            dv,
            *sizes,
            full_num,
            full_idx,
            q_num,
            q_idx,
            *table_strides,
            *mod_args,
        ),
        options,
    )

    def run(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        acc: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        mod_args: list[Any],
    ) -> None:
        q_num, q_idx, full_num, full_idx = tables
        bound(
            grid,
            qs,
            do,
            k,
            v,
            acc,
            lse,
            delta,
            dk,
            dv,
            *sizes,
            full_num,
            full_idx,
            q_num,
            q_idx,
            *table_strides,
            *mod_args,
        )
        dq.copy_(acc)  # the kernel added scale·dS·K: only the rounding is left

    run(qs, k, v, do, lse, delta, dq, dk, dv, acc, tables, mod_args)
    return run
