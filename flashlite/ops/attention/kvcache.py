"""Decoding against a KV cache: :func:`attention_kvcache`, its checks (once per kind of call),
and its custom op ``flashlite::attention_kvcache``, which runs the split-KV backend's cache step
(the value checks, the append of ``k_new``/``v_new`` and the decode kernel,
:class:`~flashlite.ops.attention.backends.split_kv.cache.KVCachePlan`)."""

from __future__ import annotations

from typing import Any

import torch

from flashlite._caches import Cache
from flashlite.masking import masks
from flashlite.masking.mod_args import ModArgs
from flashlite.ops._dispatch import Op, forward_only, plain_eager
from flashlite.ops.attention.backends.split_kv.cache import TENSORS, kvcache_args, kvcache_plan
from flashlite.ops.attention.backends.split_kv.decode import descale_args, descales
from flashlite.ops.attention.cache_checks import cache_fp8, cache_mods, check_call
from flashlite.ops.attention.checks import (
    check_scale,
    check_sinks,
    check_splits,
    report_kv_problems,
)
from flashlite.ops.attention.fp8 import E4M3
from flashlite.ops.attention.request import Request, tensor_meta
from flashlite.ops.common import check_flags, moved, moved_call_device


def kvcache_key(tensors: tuple, options: tuple) -> tuple | None:
    """What :func:`attention_kvcache`'s checks read — each tensor's :func:`tensor_meta` (plain
    ``torch.Tensor`` s only) and each option's type and value — or None where an option is not
    a plain value (those calls are checked every time), and None while tracing."""
    if torch.compiler.is_compiling():
        return None
    key: list = []
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.requires_grad):
            return None  # (a tensor that requires grad: refused, or not, by the checks each time)
        key.append(tensor_meta(t))
    for x in options:
        kind = type(x)
        if kind is tuple:
            if not all(type(i) is int for i in x):
                return None
        elif kind not in (bool, int, float, str, type(None)):
            return None
        key.append((kind, x))
    return tuple(key)


#: :func:`attention_kvcache`'s plans by its own arguments (:func:`kvcache_key`): a call that
#: matches passed every check before.
checked_kvcache = Cache("attention.kvcache_checked", 1024)


