"""The backward's launchers: the preprocess (delta, Qs, the fused kernel's zeroed dQ
accumulator) and the Triton pair (dK/dV, then dQ), each as a one-off launch (``bwd_*``, masked
backwards) and as a plan bound once (``plan_*``, :class:`~flashlite.ops.attention.bwd.BwdPlan`).
What runs when is :mod:`flashlite.ops.attention.bwd`'s business."""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import bwd as KB
from flashlite.masking import masks
from flashlite.ops.attention.plan import Varlen, descriptor_ok, dot_flags, prescales_q


def _bwd_args(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: masks.Mask,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
    lse: torch.Tensor,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The backward kernels' mask arguments ``(win_left, win_right, softcap, SEQLENS_K, CU_Q,
    CU_K)`` (the last three: tensors, ``lse`` where there is none) and flags."""
    km = mask.kernel(q.shape[2], k.shape[2])
    lengths = seqlens_k if seqlens_k is not None else lse  # (a placeholder pointer)
    cu = varlen[:2] if varlen is not None else (lse, lse)
    return (km.left, km.right, km.softcap, lengths, *cu), {
        "HAS_SEQLENS": seqlens_k is not None,
        "VARLEN": varlen is not None,
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": C.block_d(q.shape[-1]),
        **km.constexprs(),
        "PRESCALE_Q": prescales_q(q),
        **dot_flags(q.dtype),
    }


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
    b, hq, nq, d = o.shape
    bm = 64 if d <= 128 else 32
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
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (qs, do), cfg.kv_block_m, d)
    extra, flags = _bwd_args(qs, k, mask, seqlens_k, varlen, lse)
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
    want: bool, tensors: tuple[torch.Tensor, ...], rows: int, head_dim: int
) -> tuple[tuple[torch.Tensor | TensorDescriptor, ...], bool]:
    """``(sources, use_desc)``: 4-D TMA descriptors over the ``(B, H, N, D)`` tensors with
    ``[1, 1, rows, BLOCK_D]`` blocks when ``want`` and the tensors allow it (always in the
    interpreter), else the tensors themselves."""
    if not want or not (_backend.kernels_interpreted() or descriptor_ok(*tensors)):
        return tensors, False
    block = [1, 1, rows, C.block_d(head_dim)]
    descs = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in tensors)
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
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (k, v), cfg.q_block_n, d)
    extra, flags = _bwd_args(qs, k, mask, seqlens_k, varlen, lse)
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
