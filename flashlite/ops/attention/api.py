"""The public attention functions over whole sequences: :func:`attention` and
:func:`attention_varlen` (decoding against a cache is :mod:`.kvcache`'s)."""

from __future__ import annotations

from typing import Any

import torch

from flashlite.masking import masks
from flashlite.ops.attention.backends.split_kv.splits import chosen_splits
from flashlite.ops.attention.checks import (
    check_cu_seqlens,
    check_cu_values,
    check_offsets_on_device,
    check_seqlens,
    check_sinks,
    check_splits,
    check_views,
)
from flashlite.ops.attention.flex import flex_varlen
from flashlite.ops.attention.fp8 import E4M3, fp8_fields
from flashlite.ops.attention.ops import ATTENTION_FWD
from flashlite.ops.attention.request import Request
from flashlite.ops.common import check_flags


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "b h n d",
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention computed tile by tile (FlashAttention-2 loop order).

    Args:
        q: ``(B, Hq, Nq, D)`` (or ``(B, Nq, Hq, D)`` with ``layout="b n h d"``).
        k, v: ``(B, Hkv, Nk, D)`` in the same layout; ``Hq % Hkv == 0`` gives GQA/MQA without
            repeating k and v in memory. Any strides: slices of a packed qkv buffer work. v may
            have a head dim of its own, ``(B, Hkv, Nk, Dv)`` (DeepSeek's 192/128): the output
            then has ``Dv`` columns.
        causal: bottom-right aligned mask (flash-attn >= 2.1, ``causal_lower_right``): query i
            sees key j iff ``j <= i + Nk - Nq``. Rows that see no key give 0 and LSE −inf.
            As a mask function: ``flashlite.gallery.causal_lower_right(Nq, Nk)``
            (``gallery.causal()`` is top-left aligned, ``j <= i``: the same when Nq == Nk).
        scale: multiplies ``QKᵀ`` before the softmax; defaults to ``1/sqrt(D)``; must be > 0.
        layout: ``"b h n d"`` or ``"b n h d"`` (einops notation).
        return_lse: also return the natural-log LSE of the scaled scores.
        window: ``(left, right)`` sliding window aligned bottom-right like ``causal``: query i
            sees key j iff ``i + Nk − Nq − left <= j <= i + Nk − Nq + right``, −1 meaning
            unlimited (flash-attn's ``window_size``); ``(-1, 0)`` is causal, and with
            ``causal=True`` right becomes 0. Key tiles outside every row's window are skipped.
        softcap: scores ``s = scale·q·k`` become ``softcap·tanh(s/softcap)`` before masking
            and the softmax (Gemma 2); the LSE is of the capped scores.
        seqlens_k: int32 ``(B,)`` tensor on q's device: batch b has only its first
            ``seqlens_k[b]`` keys (a padded KV cache or batch); ``causal`` and ``window`` align
            to that length, and a length of 0 gives output 0 and LSE −inf. Keys past it get
            zero gradients. CPU tensors are checked to lie in ``[0, Nk]``; on a GPU (no host
            sync) values outside are clamped to it.
        num_splits: split the keys across this many programs per block of query rows and
            merge the partial results exactly (flash-decoding: few queries against many keys),
            the query heads of a GQA group packed into one tile. 1: no split, the plain
            forward kernel. None: on a GPU, when ``Nq·Hq/Hkv`` is at most 64 (decoding), the
            split that fills the GPU (:func:`splits_for`); otherwise no split.
        sinks: ``(Hq,)`` attention-sink logits in the scaled-score space (gpt-oss), fp32 or
            q's dtype: one more logit in every row's softmax, with no value, so it takes
            probability from the keys and is dropped from the output. A row that sees no key
            gives 0 and LSE = its sink. Differentiable (how a row's state starts from the sink,
            and its gradient: docs/how-it-works/attention.md §6a).
        q_descale, k_descale, v_descale: with ``torch.float8_e4m3fn`` q, k and v, their fp32
            descale factors (flash-attn's convention: ``x ≈ x8·descale``), each ``(1,)`` or
            ``(B, Hkv)``; None means 1. The scores are ``scale·q_descale·k_descale·q8·k8ᵀ``,
            the probabilities are rounded to e4m3 for the ``p·v`` product (FlashAttention-3's
            recipe) and the output is multiplied by ``v_descale``. Forward only: q, k, v must
            not require grad. Works with every option above. Guide: docs/guides/fp8.md.
        out_dtype: an FP8 call's output dtype: ``torch.bfloat16`` (default), ``float16`` or
            ``float32``.

    Returns:
        ``out`` in ``q``'s layout and dtype (FP8 inputs: ``out_dtype``), or ``(out, lse)`` with
        ``lse`` fp32 ``(B, Hq, Nq)``.
        fp16/bf16 run on tensor cores with fp32 accumulation; fp32 uses three TF32 passes
        (``tf32x3``) on a GPU, about fp32 accuracy. D runs from 1 to 256. A custom op
        (``torch.ops.flashlite.attention_fwd``): ``torch.compile`` traces through it.

    Raises:
        TypeError: non-tensors, unsupported or mixed dtypes, a non-numeric scale or softcap,
            ``causal`` or ``return_lse`` not a bool, a window that is not a pair of ints, a
            seqlens_k that is not an int32 tensor.
        ValueError: wrong rank, mismatched batch/heads/lengths/head dims, unknown layout,
            mixed devices, a non-positive scale or softcap, a window bound below −1, a
            seqlens_k of the wrong shape or device (or, on CPU, values outside ``[0, Nk]``),
            sinks that are not a float ``(Hq,)`` tensor on q's device.
        NotImplementedError: head dim above 256; FP8 on a GPU below compute capability 8.9.
        RuntimeError: FP8 inputs that require grad (FP8 attention is forward only).
    """
    sm_scale, qc, kc, vc = check_views(q, k, v, layout, scale, fp8=True, head_dim_v=True)
    if type(causal) is not bool or type(return_lse) is not bool:
        check_flags(causal=causal, return_lse=return_lse)
    own_dv = vc.shape[3] != qc.shape[3]  # (V's own head dim: no split-KV kernel for it)
    splits = check_splits(num_splits) if own_dv else chosen_splits(qc, kc, check_splits(num_splits))
    if seqlens_k is not None:
        seqlens_k = check_seqlens(seqlens_k, qc, kc)
    if sinks is not None:
        sinks = check_sinks(sinks, qc, qc.shape[1])
    request = Request.of_call(causal, sm_scale, window, softcap, seqlens_k, splits, sinks)
    if qc.dtype == E4M3 or not q_descale is k_descale is v_descale is out_dtype is None:
        fp8 = fp8_fields(qc, kc, vc, q_descale, k_descale, v_descale, out_dtype)
        request = request._replace(**fp8)
    if own_dv:
        request = request._replace(head_dim_v=vc.shape[3])
    o, lse = ATTENTION_FWD(qc, kc, vc, request)
    if layout != "b h n d":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    validate: bool | str = True,
    sinks: torch.Tensor | None = None,
    score_mod: Any = None,
    block_mask: Any = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (flash-attn's varlen convention),
    without padding: sequence b is rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` of q and
    ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])`` of k and v. Guide: docs/guides/attention.md.

    Args:
        q: ``(total_q, Hq, D)``; k, v: ``(total_k, Hkv, D)``, ``Hq % Hkv == 0``; v may have a
            head dim of its own, ``(total_k, Hkv, Dv)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` offsets: start at 0, non-decreasing,
            last entry the packed length.
        max_seqlen_q, max_seqlen_k: at least the longest sequence's lengths (they size the grid).
        causal, scale, window, softcap, sinks: as :func:`attention`, per sequence (causal and
            window aligned bottom-right to each sequence's own lengths).
        return_lse: also return the fp32 LSE, ``(Hq, total_q)``.
        validate: check the offsets' values (bad ones are clamped anyway: wrong rows, never an
            access outside the tensors). ``True``: on a GPU in one launch, no host sync, raised
            by a *later* varlen call there; on the CPU by this call. ``"sync"``: by this call,
            after a host sync. ``False``: no check. Skipped inside ``torch.compile``.
        score_mod, block_mask: your own score function and mask per sequence, as
            :func:`flex_attention`'s: sequence b is batch ``b``, positions from its start, the
            mask built with ``B = batch`` (or None), ``Q_LEN``/``KV_LEN`` ``max_seqlen_q/_k``.
            Not with ``causal``, ``window``, ``softcap`` or ``sinks``: write them as mods.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs as :func:`attention`'s, the
            factors ``(1,)`` or ``(batch, Hkv)`` (one row per sequence); not with mods.

    Returns:
        ``out`` ``(total_q, Hq, D)`` (and the LSE). Differentiable in q, k, v, the sinks (and
        through the LSE). Sequences of length 0 give nothing; a query that sees no key gives 0,
        LSE −inf (or its sink).

    Raises:
        TypeError: non-tensors, wrong dtypes (cu_seqlens must be int32), flags that are not
            bools, as :func:`attention`; ``validate`` not True, False or ``"sync"``.
        ValueError: shapes, devices; with ``validate`` (raised when it says), cu_seqlens that
            do not start at 0, decrease or miss the packed length, a max_seqlen below a length;
            mods with ``causal``, ``window``, ``softcap`` or ``sinks``, a block mask of other
            lengths or batch.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total, heads, head_dim), got {tuple(t.shape)}")
    check_flags(causal=causal, return_lse=return_lse)
    sm_scale, qc, kc, vc, cu_q, cu_k = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, validate
    )
    fp8 = fp8_fields(qc, kc, vc, q_descale, k_descale, v_descale, out_dtype, cu_q.shape[0] - 1)
    if fp8 and (score_mod is not None or block_mask is not None):
        raise NotImplementedError(
            "attention_varlen takes FP8 inputs without score_mod or block_mask"
        )
    if score_mod is not None or block_mask is not None:
        _refuse_builtins(causal, window, softcap, sinks)
        sizes = int(max_seqlen_q), int(max_seqlen_k)
        o, lse = flex_varlen(qc, kc, vc, cu_q, cu_k, *sizes, score_mod, block_mask, sm_scale)
    else:
        mask = masks.describe(causal, window, softcap)
        request = Request.of_mask(
            mask,
            sm_scale,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            sinks=check_sinks(sinks, qc, qc.shape[1]),
            head_dim_v=vc.shape[3] if vc.shape[3] != qc.shape[3] else None,
            **fp8,
        )
        o, lse = ATTENTION_FWD(qc, kc, vc, request)
    o = o.transpose(1, 2).squeeze(0)
    return (o, lse.squeeze(0)) if return_lse else o


def _check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    validate: bool | str,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_varlen`'s checks after its tensors' ranks and flags: ``validate``, the
    ``(1, total, H, D)`` views (:func:`check_views`), the offsets, and their values as
    ``validate`` says. Returns ``(scale, q, k, v, cu_seqlens_q, cu_seqlens_k)`` as checked."""
    if not (isinstance(validate, bool) or validate == "sync"):
        raise TypeError(f"validate must be True, False or 'sync', got {validate!r}")
    # (1, H, total, D) views: one 'batch' in the layout the kernels read, no copy
    sm_scale, qc, kc, vc = check_views(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), "b n h d", scale, True, True
    )
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, max_seqlen_q)
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, max_seqlen_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
        )
    if validate and not torch.compiler.is_compiling():
        sizes = (q.shape[0], k.shape[0], int(max_seqlen_q), int(max_seqlen_k))
        on_device = validate is True and cu_q.device.type == "cuda"  # (a CPU check costs no sync)
        if not (on_device and check_offsets_on_device(cu_q, cu_k, *sizes)):
            check_cu_values(cu_q, cu_k, *sizes)
    return sm_scale, qc, kc, vc, cu_q, cu_k


def _refuse_builtins(causal: bool, window: Any, softcap: Any, sinks: Any) -> None:
    """:func:`attention_varlen`'s mods come without its built-in masks and sinks."""
    builtin = {"causal": causal or None, "window": window, "softcap": softcap, "sinks": sinks}
    given = [name for name, x in builtin.items() if x is not None]
    if given:
        raise ValueError(
            f"attention_varlen takes score_mod and block_mask without {', '.join(given)}: "
            "write them as mods (flashlite.gallery: causal(), sliding_window(w), "
            "tanh_softcap(c)) in the block mask and score function"
        )