def _kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_kvcache` after its argument checks: the value checks, the append, the
    decode kernel (:class:`KVCachePlan`). ``request`` holds the cache's lengths and pages, the
    mask, the split, ``validate``, the fp32 contiguous sinks and the mods as the ops carry them
    (:func:`~flashlite.ops.attention.mod_args.spec_mod`)."""
    request.refuse("flashlite::attention_kvcache", KVCACHE_FIELDS)
    if request.cache_seqlens is None:
        raise ValueError("flashlite::attention_kvcache needs cache_seqlens")
    args = kvcache_args(q, k_cache, v_cache, k_new, v_new, request)
    mask, score = request.mask_args, request.score_args
    dev = moved_call_device(q.device)
    if dev is not None:
        return _kvcache_moved(args, dev, request.sinks, mask, score, descales(request))
    plan = kvcache_plan(args, request.sinks, mask, score)
    return plan(*args[:TENSORS], request.sinks, mask, score, descales(request))


#: The request fields the cache step takes.
KVCACHE_FIELDS = (
    "causal",
    "scale",
    "window_left",
    "window_right",
    "softcap",
    "num_splits",
    "sinks",
    "q_descale",
    "k_descale",
    "v_descale",
    "cache_seqlens",
    "block_table",
    "validate",
    "mask_mod",
    "mask_tensors",
    "mask_nums",
    "score_mod",
    "score_tensors",
    "score_nums",
)


def _kvcache_moved(
    args: tuple,
    dev: torch.device,
    sinks: torch.Tensor | None = None,
    mask: ModArgs | None = None,
    score: ModArgs | None = None,
    scales: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_kvcache` of CPU tensors in a process whose kernels run on the GPU ``dev``: the
    step runs on copies there, and the caches it wrote are copied back. A bad value the device
    check finds is raised by this call (the copy back waits for the device anyway)."""
    q, k_cache, v_cache = args[:3]
    validate = args[-1]
    if validate == "device":  # (a record left on the caller's device: reported first)
        report_kv_problems(q.device, False, earlier=True)
    tensors = tuple(moved(t, dev) for t in args[:TENSORS])
    k_moved, v_moved, k_new = tensors[1], tensors[2], tensors[4]
    try:
        sinks = moved(sinks, dev)
        mask, score = (
            None if m is None else (m[0], [moved(t, dev) for t in m[1]], m[2])
            for m in (mask, score)
        )
        o, lse = kvcache_plan((*tensors, *args[TENSORS:]), sinks, mask, score)(
            *tensors, sinks, mask, score, moved(scales, dev)
        )
    finally:  # what the append wrote (the good rows, when a bad one is reported)
        if k_new is not None:
            k_cache.copy_(k_moved)
            v_cache.copy_(v_moved)
    if validate == "device":
        report_kv_problems(dev, True, earlier=False)
    return o.to(q.device), lse.to(q.device)


def _kvcache_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor]:
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


#: ``flashlite::attention_kvcache``: :func:`_kvcache` as an op that declares the caches written
#: (the append), so ``torch.compile`` traces a decode step through it. Forward only.
KVCACHE = Op(
    "attention_kvcache",
    _kvcache,
    fake=_kvcache_fake,
    inputs=5,
    request=Request,
    takes=KVCACHE_FIELDS,
    mutates_args=("k_cache", "v_cache"),
    moves=False,
)

#: what ``validate`` becomes in the op (a string: the schema holds one type)
VALIDATE_MODES = {True: "device", False: "off", "sync": "sync"}


@forward_only
def attention_kvcache(
    q: torch.Tensor,
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
    num_splits: int | None = None,
    return_lse: bool = False,
    validate: bool | str = True,
    sinks: torch.Tensor | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decoding against a KV cache, optionally paged: the query heads of a GQA group share one
    K/V read, the keys are split across programs (flash-decoding). Layout ``b n h d`` only (no
    ``layout`` keyword: pass a ``b h n d`` tensor as ``t.transpose(1, 2)``, a view). Forward
    only: call it under ``torch.no_grad()``. Guide: docs/guides/decoding.md.

    Args:
        q: ``(B, Nq, Hq, D)``, the new tokens' queries.
        k_cache, v_cache: ``(B, Ncap, Hkv, D)``, or with ``block_table`` a paged cache
            ``(num_pages, page_size, Hkv, D)``, page size any multiple of 16. Any strides;
            expanded or overlapping caches are read, but refused when ``k_new`` is written.
        cache_seqlens: int32 ``(B,)``, required: keys already in the cache per batch (any
            stride).
        k_new, v_new: ``(B, Nnew, Hkv, D)``, written into the cache in place at
            ``cache_seqlens[b]`` before attending (both or neither).
        block_table: int32 ``(B, max_pages)``: batch b's key j lives in page
            ``block_table[b, j // page_size]`` (vLLM's convention; any strides).
        causal, scale, window, softcap: as :func:`attention`, aligned bottom-right to
            ``cache_seqlens[b] + Nnew`` keys (with ``causal`` query i of Nq sees keys up to
            ``cache_seqlens[b] + Nnew − Nq + i``).
        num_splits: key chunks per block of query rows (None: one per SM,
            :func:`splits_for`; 1 on CPU).
        return_lse: also return the fp32 LSE ``(B, Hq, Nq)``.
        validate: check ``cache_seqlens`` and the block table's pages in use (bad values are
            clamped anyway: wrong results, never an access outside the caches). ``True``: on
            the device, in the append's launch, no host sync; a bad batch row writes no key,
            raised by this call on the CPU, by a *later* call on a GPU. ``"sync"``: on the
            host before anything is written. ``False``: no check.
        sinks: ``(Hq,)`` sink logits, as :func:`attention` (merged once, whatever the split).
        mask_mod: a mask function (:func:`flashlite.mods.mask_mod`, :mod:`flashlite.gallery`)
            narrowing what ``causal`` and ``window`` let each query see, its buffers on q's
            device; ``q_idx`` is ``cache_seqlens[b] + Nnew − Nq + i``, ``h`` the query head.
        score_mod: a score function (:func:`flashlite.mods.score_mod`, e.g.
            :func:`flashlite.gallery.alibi`) on each scaled score ``q·k·scale`` the masks
            leave, with the same indices; not with ``softcap`` (use
            :func:`flashlite.gallery.tanh_softcap`).
        k_descale, v_descale: with ``torch.float8_e4m3fn`` caches (q, ``k_new`` and ``v_new``
            16-bit), their fp32 descale factors (``k ≈ k8·k_descale``): ``(1,)``, one per KV
            head ``(Hkv,)`` or per batch and KV head ``(B, Hkv)``; None means 1. ``k_new`` and
            ``v_new`` are divided by them and rounded to e4m3 (clamped to ±448) as they are
            appended. The cache is widened to bf16 as it is read: the step reads half the
            bytes of a bf16 cache. Guide: docs/guides/fp8.md.

    Returns:
        ``out`` ``(B, Nq, Hq, D)`` (and the LSE). Given tensors that require grad it computes
        all the same, and a backward that reaches its outputs raises a ``RuntimeError``.

    Raises:
        TypeError: non-tensors, mixed or unsupported dtypes, index tensors that are not int32,
            flags that are not bools, ``validate`` not True, False or ``"sync"``.
        ValueError: shapes (the message shows the ``b n h d`` shapes expected and the
            transposes that fix ``b h n d`` tensors), devices, ``k_new`` with overlapping caches
            or one tensor as both; with ``validate`` (raised when it says), a negative
            ``cache_seqlens``, ``cache_seqlens + Nnew`` past the capacity, a page id outside
            ``[0, num_pages)`` among the pages in use; ``score_mod`` with ``softcap``. Every
            argument check comes before anything is written.
    """
    tensors = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    options = (causal, scale, window, softcap, num_splits, validate, mask_mod, score_mod)
    scales = (k_descale, v_descale)
    key = kvcache_key((*tensors, sinks), options)  # (None with a mask function: checked each call)
    plan = checked_kvcache.get(key) if key is not None else None
    # a kind of call seen before (factors with 16-bit caches go on to be refused by name)
    fp8_ok = k_descale is v_descale is None or k_cache.dtype == E4M3
    if plan is not None and fp8_ok and plain_eager(q, k_cache, v_cache):
        sink = None if sinks is None else sinks.float()
        if k_cache.dtype == E4M3:  # (the factors, checked: a few attributes, no copies)
            factors = descale_args(*cache_fp8(q, k_cache, k_descale, v_descale).values())
            o, lse = plan(*tensors, sink, None, None, factors)
        else:
            o, lse = plan(*tensors) if sink is None else plan(*tensors, sink)
        return (o, lse) if return_lse else o
    request = _checked_request(tensors, options, return_lse, sinks, key, scales)
    o, lse = KVCACHE(q, k_cache, v_cache, k_new, v_new, request)
    return (o, lse) if return_lse else o


