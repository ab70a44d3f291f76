"""The KV-cache decode step behind :func:`flashlite.attention_kvcache`: the value checks, the
append of ``k_new``/``v_new`` and the decode kernel, planned once per kind of call
(:class:`KVCachePlan`), and its custom op ``flashlite::attention_kvcache``."""

from __future__ import annotations

from typing import Any

import torch

from flashlite import _launch
from flashlite._caches import Cache
from flashlite.kernels.attention import kvcache as KKV
from flashlite.masking.mod_args import ModArgs, Slots, unspec_mod
from flashlite.ops._dispatch import Op
from flashlite.ops.attention.checks import check_cache_values, kv_record, report_kv_problems
from flashlite.ops.attention.decode import DecodePlan
from flashlite.ops.attention.plan import tensor_meta
from flashlite.ops.attention.request import Request
from flashlite.ops.common import moved, moved_call_device


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


class KVCachePlan:
    """:func:`_kvcache` for one kind of call (shapes, strides, dtypes and options): the value
    checks, the append and a :class:`DecodePlan` over the caches' ``b h n d`` views. Made from
    :func:`_kvcache`'s argument tuple (:data:`_TENSORS` tensors, then its options).

    ``validate``: ``"device"`` checks the values on the device, in the append kernel
    (:mod:`flashlite.kernels.attention.kvcache`), without a host sync: a bad value is reported
    by this call on the CPU, by a later call on a GPU; ``"sync"`` checks them on the host first
    (one sync), before anything is written; ``"off"`` checks nothing (values clamped).

    The kernels index ``cache_seqlens`` and the block table's rows densely: other strides are
    made dense per call (``B`` or ``B·max_pages`` ints, a no-op when they are dense already;
    cheaper than two more strides through every tile load of the decode kernel)."""

    def __init__(
        self,
        args: tuple,
        sinks: bool = False,
        mask: ModArgs | None = None,
        score: ModArgs | None = None,
    ) -> None:
        q, k_cache, v_cache, cache_seqlens, k_new, _, block_table = args[:_TENSORS]
        which, scale, num_splits, validate = args[_TENSORS:]  # (which keys: a masks.Mask)
        self.validate = validate
        self.slots, self.num_pages = k_cache.shape[1], k_cache.shape[0]
        self.page_size = self.slots if block_table is not None else 0
        self.capacity = block_table.shape[1] * self.slots if block_table is not None else self.slots
        self.max_pages = block_table.shape[1] if block_table is not None else 0
        self.n_new = 0 if k_new is None else k_new.shape[1]
        self.bsz = q.shape[0]
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.device_check = validate == "device"
        # the append kernel runs when there is something to write or to check on the device
        self.prepare = self.n_new > 0 or self.device_check
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        self.prepare_options = {
            **KKV.append_config(hkv, d),
            "PAGE_SIZE": self.page_size,
            "CHECK": self.device_check,
            "APPEND": self.n_new > 0,
        }
        self.prepare_grid = (self.bsz, max(self.n_new, 1), 1)
        self.sizes = (hkv, d, self.n_new, self.capacity, self.num_pages, self.max_pages)
        self._prepare: Any = None  # bound at the first run (its tensors specialise)
        if block_table is not None:
            block_table = block_table.contiguous()
        o = torch.empty_like(q)  # (as each call makes it: strided like q, which the key pins)
        self.decode = DecodePlan(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            o.transpose(1, 2),
            cache_seqlens.contiguous(),
            block_table,
            which,
            scale,
            num_splits or None,
            None,
            None,
            sinks,
            _mod_fn(mask),
            _mod_fn(score),
        )
        # the mods' eight buffer slots, their numbers fixed (None: no mod)
        self.mod_slots = None
        if mask is not None or score is not None:
            self.mod_slots = Slots([*_slots_of(mask), *_slots_of(score)])

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        mask: ModArgs | None = None,
        score: ModArgs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run on tensors of the planned kind: ``out`` ``(B, Nq, Hq, D)``, LSE ``(B, Hq, Nq)``
        (``sinks``, ``mask`` and ``score`` given iff planned with them)."""
        if self.validate == "sync":  # every value check before anything is written (a sync)
            check_cache_values(
                cache_seqlens, self.n_new, self.capacity, block_table, self.slots, self.num_pages
            )
        lengths = cache_seqlens = cache_seqlens.contiguous()
        if block_table is not None:
            block_table = block_table.contiguous()
        if self.prepare:
            lengths = self._run_prepare(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
        o = torch.empty_like(q)  # (empty_like: less host time than a shape, dtype and device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        bufs = None
        if self.mod_slots is not None:  # this call's tensors, mask's first
            bufs = self.mod_slots([*(mask[1] if mask else ()), *(score[1] if score else ())])
        self.decode(q, k_cache, v_cache, lengths, block_table, o, lse, sinks, bufs)
        return o, lse

    def _run_prepare(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
    ) -> torch.Tensor:
        """The append kernel (checks included with device validation): the new lengths."""
        device = cache_seqlens.device
        if self.device_check:  # a bad value an earlier call recorded: reported first
            report_kv_problems(device, False, earlier=True)
            record, host = kv_record(device)[:2]
        else:
            record = host = cache_seqlens  # (stand-ins: never read)
        lengths = torch.empty_like(cache_seqlens)  # (dense int32 (B,), as made above)
        k_src = k_new if k_new is not None else k_cache
        v_src = v_new if v_new is not None else v_cache
        new_strides = (k_src.stride() + v_src.stride()) if k_new is not None else (0,) * 8
        table = block_table if block_table is not None else cache_seqlens
        args = (
            k_cache,
            v_cache,
            k_src,
            v_src,
            cache_seqlens,
            lengths,
            table,
            record,
            host,
            *k_cache.stride(),
            *v_cache.stride(),
            *new_strides,
            block_table.stride(0) if block_table is not None else 0,
            *self.sizes,
        )
        if self._prepare is None:
            self._prepare = _launch.launcher(KKV._kvcache_append_kernel).bind(
                args, self.prepare_options
            )
        self._prepare(self.prepare_grid, *args)
        if self.device_check and device.type != "cuda":  # no sync to save: reported here
            report_kv_problems(device, True, earlier=False)
        return lengths


#: :class:`KVCachePlan` per kind of :func:`_kvcache` call.
_kvcache_plans = Cache("attention.kvcache", 1024)


#: The tensors that lead :func:`_kvcache`'s arguments (q, the caches, lengths, new keys and
#: values, the block table); the options follow.
_TENSORS = 7


def _mod_fn(mod: ModArgs | None) -> tuple[Any, int] | None:
    """A mod's ``(@triton.jit function, buffer count)``, or None."""
    if mod is None:
        return None
    fns, _, n_buf = unspec_mod(*mod)
    return fns[0], n_buf


