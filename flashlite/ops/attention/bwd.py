"""The backward launcher :func:`attention_bwd`: the preprocess (delta, Qs), then on Hopper the fused
Gluon kernel or elsewhere the Triton pair (dK/dV, dQ); and its custom op
``flashlite::attention_bwd``."""

from __future__ import annotations

import os
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, _launch, masks
from flashlite.kernels import configs as C
from flashlite.kernels.attention import bwd as KB
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.checks import _check_bwd_grads
from flashlite.ops.attention.fwd import Varlen, _op_extras, _op_varlen
from flashlite.ops.attention.plan import (
    HOPPER_ENV,
    _descriptor_ok,
    _dot_flags,
    _on_hopper,
    _prescale_q,
    bwd_config,
    empty_output,
)
from flashlite.ops.common import on_compute_device


@on_compute_device
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    varlen: Varlen | None = None,
    config: C.BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output; q, o alike; k, v ``(B, Hkv, Nk, D)``.
        lse: the forward's fp32 ``(B, Hq, Nq)`` LSE; dlse: its gradient, or None.
        causal, scale, window, softcap, seqlens_k, varlen: as in the forward.
        config: pin the kernels' tiles (the traffic tools count the GPU's on a CPU; benchmarks).

    Returns:
        ``(dq, dk, dv)``, each strided like its input. Extra memory: delta, fp32 ``(B, Hq, Nq)``;
        on the fused Hopper path (:func:`hopper_bwd_applies`) also dQ's fp32 accumulator,
        ``(B, Hq, Nq, D)``.
    """
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
    if b * hq * nq == 0 or nk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    is_causal, has_window = masks.kernel_window(window, causal, nq, nk)[:2]
    cfg = config or bwd_config(q.device, q.dtype, d, is_causal)
    # 16-bit inputs: the preprocess writes Qs (Q·scale·log2 e, as the forward rounded it) into
    # dq's memory; the dQ kernel reads each block of it before overwriting it with dQ
    qs = dq if _prescale_q(q) else q
    delta = bwd_preprocess(o, do, lse, dlse, q, qs, scale)
    lse = lse.contiguous()  # the kernels index the (B, Hq, Nq) statistics densely
    plain = not has_window and softcap is None and seqlens_k is None and varlen is None
    fused = config is None and plain and hopper_bwd_applies(qs, k, v, do, dk, dv)
    if fused and _run_hopper_bwd(qs, k, v, do, lse, delta, dq, dk, dv, is_causal, scale):
        return dq, dk, dv
    masking = {"window": window, "softcap": softcap, "seqlens_k": seqlens_k, "varlen": varlen}
    bwd_dkdv(qs, k, v, do, lse, delta, dk, dv, causal, scale, cfg, **masking)
    bwd_dq(qs, k, v, do, lse, delta, dq, causal, scale, cfg, **masking)
    return dq, dk, dv


#: Fused-backward variants whose first launch failed to build: the Triton kernels run them.
_hopper_bwd_failed: set[tuple] = set()


def hopper_bwd_applies(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                       dk: torch.Tensor, dv: torch.Tensor) -> bool:  # fmt: skip
    """Whether a plain backward (causal or not, GQA; no window, soft cap, per-batch lengths or
    packed sequences: the caller checks those) of these ``(B, H, N, D)`` tensors takes the fused
    Gluon kernel (:mod:`flashlite.kernels.attention.hopper_bwd`): a CUDA sm_90 device with
    Gluon, 16-bit inputs, a head dim in its ``HEAD_DIMS``, tensors TMA can read, gradients with
    a unit last stride, ``FLASHLITE_HOPPER_KERNEL`` not ``0``, and deterministic algorithms not
    requested (``torch.use_deterministic_algorithms``): its dQ is summed by atomic reductions
    in no fixed order, so there the two Triton kernels run instead."""
    if qs.dtype not in (torch.float16, torch.bfloat16) or qs.shape[-1] not in KHB.HEAD_DIMS:
        return False
    if torch.are_deterministic_algorithms_enabled() or os.environ.get(HOPPER_ENV, "1") == "0":
        return False
    units = dk.stride(-1) == 1 and dv.stride(-1) == 1
    return _on_hopper(qs, KHB.available()) and _descriptor_ok(qs, k, v, do) and units


def _run_hopper_bwd(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor, causal: bool, scale: float) -> bool:  # fmt: skip
    """Launch the fused Gluon backward; False (after one warning) if it fails to build here."""
    key = (qs.dtype, qs.shape[-1], causal)
    if key in _hopper_bwd_failed:
        return False
    try:
        KHB.attention_bwd_hopper(qs, k, v, do, lse, delta, dq, dk, dv, causal, scale)
    except (triton.CompilationError, TypeError, ValueError, AttributeError) as err:
        _hopper_bwd_failed.add(key)
        warnings.warn(f"flashlite: the fused Hopper attention backward failed to build "
                      f"({err!r:.300}); the Triton kernels run instead", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
        return False
    return True


def _bwd_args(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    window: tuple[int, int] | None,
    softcap: float | None,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
    lse: torch.Tensor,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The backward kernels' mask arguments ``(win_left, win_right, softcap, SEQLENS_K, CU_Q,
    CU_K)`` and flags."""
    is_causal, has_window, left, right = masks.kernel_window(window, causal, q.shape[2], k.shape[2])
    lengths = seqlens_k if seqlens_k is not None else lse  # (a placeholder pointer)
    cu = varlen[:2] if varlen is not None else (lse, lse)
    return (left, right, softcap or 0.0, lengths, *cu), {
        "HAS_SEQLENS": seqlens_k is not None,
        "VARLEN": varlen is not None,
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": C.block_d(q.shape[-1]),
        "IS_CAUSAL": is_causal,
        "WINDOW": has_window,
        "SOFTCAP": softcap is not None,
        "PRESCALE_Q": _prescale_q(q),
        **_dot_flags(q.dtype),
    }