def _checked_request(
    tensors: tuple,
    options: tuple,
    return_lse: bool,
    sinks: torch.Tensor | None,
    key: tuple | None,
    scales: tuple = (None, None),
) -> Request:
    """:func:`attention_kvcache`'s argument checks, for a kind of call not seen before (or one
    with a mask function), and its request; a plain call's plan is kept under ``key``, so the
    next call of that kind skips them."""
    q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table = tensors
    causal, scale, window, softcap, num_splits, validate, mask_mod, score_mod = options
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("cache_seqlens", cache_seqlens),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: pass both or neither")
    check_flags(causal=causal, return_lse=return_lse)
    if not (isinstance(validate, bool) or validate == "sync"):
        raise TypeError(f"validate must be True, False or 'sync', got {validate!r}")
    check_call(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    splits = check_splits(num_splits)
    mask = masks.describe(causal, window, softcap)
    sm_scale = check_scale(scale, q.shape[3])
    sink = check_sinks(sinks, q, q.shape[2])  # (fp32: what the plan's key pins, whatever came in)
    mods_given = cache_mods(mask_mod, score_mod, softcap, q, k_cache, block_table)
    fp8 = cache_fp8(q, k_cache, *scales)
    request = Request.of_mask(
        mask,
        sm_scale,
        num_splits=splits,
        sinks=sink,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        validate=VALIDATE_MODES[validate],
        **mods_given,
        **fp8,
    )
    if not mods_given and key is not None and moved_call_device(q.device) is None:
        # these arguments passed every check above: next time, skip them (and the op layer:
        # CPU tensors whose kernels run on a GPU take the op's moving path every time)
        checked_kvcache.put(
            key, kvcache_plan(kvcache_args(q, k_cache, v_cache, k_new, v_new, request), sink)
        )
    return request