def _slots_of(mod: ModArgs | None) -> list[Any]:
    """A mod's four buffer slots (zeros for None)."""
    return unspec_mod(*mod)[1] if mod is not None else [0] * 4


def _mod_key(mod: ModArgs | None) -> tuple | None:
    return None if mod is None else (mod[0], *map(tensor_meta, mod[1]), *mod[2])


def kvcache_plan(
    args: tuple,
    sinks: torch.Tensor | None = None,
    mask: ModArgs | None = None,
    score: ModArgs | None = None,
) -> KVCachePlan:
    """The :class:`KVCachePlan` of :func:`_kvcache`'s (checked) arguments, made on first use
    (``sinks``: the calls' sink logits, whose kind the plan pins, or None; ``mask`` and
    ``score``: a mask and a score function, whose names, buffers' kinds and numbers it
    pins)."""
    key = (
        *map(tensor_meta, args[:_TENSORS]),
        *args[_TENSORS:],
        tensor_meta(sinks),
        _mod_key(mask),
        _mod_key(score),
    )
    return _kvcache_plans.made(key, KVCachePlan, args, sinks is not None, mask, score)


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
        return _kvcache_moved(args, dev, request.sinks, mask, score)
    plan = kvcache_plan(args, request.sinks, mask, score)
    return plan(*args[:_TENSORS], request.sinks, mask, score)


def kvcache_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    request: Request,
) -> tuple:
    """The step's tensors (:data:`_TENSORS` of them) and options, as :class:`KVCachePlan`
    takes them."""
    return (
        q,
        k_cache,
        v_cache,
        request.cache_seqlens,
        k_new,
        v_new,
        request.block_table,
        request.mask,
        request.scale,
        request.num_splits,
        request.validate or "device",
    )


#: The request fields the cache step takes.
KVCACHE_FIELDS = (
    "causal",
    "scale",
    "window_left",
    "window_right",
    "softcap",
    "num_splits",
    "sinks",
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_kvcache` of CPU tensors in a process whose kernels run on the GPU ``dev``: the
    step runs on copies there, and the caches it wrote are copied back. A bad value the device
    check finds is raised by this call (the copy back waits for the device anyway)."""
    q, k_cache, v_cache = args[:3]
    validate = args[-1]
    if validate == "device":  # (a record left on the caller's device: reported first)
        report_kv_problems(q.device, False, earlier=True)
    tensors = tuple(moved(t, dev) for t in args[:_TENSORS])
    k_moved, v_moved, k_new = tensors[1], tensors[2], tensors[4]
    try:
        sinks = moved(sinks, dev)
        mask, score = (
            None if m is None else (m[0], [moved(t, dev) for t in m[1]], m[2])
            for m in (mask, score)
        )
        o, lse = kvcache_plan((*tensors, *args[_TENSORS:]), sinks, mask, score)(
            *tensors, sinks, mask, score
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
