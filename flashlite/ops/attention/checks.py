"""Attention's argument checks: types, shapes, layouts, scales, lengths, offsets and the KV
cache's values, each error naming the argument and what is accepted."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import triton

from flashlite import _backend
from flashlite._caches import register
from flashlite.ops.attention.fp8 import E4M3, check_dtype
from flashlite.ops.common import overlapping, take_record, value_record

LAYOUTS = ("b h n d", "b n h d")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_views(
    q: object,
    k: object,
    v: object,
    layout: object,
    scale: object,
    fp8: bool = False,
    head_dim_v: bool = False,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the public arguments; return the softmax scale and q, k, v as ``b h n d`` views.
    ``fp8``: e4m3 inputs are accepted too (a forward that takes descale factors);
    ``head_dim_v``: V may have a head dim of its own (1 to 256)."""
    # the usual call, in a few tests (host time); anything else, every error included, takes
    # the checks of _check_all, from the caller's tensors
    if (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and type(v) is torch.Tensor
        and q.dim() == 4
        and k.dim() == 4
        and layout in LAYOUTS
    ):
        views = (q, k, v)
        if layout == "b n h d":
            views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if _usual(*views):
            return check_scale(scale, q.shape[-1]), *views
    return _check_all(q, k, v, layout, scale, fp8, head_dim_v)


def _usual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether 4-D ``b h n d`` views pass every check of :func:`_check_all` (one dtype and device
    flashlite runs on, shapes that agree, GQA heads, a head dim from 1 to 256)."""
    qs, ks, dt = q.shape, k.shape, q.dtype
    if not (
        ks == v.shape
        and dt in DTYPES
        and k.dtype == dt
        and v.dtype == dt
        and (q.is_cuda or q.is_cpu)
        and _backend.same_device(k, q)
        and _backend.same_device(v, q)
    ):
        return False
    (b, hq, _, d), (bk, hkv, _, dk) = qs, ks
    return bk == b and dk == d and 0 < d <= MAX_HEAD_DIM and hkv > 0 and hq % hkv == 0


def _check_all(
    q: object,
    k: object,
    v: object,
    layout: object,
    scale: object,
    fp8: bool = False,
    head_dim_v: bool = False,
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`check_views`, every test in order, each failure with its own message."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions ({layout}), got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPES and not (fp8 and t.dtype == E4M3):
            check_dtype(t, name, fp8)
        _backend.check_device(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if layout == "b n h d":  # a strided view, no copy
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3] or (k.shape[3] != v.shape[3] and not head_dim_v):
        shapes = "(B, Hkv, Nk, D) and (B, Hkv, Nk, Dv)" if head_dim_v else "(B, Hkv, Nk, D)"
        raise ValueError(
            f"k and v must have the same shape {shapes} in layout {layout!r}, got "
            f"{tuple(k.shape)} and {tuple(v.shape)} (as b h n d)"
        )
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head dim, got {d} and {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value "
            f"heads ({hkv}) for GQA/MQA"
        )
    if d == 0:
        raise ValueError("head dim must be at least 1, got 0")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} is not supported: flashlite supports 1 to 256")
    if v.shape[3] == 0:
        raise ValueError("v's head dim must be at least 1, got 0")
    if v.shape[3] > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"v's head dim {v.shape[3]} is not supported: flashlite supports 1 to 256"
        )
    return check_scale(scale, d), q, k, v


def check_inputs(
    q: object, k: object, v: object, layout: str, scale: object
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention`'s argument checks for other front-ends (ring attention): the softmax
    scale and ``b h n d`` views of q, k and v, or the errors :func:`attention` raises."""
    return check_views(q, k, v, layout, scale)


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: ``scale`` validated, or ``1/sqrt(D)`` for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not 0 < scale < math.inf:  # (NaN fails it too; comparisons trace under torch.compile)
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return float(scale)