def bwd_preprocess(
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    qs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse``: fp32 ``(B, Hq, Nq)`` from ``(B, Hq, Nq, D)`` O, dO;
    for 16-bit inputs also ``qs = Q·scale·log2 e`` rounded as the forward rounded it (``qs`` is
    ``q`` itself for fp32, and not written)."""
    b, hq, nq, d = o.shape
    # an expanded or strided dlse (autograd may hand one over) is made dense here, O(N)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    delta = torch.empty((b, hq, nq), device=o.device, dtype=torch.float32)
    bm = 64 if d <= 128 else 32
    prep = _launch.launcher(KB._attention_bwd_preprocess_kernel)
    prep[(C.cdiv(nq, bm), b * hq)](
        o, do, dlse if dlse is not None else delta, delta, q, qs, *o.stride(), *do.stride(),
        *q.stride(), *qs.stride(), hq, nq, scale, HEAD_DIM=d, BLOCK_D=C.block_d(d),
        BLOCK_M=bm, HAS_DLSE=dlse is not None, PRESCALE_Q=_prescale_q(q),
        ROUND_BF16=_backend.round_bf16(q.dtype), num_warps=4, num_stages=1,
    )  # fmt: skip
    return delta


def bwd_dkdv(
    qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
    cfg: C.BwdConfig, *, window: tuple[int, int] | None = None, softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None, varlen: Varlen | None = None,
) -> None:  # fmt: skip
    """The dK/dV kernel into ``dk``, ``dv``; ``qs`` as :func:`bwd_preprocess` left it (``lse``,
    ``delta`` dense ``(B, Hq, Nq)``)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (qs, do), cfg.kv_block_m, d)
    extra, flags = _bwd_args(qs, k, causal, window, softcap, seqlens_k, varlen, lse)
    rows, seqs = (varlen[3], varlen[0].shape[0] - 1) if varlen is not None else (nk, b)
    kernel = _launch.launcher(KB._attention_bwd_dkdv_kernel)
    kernel[(C.cdiv(rows, cfg.kv_block_n), seqs * hkv)](
        srcs[0], k, v, srcs[1], lse, delta, dk, dv, *qs.stride(), *k.stride(), *v.stride(),
        *do.stride(), *dk.stride(), *dv.stride(), hq, hkv, hq // hkv, nq, nk, scale, *extra,
        USE_DESC=use_desc, **flags, **cfg.dkdv(),
    )  # fmt: skip


def _tile_sources(
    want: bool, tensors: tuple[torch.Tensor, ...], rows: int, head_dim: int
) -> tuple[tuple[torch.Tensor | TensorDescriptor, ...], bool]:
    """``(sources, use_desc)``: 4-D TMA descriptors over the ``(B, H, N, D)`` tensors with
    ``[1, 1, rows, BLOCK_D]`` blocks when ``want`` and the tensors allow it (always in the
    interpreter), else the tensors themselves."""
    if not want or not (_backend.kernels_interpreted() or _descriptor_ok(*tensors)):
        return tensors, False
    block = [1, 1, rows, C.block_d(head_dim)]
    descs = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in tensors)
    return descs, True


def bwd_dq(
    qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dq: torch.Tensor, causal: bool, scale: float, cfg: C.BwdConfig, *,
    window: tuple[int, int] | None = None, softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None, varlen: Varlen | None = None,
) -> None:  # fmt: skip
    """The dQ kernel into ``dq``; ``qs`` as :func:`bwd_preprocess` left it, possibly ``dq``
    itself (``lse``, ``delta`` dense ``(B, Hq, Nq)``)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (k, v), cfg.q_block_n, d)
    extra, flags = _bwd_args(qs, k, causal, window, softcap, seqlens_k, varlen, lse)
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    kernel = _launch.launcher(KB._attention_bwd_dq_kernel)
    kernel[(C.cdiv(rows, cfg.q_block_m), seqs * hq)](
        qs, *srcs, do, lse, delta, dq, *qs.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dq.stride(), hq, hq // hkv, nq, nk, scale, *extra, USE_DESC=use_desc, **flags,
        **cfg.dq(),
    )  # fmt: skip


def _attention_bwd_body(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_bwd_grads(do, o, lse, dlse)
    window, cap = _op_extras(window_left, window_right, softcap)
    varlen = _op_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attention_bwd(do, q, k, v, o, lse, dlse, causal, scale, window=window, softcap=cap,
                         seqlens_k=seqlens_k, varlen=varlen)  # fmt: skip


def _attention_bwd_fake(do, q, k, v, o, lse, dlse, causal, scale, window_left=-1,  # type: ignore[no-untyped-def]
      window_right=-1, softcap=None,
      seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
      max_seqlen_k=0):  # fmt: skip
    _check_bwd_grads(do, o, lse, dlse)
    return empty_output(q), empty_output(k), empty_output(v)
