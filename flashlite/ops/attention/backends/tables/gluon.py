"""The Hopper (Gluon) kernels over block tables: the flex forward's and the fused flex backward's
launch plans (:func:`plan_flex_fwd`, :func:`plan_flex_bwd`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from flashlite import _launch
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.backends.common_gluon import descriptor


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
    templates = (descriptor(q, half), descriptor(k, bn), descriptor(v, bn), descriptor(o, half))
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
        descriptor(qs, KHB.BLOCK_M, d),
        descriptor(do, KHB.BLOCK_M, d),
        descriptor(k, KHB.BLOCK_N, d),
        descriptor(v, KHB.BLOCK_N, d),
        descriptor(acc, KHB.BLOCK_M, d // 2),
    )

    def tail(tables: tuple[torch.Tensor, ...], mod_args: list[Any]) -> tuple:
        """The arguments after the tensors: sizes, the tables (full ones first), mods."""
        q_num, q_idx, full_num, full_idx = tables
        return (*sizes, full_num, full_idx, q_num, q_idx, *table_strides, *mod_args)

    kernel = _launch.launcher(KHB._attention_bwd_hopper_kernel)
    bound = kernel.bind_tensors((*templates, lse, delta, dk, dv, *tail(tables, mod_args)), options)

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
        bound(grid, qs, do, k, v, acc, lse, delta, dk, dv, *tail(tables, mod_args))
        dq.copy_(acc)  # the kernel added scale·dS·K: only the rounding is left

    run(qs, k, v, do, lse, delta, dq, dk, dv, acc, tables, mod_args)
    return run
