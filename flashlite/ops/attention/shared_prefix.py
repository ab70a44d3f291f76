"""Shared-prefix (cascade) decoding, :func:`attention_shared_prefix`: B requests that continue
one prompt attend to it through two attentions and one merge (FlashInfer's cascade attention).

1. **The prefix pass.** Every query row of a KV head, all requests together (``B·Nq·Hq/Hkv``
   rows), is one tile problem over the prefix ``(1, Hkv, Np, D)`` (a strided view, no copy): each
   prefix tile is read once per step, not once per request. So few rows would leave most SMs
   idle: the keys are split across programs and merged (the decode kernel's split-KV).
2. **The suffix pass.** :func:`attention_kvcache` over each request's own cache, append included.
   Its keys are the last of the whole sequence, so bottom-right alignment over the suffix alone
   puts the causal diagonal and a window's edges where they are in the whole sequence. Sinks
   ride on this pass: its rows start from the sink's state ``(sink, 1)``, so it is merged once.
3. **The merge** of the two partial (out, LSE) pairs: :func:`merge_torch`
   (:func:`flashlite.stats.merge_attention`) or its Triton twin in one launch
   (:mod:`flashlite.kernels.attention.shared_prefix`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashlite import _backend, stats
from flashlite._caches import Cache
from flashlite.masking import masks
from flashlite.ops._dispatch import forward_only, plain_eager
from flashlite.ops.attention.backends.split_kv.decode import attention_decode_fwd, descale_args
from flashlite.ops.attention.backends.split_kv.merge import (
    Pair,
    bound_merge,
    merge_kernel,
    merge_torch,
)
from flashlite.ops.attention.backends.split_kv.splits import prefix_splits
from flashlite.ops.attention.checks import DTYPES, check_scale, check_sinks, check_splits
from flashlite.ops.attention.fp8 import E4M3, factor_views
from flashlite.ops.attention.kvcache import attention_kvcache, kvcache_key
from flashlite.ops.attention.ops import ATTENTION_FWD
from flashlite.ops.attention.request import Request
from flashlite.ops.common import check_flags, moved_call_device


@forward_only
def attention_shared_prefix(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    validate: bool | str = True,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | Pair:
    """Decoding B requests that share one prompt prefix (layout ``b n h d``): the same result as
    :func:`attention_kvcache` over each request's keys ``[prefix ; own cache]``, with the prefix
    stored once and read once per step for all requests. Forward only.

    Args:
        q: ``(B, Nq, Hq, D)``, the new tokens' queries.
        prefix_k, prefix_v: ``(Np, Hkv, D)``, the shared prefix: absolute positions ``0..Np−1``
            of every request. Any strides.
        k_cache, v_cache, cache_seqlens, k_new, v_new, block_table: each request's own keys
            after the prefix, exactly as :func:`attention_kvcache` takes them (contiguous
            ``(B, Ncap, Hkv, D)`` or paged; ``k_new``/``v_new`` written in place at
            ``cache_seqlens[b]``).
        causal, window, softcap, scale: as :func:`attention_kvcache`, over the whole sequence:
            query i of request b sits at ``Np + cache_seqlens[b] + Nnew − Nq + i``.
        sinks: ``(Hq,)`` logits in the scaled-score space (fp32 or q's dtype): each row's
            softmax gets one more term ``e^sink`` with no value (gpt-oss).
        num_splits: key chunks per program row of the prefix pass, also passed to the suffix
            pass (None: chosen to fill the GPU; 1 on CPU).
        return_lse: also return the fp32 LSE ``(B, Hq, Nq)`` (the sink's term included).
        validate: as :func:`attention_kvcache` (the suffix cache's values).
        k_descale, v_descale: with ``torch.float8_e4m3fn`` prefix and caches, their fp32
            factors, ``(1,)`` or one per KV head ``(Hkv,)`` (the prefix is shared by every
            request), as :func:`attention_kvcache` takes them; appended keys are quantised
            with them.

    Returns:
        ``out`` ``(B, Nq, Hq, D)`` (and the LSE). A row that sees no key gives 0 and LSE −inf,
        or the sink with one. Given tensors that require grad, it computes, and a backward
        that reaches its outputs raises (as :func:`attention_kvcache`).

    Prefix keys that some rows see and others do not (where a window's left edge, or with
    ``Nq > Nnew + 1`` the causal diagonal, cuts into the prefix: it depends on each request's
    length, which only the device reads) take a slower exact path: torch scores of those keys,
    at most ``capacity + Nq`` of them, masked per request. Keys every row sees stay shared.

    Raises:
        TypeError, ValueError: as :func:`attention_kvcache`, and for a prefix that is not
            ``(Np, Hkv, D)`` of the caches' Hkv and D, q's dtype and device, or sinks not
            ``(Hq,)`` fp32/q's dtype on q's device. Every check comes before anything is
            written into the caches.
    """
    tensors = (
        q,
        prefix_k,
        prefix_v,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        sinks,
        k_descale,
        v_descale,
    )
    options = (causal, scale, window, softcap, num_splits, validate)
    key = kvcache_key(tensors, options)  # (None while tracing, or for inputs that need grad)
    step = _checked.get(key) if key is not None else None
    if step is None or not plain_eager(q, prefix_k, prefix_v):
        step = _checked_step(tensors, options, return_lse)
        if key is not None and moved_call_device(q.device) is None:  # next time: checks skipped
            _checked.put(key, step)
    with torch.no_grad():
        o, lse = step(*tensors)
    return (o, lse) if return_lse else o


#: :class:`_Step` per kind of call that passed every check (:func:`kvcache_key` of its
#: arguments: shapes, strides, dtypes, devices, alignment and options)
_checked = Cache("attention.shared_prefix_checked", 256)


def _checked_step(tensors: tuple, options: tuple, return_lse: object) -> _Step:
    """Every argument check that does not read values, then the :class:`_Step` of this kind."""
    q, prefix_k, prefix_v, k_cache, v_cache, _, k_new, v_new, block_table, sinks = tensors[:10]
    causal, scale, window, softcap, num_splits, _ = options
    for name, t in (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v), ("k_cache", k_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_flags(causal=causal, return_lse=return_lse)
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(
            f"q and k_cache must have 4 dimensions (b n h d), got "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    hq, hkv = q.shape[2], k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's Hq={hq} must be a multiple of the caches' Hkv={hkv}")
    _check_inputs(q, prefix_k, prefix_v, hkv, sinks, k_cache.dtype)
    if k_cache.dtype == E4M3:  # (the caches' own checks come with the suffix pass)
        k_scale, v_scale = tensors[10:]
        given = {"q_descale": None, "k_descale": k_scale, "v_descale": v_scale}
        factor_views(given, 1, hkv, q, per_head=True)  # (checked before the suffix appends)
    mask = masks.describe(causal, window, softcap)
    sm_scale = check_scale(scale, q.shape[3])
    splits = check_splits(num_splits)
    # (sizes only: attention_kvcache checks these arguments)
    n_new = k_new.shape[1] if isinstance(k_new, torch.Tensor) and k_new.dim() == 4 else 0
    paged = isinstance(block_table, torch.Tensor) and block_table.dim() == 2
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]  # type: ignore[union-attr]
    return _Step(q, prefix_k, mask, sm_scale, splits, n_new, capacity, options)


class _Step:
    """One kind of shared-prefix step, its decisions made once: the mask, the prefix keys every
    row sees and those only some see (:func:`_spans`), the prefix pass's key chunks and the
    merge's bound launch. Called with the step's tensors."""

    def __init__(
        self,
        q: torch.Tensor,
        prefix_k: torch.Tensor,
        mask: masks.Mask,
        scale: float,
        splits: int | None,
        n_new: int,
        capacity: int,
        options: tuple,
    ) -> None:
        self.mask, self.scale, self.n_new, self.options = mask, scale, n_new, options
        self.n_prefix = prefix_k.shape[0]
        self.bulk, self.edges = _spans(self.n_prefix, q.shape[1], n_new, capacity, mask)
        self.prefix_mask = masks.describe(False, None, mask.softcap)  # (every row sees the bulk)
        self.splits = splits if splits is not None else _prefix_splits(q, prefix_k, self.bulk)
        self._merge: Any = None  # bound at the first run (its tensors specialise)

    def __call__(
        self,
        q: torch.Tensor,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
        sinks: torch.Tensor | None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> Pair:
        causal, scale, window, softcap, num_splits, validate = self.options
        nq = q.shape[1]
        # the suffix pass first: attention_kvcache checks its own arguments before its append,
        # and nothing after it can fail a check (the prefix pass's inputs passed them)
        o_s, lse_s = attention_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            k_new=k_new,
            v_new=v_new,
            block_table=block_table,
            causal=causal,
            scale=scale,
            window=window,
            softcap=softcap,
            num_splits=num_splits,
            return_lse=True,
            validate=validate,
            sinks=sinks,
            k_descale=k_descale,
            v_descale=v_descale,
        )
        scales = None
        if prefix_k.dtype == E4M3:  # the prefix's (1, Hkv) factors, one per KV head
            hkv = prefix_k.shape[1]
            given = {"q_descale": None, "k_descale": k_descale, "v_descale": v_descale}
            scales = factor_views(given, 1, hkv, q, per_head=True)
        parts = []
        if self.bulk[0] < self.bulk[1]:
            parts.append(self._prefix_pass(q, prefix_k, prefix_v, scales))
        if self.edges:  # (request b's queries sit at Np + cache_seqlens[b] + Nnew − Nq + i)
            pos = (
                cache_seqlens.unsqueeze(1)
                + (self.n_prefix + self.n_new - nq)
                + torch.arange(nq, device=q.device)
            )
            if scales is not None:  # (the torch path reads the dequantised keys)
                prefix_k = prefix_k.float() * scales[1].view(1, -1, 1)
                prefix_v = prefix_v.float() * scales[2].view(1, -1, 1)
            parts.append(_edge_pass(q, prefix_k, prefix_v, self.edges, pos, self.scale, self.mask))
        if len(parts) == 2:  # (the exact path's partial folded into the shared pass's)
            parts = [stats.merge_attention(parts[0][0].float(), parts[0][1], *parts[1])]
        if not parts:  # (the whole prefix is out of every row's window)
            return o_s, lse_s
        parts.append((o_s.transpose(1, 2), lse_s))
        if torch.compiler.is_compiling():  # (Inductor fuses the torch twin)
            o, lse = merge_torch(parts)
            return o.transpose(1, 2), lse
        if moved_call_device(q.device) is not None:  # (CPU tensors, kernels on a GPU: moved)
            return merge_kernel(parts[0], parts[1], torch.empty_like(q))
        return self.merge(parts[0], parts[1], torch.empty_like(q))

    def _prefix_pass(
        self,
        q: torch.Tensor,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        scales: list[torch.Tensor] | None = None,
    ) -> Pair:
        """The prefix keys every row sees against every row, unmasked: ``(B, Hq, Nq, D)`` and
        LSE views. All ``B·Nq·G`` rows of a KV head are one problem of the decode kernel
        (``scales``: an e4m3 prefix's ``(1, Hkv)`` factors, q's, k's and v's)."""
        bsz, nq, hq, d = q.shape
        hkv = prefix_k.shape[1]
        lo, hi = self.bulk
        # (Hq, B, Nq, D) in memory: the rows of KV head g are query heads g·G..g·G+G−1 of every
        # request, so both the gathered q and the result are plain views of one dense tensor
        qg = q.permute(2, 0, 1, 3).reshape(1, hkv, bsz * nq * hq // hkv, d)
        k, v = (t[lo:hi].unsqueeze(0).transpose(1, 2) for t in (prefix_k, prefix_v))
        if torch.compiler.is_compiling():  # (the op, which the tracer sees through)
            # (1: the forward kernel; an e4m3 prefix takes the decode kernel, which widens it)
            splits = 0 if self.splits == 1 and scales is None else self.splits
            request = Request.of_call(
                False, self.scale, None, self.mask.softcap, None, splits, None
            )
            if scales is not None:
                request = request._replace(q_descale=scales[0], k_descale=scales[1])
                request = request._replace(v_descale=scales[2])
            o, lse = ATTENTION_FWD(qg, k, v, request)
        else:  # (the launcher itself: the inputs passed every check the op would make)
            descales = None if scales is None else descale_args(*scales)
            o, lse, _ = attention_decode_fwd(
                qg, k, v, None, self.prefix_mask, self.scale, num_splits=self.splits,
                descales=descales,
            )  # fmt: skip
        return o.reshape(hq, bsz, nq, d).transpose(0, 1), lse.reshape(hq, bsz, nq).transpose(0, 1)

    def merge(self, a: Pair, b: Pair, out: torch.Tensor) -> Pair:
        """:func:`merge_kernel`, its launch bound once for this kind of step."""
        if self._merge is None:
            self._merge = bound_merge(a, b, out)
        return self._merge(a, b, out)


def _check_inputs(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    hkv: int,
    sinks: object,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """The prefix (``(Np, Hkv, D)`` twice, q's dtype, or e4m3 like the caches, and q's
    device) and the sinks (:func:`check_sinks`): everything the prefix pass could refuse,
    checked before the suffix pass appends."""
    d = q.shape[3]
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if t.dim() != 3 or t.shape[1:] != (hkv, d):
            raise ValueError(
                f"{name} must be (Np, Hkv={hkv}, D={d}) like the caches' heads, "
                f"got {tuple(t.shape)}"
            )
        fp8 = t.dtype == E4M3 and cache_dtype == E4M3 and q.dtype in DTYPES[:2]
        if not fp8 and (t.dtype != q.dtype or t.dtype not in DTYPES):
            raise TypeError(
                f"{name} has dtype {t.dtype}; q, the prefix and the caches share "
                "one of torch.float16, torch.bfloat16, torch.float32 (or the prefix and the "
                "caches are torch.float8_e4m3fn with 16-bit q)"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(
            f"prefix_k and prefix_v must have one shape, got "
            f"{tuple(prefix_k.shape)} and {tuple(prefix_v.shape)}"
        )
    check_sinks(sinks, q, q.shape[2])


def _spans(
    n_prefix: int, nq: int, n_new: int, capacity: int, mask: masks.Mask
) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The prefix keys every row sees, ``[lo, hi)``, and the spans some rows see, from sizes
    alone: query positions ``P = Np + c − Nq + i`` with ``c = cache_seqlens[b] + Nnew`` in
    ``[Nnew, capacity]``; P sees ``[P − left, P + right]``."""
    p_lo, p_hi = n_prefix + n_new - nq, n_prefix + capacity - 1

    def clamp(x: int) -> int:
        return min(max(x, 0), n_prefix)

    left, right = mask.left, mask.right
    lo, hi = (0, 0) if left is None else (clamp(p_hi - left), clamp(p_lo - left))
    end_lo, end_hi = (
        (n_prefix,) * 2 if right is None else (clamp(p_lo + right + 1), clamp(p_hi + right + 1))
    )
    if lo >= end_lo:  # no key seen by every row: all that some see is one span
        return (0, 0), [(hi, end_hi)] if hi < end_hi else []
    return (lo, end_lo), [s for s in ((hi, lo), (end_lo, end_hi)) if s[0] < s[1]]


def _prefix_splits(q: torch.Tensor, prefix_k: torch.Tensor, bulk: tuple[int, int]) -> int:
    """Key chunks of the prefix pass: :func:`prefix_splits` on a GPU, 1 in the interpreter."""
    if not q.is_cuda or _backend.kernels_interpreted():
        return 1
    bsz, nq, hq, d = q.shape
    hkv = prefix_k.shape[1]
    return prefix_splits(
        bsz * nq * hq // hkv,
        hkv,
        bulk[1] - bulk[0],
        d,
        q.element_size(),
        _backend.num_sms(q.device.index or 0),
    )


def _edge_pass(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    spans: list[tuple[int, int]],
    pos: torch.Tensor,
    scale: float,
    mask: masks.Mask,
) -> Pair:
    """The prefix keys in ``spans`` against every row, each masked by its own position ``pos``
    ``(B, Nq)`` (torch, fp32, materialised: the slower exact path)."""
    bsz, nq, hq, d = q.shape
    hkv = prefix_k.shape[1]
    j = torch.cat([torch.arange(a, b, device=q.device) for a, b in spans])
    k, v = prefix_k[j].float(), prefix_v[j].float()  # (E, Hkv, D)
    s = torch.einsum("bnkgd,ekd->bkgne", q.float().reshape(bsz, nq, hkv, hq // hkv, d), k) * scale
    if mask.softcap is not None:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    seen = torch.ones_like(s[0, 0, 0], dtype=torch.bool).expand(bsz, nq, -1)
    if mask.left is not None:
        seen = seen & (j >= pos.unsqueeze(-1) - mask.left)
    if mask.right is not None:
        seen = seen & (j <= pos.unsqueeze(-1) + mask.right)
    s = s.masked_fill(~seen[:, None, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bkgne,ekd->bkgnd", stats.torch_probs_from_lse(s, lse), v)
    return o.reshape(bsz, hq, nq, d), lse.reshape(bsz, hq, nq)
