"""The Triton backward pair (dK/dV, then dQ), each as a one-off launch (``bwd_*``, masked
backwards) and as a launch bound once (``plan_dkdv``, ``plan_dq``); the backward's plans on them
(:func:`plan_plain`, :func:`plan_masked`). The preprocess before them is
:mod:`~flashlite.ops.attention.backends.common`'s."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import bwd as KB
from flashlite.masking import masks
from flashlite.ops.attention.backends.common import (
    Varlen,
    bwd_preprocess,
    descriptor_ok,
    dot_flags,
    empty_output,
    prescales_q,
)
from flashlite.ops.attention.backends.common_bwd import Grads, PlainBwd, sink_grad
from flashlite.ops.attention.backends.triton.config import bwd_config
from flashlite.ops.attention.plan import Plan, Workspace
from flashlite.ops.attention.request import Request


def _bwd_args(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: masks.Mask,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
    lse: torch.Tensor,
    head_dim_v: int,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The backward kernels' mask arguments ``(win_left, win_right, softcap, SEQLENS_K, CU_Q,
    CU_K)`` (the last three: tensors, ``lse`` where there is none) and flags (V's head dim
    ``head_dim_v`` among them where it is not Q's)."""
    km = mask.kernel(q.shape[2], k.shape[2])
    lengths = seqlens_k if seqlens_k is not None else lse  # (a placeholder pointer)
    cu = varlen[:2] if varlen is not None else (lse, lse)
    flags = {
        "HAS_SEQLENS": seqlens_k is not None,
        "VARLEN": varlen is not None,
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": C.block_d(q.shape[-1]),
        **km.constexprs(),
        "PRESCALE_Q": prescales_q(q),
        **dot_flags(q.dtype),
    }
    if head_dim_v != q.shape[-1]:
        flags |= {"HEAD_DIM_V": head_dim_v, "BLOCK_DV": C.block_d(head_dim_v)}
    return (km.left, km.right, km.softcap, lengths, *cu), flags