def check_bwd_grads(
    do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
) -> None:
    # autograd already matches shapes (and casts dtypes) for `out.backward(grad)`; this guards
    # direct calls of the op, whose kernels would otherwise read out of bounds
    if do.shape != o.shape or do.dtype != o.dtype:
        raise ValueError(
            f"attention_bwd: do must match the output O, {tuple(o.shape)} {o.dtype}; got "
            f"{tuple(do.shape)} {do.dtype}"
        )
    if dlse is not None and dlse.shape != lse.shape:
        raise ValueError(
            f"attention_bwd: dlse must match the LSE's shape {tuple(lse.shape)}; got "
            f"{tuple(dlse.shape)}"
        )


def check_seqlens(seqlens_k: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``seqlens_k`` validated: an int32 ``(B,)`` tensor on q's device (values checked on CPU)."""
    if seqlens_k is None:
        return None
    if not isinstance(seqlens_k, torch.Tensor):
        raise TypeError(f"seqlens_k must be an int32 torch.Tensor, got {type(seqlens_k).__name__}")
    if seqlens_k.dtype != torch.int32:
        raise TypeError(f"seqlens_k must have dtype torch.int32, got {seqlens_k.dtype}")
    if seqlens_k.shape != (q.shape[0],):
        raise ValueError(
            f"seqlens_k must have shape (B,) = ({q.shape[0]},), got {tuple(seqlens_k.shape)}"
        )
    if seqlens_k.device != q.device:
        raise ValueError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    if seqlens_k.device.type == "cpu" and not torch.compiler.is_compiling():
        nk = k.shape[2]
        if bool(((seqlens_k < 0) | (seqlens_k > nk)).any()):
            raise ValueError(f"seqlens_k values must lie in [0, Nk = {nk}]: {seqlens_k.tolist()}")
    return seqlens_k.contiguous()


def check_sinks(sinks: object, q: torch.Tensor, n_heads: int) -> torch.Tensor | None:
    """``sinks`` validated and made what the kernels read: a float ``(Hq,)`` tensor, fp32 or
    q's dtype, on q's device, returned as a contiguous fp32 tensor (through differentiable ops,
    so its gradient reaches the caller's tensor)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor, got {type(sinks).__name__}")
    if sinks.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"sinks must have dtype torch.float32 or q's {q.dtype}, got {sinks.dtype}")
    if sinks.shape != (n_heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({n_heads},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks.float().contiguous()


def check_cu_seqlens(cu: object, name: str, q: torch.Tensor, max_seqlen: object) -> torch.Tensor:
    """``cu``'s type, shape and device checked: int32 ``(batch + 1,)`` on q's device."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}"
        )
    if cu.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"max_seqlen for {name} must be a non-negative int, got {max_seqlen!r}")
    return cu.contiguous()


def check_cu_values(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int, max_k: int
) -> None:
    """Both offset tensors' values: from 0 to the packed length, never decreasing, no sequence
    longer than its max_seqlen (read back in one host sync)."""
    stats = []
    for cu in (cu_q, cu_k):
        lengths = cu[1:] - cu[:-1]
        stats += [cu[0], cu[-1], lengths.min(), lengths.max()]
    values = torch.stack(stats).tolist()
    for i, (name, cu, total, max_seqlen) in enumerate(
        (("cu_seqlens_q", cu_q, total_q, max_q), ("cu_seqlens_k", cu_k, total_k, max_k))
    ):
        first, last, shortest, longest = values[4 * i : 4 * i + 4]
        if first != 0 or last != total or shortest < 0:
            raise ValueError(
                f"{name} must start at 0, never decrease and end at the packed length {total}; "
                f"got {cu.tolist() if cu.numel() <= 16 else 'first ' + str(first)}"
            )
        if longest > max_seqlen:
            raise ValueError(
                f"max_seqlen ({max_seqlen}) is below the longest sequence of {name} ({longest})"
            )


