"""The KV-cache decode step: the value checks, the append of ``k_new``/``v_new`` and the decode
kernel, planned once per kind of call (:class:`KVCachePlan`)."""

from __future__ import annotations

from typing import Any

import torch

from flashlite import _backend, _launch
from flashlite._caches import Cache
from flashlite.kernels.attention import kvcache as KKV
from flashlite.masking.mod_args import ModArgs, Slots, unspec_mod
from flashlite.ops.attention.backends.split_kv.decode import DecodePlan
from flashlite.ops.attention.backends.split_kv.mla import MLADecodePlan
from flashlite.ops.attention.checks import check_cache_values, kv_record, report_kv_problems
from flashlite.ops.attention.request import Request, tensor_meta


class KVCachePlan:
    """:func:`_kvcache` for one kind of call (shapes, strides, dtypes and options): the value
    checks, the append and a :class:`DecodePlan` over the caches' ``b h n d`` views. Made from
    :func:`_kvcache`'s argument tuple (:data:`TENSORS` tensors, then its options).

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
        latent: int | None = None,
    ) -> None:
        q, k_cache, v_cache, cache_seqlens, k_new, _, block_table = args[:TENSORS]
        which, scale, num_splits, validate = args[TENSORS:]  # (which keys: a masks.Mask)
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
        if latent is not None:  # (one latent cache: the values are the keys' bytes)
            self.prepare_options["KEYS_ONLY"] = True
        self.fp8 = k_cache.dtype == torch.float8_e4m3fn
        if self.fp8:  # new keys and values quantised as they are written
            self.prepare_options.update(FP8=True, EXACT=_backend.INTERPRETED)
        self.prepare_grid = (self.bsz, max(self.n_new, 1), 1)
        self.sizes = (hkv, d, self.n_new, self.capacity, self.num_pages, self.max_pages)
        self._prepare: Any = None  # bound at the first run (its tensors specialise)
        if block_table is not None:
            block_table = block_table.contiguous()
        # (as each call makes it: strided like q, which the key pins; MLA: the values' columns)
        self.out_shape = None if latent is None else (*q.shape[:3], latent)
        o = torch.empty_like(q) if latent is None else q.new_empty(self.out_shape)
        if latent is not None:  # absorbed MLA: one latent cache, its first columns the values
            self.decode: Any = MLADecodePlan(
                q.transpose(1, 2),
                k_cache.transpose(1, 2),
                o.transpose(1, 2),
                block_table,
                scale,
                which.causal,
                num_splits or None,
            )
            self.mod_slots = None
            return
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
            self.fp8,
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
        descales: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run on tensors of the planned kind: ``out`` ``(B, Nq, Hq, D)``, LSE ``(B, Hq, Nq)``
        (``sinks``, ``mask`` and ``score`` given iff planned with them; ``descales``, an FP8
        cache's (:func:`~flashlite.ops.attention.backends.split_kv.decode.descales`), iff the
        caches are e4m3)."""
        if self.validate == "sync":  # every value check before anything is written (a sync)
            check_cache_values(
                cache_seqlens, self.n_new, self.capacity, block_table, self.slots, self.num_pages
            )
        lengths = cache_seqlens = cache_seqlens.contiguous()
        if block_table is not None:
            block_table = block_table.contiguous()
        if self.prepare:
            lengths = self._run_prepare(
                k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, descales
            )
        # (empty_like: less host time than a shape, dtype and device)
        o = torch.empty_like(q) if self.out_shape is None else q.new_empty(self.out_shape)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        bufs = None
        if self.mod_slots is not None:  # this call's tensors, mask's first
            bufs = self.mod_slots([*(mask[1] if mask else ()), *(score[1] if score else ())])
        self.decode(q, k_cache, v_cache, lengths, block_table, o, lse, sinks, bufs, descales)
        return o, lse

    def _run_prepare(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
        descales: tuple | None = None,
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
            *((descales[1], descales[2], *descales[3:]) if descales else (lengths, lengths, 0, 0)),
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
TENSORS = 7


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
    latent: int | None = None,
) -> KVCachePlan:
    """The :class:`KVCachePlan` of :func:`_kvcache`'s (checked) arguments, made on first use
    (``sinks``: the calls' sink logits, whose kind the plan pins, or None; ``mask`` and
    ``score``: a mask and a score function, whose names, buffers' kinds and numbers it pins;
    ``latent``: absorbed MLA's value columns, the caches one latent cache)."""
    key = (
        *map(tensor_meta, args[:TENSORS]),
        *args[TENSORS:],
        tensor_meta(sinks),
        _mod_key(mask),
        _mod_key(score),
        latent,
    )
    return _kvcache_plans.made(key, KVCachePlan, args, sinks is not None, mask, score, latent)


def kvcache_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    request: Request,
) -> tuple:
    """The step's tensors (:data:`TENSORS` of them) and options, as :class:`KVCachePlan`
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