def _dkdv_launch(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    mask: masks.Mask,
    scale: float,
    cfg: C.BwdConfig,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
) -> tuple[tuple[int, int, int], tuple, dict]:
    """The dK/dV kernel's grid, arguments (descriptors of ``qs``, ``do`` where TMA reads them)
    and options."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (qs, do), cfg.kv_block_m)
    extra, flags = _bwd_args(qs, k, mask, seqlens_k, varlen, lse, v.shape[-1])
    rows, seqs = (varlen[3], varlen[0].shape[0] - 1) if varlen is not None else (nk, b)
    args = (
        srcs[0],
        k,
        v,
        srcs[1],
        lse,
        delta,
        dk,
        dv,
        *qs.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
        *dk.stride(),
        *dv.stride(),
        hq,
        hkv,
        hq // hkv,
        nq,
        nk,
        scale,
        *extra,
    )
    grid = (C.cdiv(rows, cfg.kv_block_n), seqs * hkv, 1)
    return grid, args, {"USE_DESC": use_desc, **flags, **cfg.dkdv()}


def bwd_dkdv(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    mask: masks.Mask,
    scale: float,
    cfg: C.BwdConfig,
    *,
    seqlens_k: torch.Tensor | None = None,
    varlen: Varlen | None = None,
) -> None:
    """The dK/dV kernel into ``dk``, ``dv``; ``qs`` as :func:`bwd_preprocess` left it (``lse``,
    ``delta`` dense ``(B, Hq, Nq)``)."""
    grid, args, options = _dkdv_launch(
        qs, k, v, do, lse, delta, dk, dv, mask, scale, cfg, seqlens_k, varlen
    )
    _launch.launcher(KB._attention_bwd_dkdv_kernel).bind(args, options)(grid, *args)


def plan_dkdv(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
    cfg: C.BwdConfig,
) -> Callable[..., None]:
    """``run(qs, k, v, do, lse, delta, dk, dv)``: :func:`bwd_dkdv` of a plain backward for
    tensors of these kinds, its launch bound once."""
    grid, args, options = _dkdv_launch(
        qs, k, v, do, lse, delta, dk, dv, masks.describe(causal), scale, cfg, None, None
    )
    bound = _launch.launcher(KB._attention_bwd_dkdv_kernel).bind_tensors(args, options)
    tail = args[8:-3]  # strides, sizes, scale, mask values (then three placeholder pointers)

    def run(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
    ) -> None:
        bound(grid, qs, k, v, do, lse, delta, dk, dv, *tail, lse, lse, lse)

    return run


def _tile_sources(
    want: bool, tensors: tuple[torch.Tensor, ...], rows: int
) -> tuple[tuple[torch.Tensor | TensorDescriptor, ...], bool]:
    """``(sources, use_desc)``: 4-D TMA descriptors over the ``(B, H, N, D)`` tensors with
    ``[1, 1, rows, BLOCK_D]`` blocks (each its own D's) when ``want`` and the tensors allow it
    (always in the interpreter), else the tensors themselves."""
    if not want or not (_backend.kernels_interpreted() or descriptor_ok(*tensors)):
        return tensors, False
    descs = tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, C.block_d(t.shape[3])])
        for t in tensors
    )
    return descs, True


def _dq_launch(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    mask: masks.Mask,
    scale: float,
    cfg: C.BwdConfig,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
) -> tuple[tuple[int, int, int], tuple, dict]:
    """The dQ kernel's grid, arguments (descriptors of ``k``, ``v`` where TMA reads them) and
    options."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (k, v), cfg.q_block_n)
    extra, flags = _bwd_args(qs, k, mask, seqlens_k, varlen, lse, v.shape[-1])
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    args = (
        qs,
        *srcs,
        do,
        lse,
        delta,
        dq,
        *qs.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
        *dq.stride(),
        hq,
        hq // hkv,
        nq,
        nk,
        scale,
        *extra,
    )
    grid = (C.cdiv(rows, cfg.q_block_m), seqs * hq, 1)
    return grid, args, {"USE_DESC": use_desc, **flags, **cfg.dq()}


def bwd_dq(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    mask: masks.Mask,
    scale: float,
    cfg: C.BwdConfig,
    *,
    seqlens_k: torch.Tensor | None = None,
    varlen: Varlen | None = None,
) -> None:
    """The dQ kernel into ``dq``; ``qs`` as :func:`bwd_preprocess` left it, possibly ``dq``
    itself (``lse``, ``delta`` dense ``(B, Hq, Nq)``)."""
    grid, args, options = _dq_launch(
        qs, k, v, do, lse, delta, dq, mask, scale, cfg, seqlens_k, varlen
    )
    _launch.launcher(KB._attention_bwd_dq_kernel).bind(args, options)(grid, *args)


def plan_dq(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    causal: bool,
    scale: float,
    cfg: C.BwdConfig,
) -> Callable[..., None]:
    """``run(qs, k, v, do, lse, delta, dq)``: :func:`bwd_dq` of a plain backward for tensors of
    these kinds, its launch bound once."""
    grid, args, options = _dq_launch(
        qs, k, v, do, lse, delta, dq, masks.describe(causal), scale, cfg, None, None
    )
    bound = _launch.launcher(KB._attention_bwd_dq_kernel).bind_tensors(args, options)
    tail = args[7:-3]  # strides, sizes, scale, mask values (then three placeholder pointers)

    def run(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dq: torch.Tensor,
    ) -> None:
        bound(grid, qs, k, v, do, lse, delta, dq, *tail, lse, lse, lse)

    return run


def plan_pair(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
    cfg: C.BwdConfig,
) -> Callable[..., None]:
    """``main(qs, k, v, do, lse, delta, dq, dk, dv, acc=None)`` of the Triton pair
    (:func:`plan_dkdv`, then :func:`plan_dq`) for tensors of these kinds."""
    dkdv = plan_dkdv(qs, k, v, do, lse, delta, dk, dv, causal, scale, cfg)
    dq_run = plan_dq(qs, k, v, do, lse, delta, dq, causal, scale, cfg)

    def main(
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        acc: None = None,  # (the fused kernel's accumulator: the pair needs none)
    ) -> None:
        dkdv(qs, k, v, do, lse, delta, dk, dv)
        dq_run(qs, k, v, do, lse, delta, dq)

    return main


def plan_plain(q: torch.Tensor, k: torch.Tensor, request: Request) -> Plan:
    """The Triton pair's plan for a plain backward (sinks allowed) on tensors of these kinds:
    the preprocess, dK/dV, then dQ, each launch bound at the first call."""
    b, hq, nq, d = q.shape
    causal, scale = request.causal, request.scale
    cfg = bwd_config(q.device, q.dtype, d, causal)

    def first(
        qs: Tensor,
        k: Tensor,
        v: Tensor,
        do: Tensor,
        lse: Tensor,
        delta: Tensor,
        dq: Tensor,
        dk: Tensor,
        dv: Tensor,
        acc: None,
    ) -> Callable[..., None]:
        pair = plan_pair(qs, k, v, do, lse, delta, dq, dk, dv, causal, scale, cfg)
        pair(qs, k, v, do, lse, delta, dq, dk, dv)
        return pair

    scratch = (Workspace("delta", (b, hq, nq), torch.float32),)
    grid = (C.cdiv(k.shape[2], cfg.kv_block_n), b * k.shape[1], 1)  # (dK/dV's: per key block)
    frame = PlainBwd(q, causal, scale, False, first)
    return Plan("triton", frame, cfg, False, grid, 1, scratch)


def plan_masked(q: torch.Tensor, request: Request, config: C.BwdConfig | None) -> Plan:
    """The Triton pair's plan for a backward with a window, soft cap, lengths, packing or a
    pinned config (``config``): the preprocess and both kernels launched per call."""
    # (the tiles of the wider of the two head dims: what shared memory holds)
    widest = max(q.shape[-1], request.head_dim_v or 0)
    cfg = config or bwd_config(q.device, q.dtype, widest, request.causal)

    def launch(
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        dlse: Tensor | None,
        request: Request,
        dsinks: Tensor | None,
    ) -> Grads:
        mask, scale, sinks = request.mask, request.scale, request.sinks
        lengths = {"seqlens_k": request.seqlens_k, "varlen": request.varlen}
        dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
        qs = dq if prescales_q(q) else q
        delta = bwd_preprocess(o, do, lse, dlse, q, qs, scale)
        lse = lse.contiguous()
        if sinks is not None:
            sink_grad(sinks, lse, delta, dsinks)
        bwd_dkdv(qs, k, v, do, lse, delta, dk, dv, mask, scale, cfg, **lengths)
        bwd_dq(qs, k, v, do, lse, delta, dq, mask, scale, cfg, **lengths)
        return dq, dk, dv

    scratch = (Workspace("delta", q.shape[:3], torch.float32),)
    return Plan("triton", launch, cfg, False, None, 1, scratch)