def check_page_size(slots: int) -> None:
    """A paged cache's page size: a positive multiple of 16, of any size (the decode kernel reads
    one table entry per tile where the page holds whole tiles, one per key row elsewhere)."""
    if slots < 16 or slots % 16:
        raise ValueError(f"page size {slots}: must be a positive multiple of 16")


def check_writable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches ``k_new``/``v_new`` are written into: no two elements of one cache may share
    memory, and the two caches may not be one tensor (torch's in-place ops refuse the same)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if overlapping(t):
            raise ValueError(
                f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) has elements that share "
                "memory (expanded or overlapping strides): k_new/v_new cannot be written into it; "
                "pass a cache of its own (.contiguous() or .clone())"
            )
    if torch.compiler.is_compiling():  # (a trace cannot compare data pointers)
        same = k_cache is v_cache
    else:
        same = k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride()
    if same:
        raise ValueError(
            "k_cache and v_cache are the same memory: k_new and v_new would be "
            "written over each other; pass two caches"
        )


def check_cache_values(
    cache_seqlens: torch.Tensor,
    n_new: int,
    capacity: int,
    block_table: torch.Tensor | None,
    page_size: int,
    num_pages: int,
) -> None:
    """:func:`attention_kvcache`'s value checks, read back in one host sync (a second one only
    to quote the offending values)."""
    lengths = cache_seqlens.long() + n_new
    negative = (cache_seqlens < 0).any()
    too_long = (lengths > capacity).any()
    bad = None  # (the block-table entries in use that lie outside the pool)
    if block_table is not None:
        pages = torch.arange(block_table.shape[1], device=lengths.device)
        used = pages[None, :] < (-(-lengths.clamp(min=0) // page_size))[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
    bad_page = bad.any() if bad is not None else torch.zeros_like(negative)
    is_negative, is_too_long, page_wrong = torch.stack([negative, too_long, bad_page]).tolist()
    if is_negative or is_too_long:
        where = cache_seqlens < 0 if is_negative else lengths > capacity
        b = int(where.nonzero()[0, 0])
        value = int(cache_seqlens[b])
        if is_negative:
            raise ValueError(
                f"cache_seqlens must be >= 0 (keys already in the cache); got "
                f"cache_seqlens[{b}] = {value}"
            )
        raise ValueError(
            f"cache_seqlens + Nnew must be at most {capacity} (the cache's capacity); got "
            f"cache_seqlens[{b}] = {value}, Nnew = {n_new}"
        )
    if page_wrong:
        b, j = (int(i) for i in bad.nonzero()[0])  # type: ignore[union-attr]
        raise ValueError(
            f"block_table holds pages outside [0, {num_pages}) among the pages "
            f"in use: block_table[{b}, {j}] = {int(block_table[b, j])}"  # type: ignore[index]
        )


def check_splits(num_splits: object) -> int | None:
    """``num_splits`` checked: None (choose) or an int >= 1."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    return num_splits


def kv_record(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Where the append kernel records a bad cache value on ``device``, ``(flag, kind, b, j,
    value, Nnew, limit)`` (:mod:`flashlite.kernels.attention.kvcache`), with its host flag
    (:func:`flashlite.ops.common.value_record`)."""
    return value_record("kvcache", device, 7)


def report_kv_problems(device: torch.device, wait: bool, earlier: bool) -> None:
    """Raise the ``ValueError`` for a bad cache value recorded on ``device``: with ``wait`` once
    the device has finished, else only when the host flag already shows one (no sync).
    ``earlier``: the record is an earlier call's (this call's kernel has not run yet)."""
    words = take_record("kvcache", device, wait)
    if words is None:
        return
    _, kind, b, j, value, n_new, limit = words
    if kind == 1:
        what = (
            f"cache_seqlens must be >= 0 (keys already in the cache); got "
            f"cache_seqlens[{b}] = {value}"
        )
    elif kind == 2:
        what = (
            f"cache_seqlens + Nnew must be at most {limit} (the cache's capacity); got "
            f"cache_seqlens[{b}] = {value}, Nnew = {n_new}"
        )
    else:
        what = (
            f"block_table holds pages outside [0, {limit}) among the pages in use: "
            f"block_table[{b}, {j}] = {value}"
        )
    _raise_recorded(
        f"{what} (batch {b} was not written)",
        earlier,
        device,
        "attention_kvcache",
        f"a bad value: {what}. That call wrote no new key for that batch and its "
        "output for it is not meaningful",
        "checks them before anything is written",
    )


def check_offsets_on_device(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int, max_k: int
) -> bool:
    """Launch the offsets check (:mod:`flashlite.kernels.attention.offsets`): no host sync, a
    problem recorded for a later call to raise (:func:`_report_offsets_problems`). False, after
    one warning, when this Triton cannot build the kernel (the caller checks on the host)."""
    from flashlite import _launch
    from flashlite.kernels.attention import offsets as KO

    device = cu_q.device
    if device in _offsets_failed:
        return False
    _report_offsets_problems(device, False, earlier=True)
    record, host, _ = value_record("offsets", device, 7)
    args = (cu_q, cu_k, record, host, cu_q.shape[0] - 1, total_q, total_k, max_q, max_k)
    try:
        _launch.launcher(KO._offsets_check_kernel)[(1,)](*args, BLOCK=1024, num_warps=4)
    except (triton.CompilationError, RuntimeError) as err:
        if device in _offsets_checked:  # it built before: a real failure
            raise
        _offsets_failed.add(device)
        warnings.warn(
            f"flashlite: the device check of cu_seqlens failed to build ({err!r:.300}); "
            "the offsets are checked on the host instead (one sync per call)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _offsets_checked.add(device)
    return True


#: Devices where the offsets-check kernel built (any later error is real) or failed to build.
_offsets_checked: set[torch.device] = register("attention.offsets_checked", set())
_offsets_failed: set[torch.device] = register("attention.offsets_failed", set())


def _report_offsets_problems(device: torch.device, wait: bool, earlier: bool) -> None:
    """Raise the ``ValueError`` for bad offsets recorded on ``device`` (as
    :func:`report_kv_problems` does for the KV cache)."""
    words = take_record("offsets", device, wait)
    if words is None:
        return
    _, which, kind, index, value, limit, _ = words
    name = ("cu_seqlens_q", "cu_seqlens_k")[which]
    if kind == 1:
        what = f"{name} must start at 0; got {name}[0] = {value}"
    elif kind == 2:
        what = f"{name} must end at the packed length {limit}; got {name}[{index}] = {value}"
    elif kind == 3:
        what = f"{name} must never decrease; got {name}[{index + 1}] - {name}[{index}] = {value}"
    else:
        what = (
            f"max_seqlen ({limit}) is below the longest sequence of {name} (sequence "
            f"{index} has {value})"
        )
    _raise_recorded(
        what,
        earlier,
        device,
        "attention_varlen",
        f"bad offsets: {what}. That call's rows are not meaningful (the kernels clamp "
        "offsets: nothing was read or written outside the tensors)",
        "checks them at the call",
    )


def _raise_recorded(
    what: str, earlier: bool, device: torch.device, fn: str, consequence: str, strict: str
) -> None:
    """The ``ValueError`` for a value a device check recorded: ``what`` as it is for this call's
    own record, or, for an ``earlier`` call's, the same named as that call's, with what it did
    (``consequence``) and what ``validate="sync"`` does instead (``strict``)."""
    if not earlier:
        raise ValueError(what)
    raise ValueError(
        f"an earlier flashlite.{fn} call on {device} had {consequence}. Values are checked on "
        f"the device without waiting for it, and a bad one is reported by a later call; "
        f"validate='sync' {strict}"
    )
