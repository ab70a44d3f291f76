"""The KV-cache decode step behind :func:`flashlite.attention_kvcache`: the value checks, the
append of ``k_new``/``v_new`` and the decode kernel, planned once per kind of call
(:class:`KVCachePlan`), and its custom op ``flashlite::attention_kvcache``."""

from __future__ import annotations

import torch

from flashlite._caches import Cache
from flashlite.ops.attention.checks import _check_cache_values
from flashlite.ops.attention.decode import DecodePlan
from flashlite.ops.attention.plan import _meta, _planned


def _kvcache_key(tensors: tuple, options: tuple) -> tuple | None:
    """What :func:`attention_kvcache`'s checks read — each tensor's :func:`_meta` (plain
    ``torch.Tensor`` s only) and each option's type and value — or None where an option is not
    a plain value (those calls are checked every time), and None while tracing."""
    if torch.compiler.is_compiling():
        return None
    key: list = []
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.requires_grad):
            return None  # (a tensor that requires grad: refused, or not, by the checks each time)
        key.append(_meta(t))
    for x in options:
        kind = type(x)
        if kind is tuple:
            if not all(type(i) is int for i in x):
                return None
        elif kind not in (bool, int, float, type(None)):
            return None
        key.append((kind, x))
    return tuple(key)


#: :func:`attention_kvcache`'s plans by its own arguments (:func:`_kvcache_key`): a call that
#: matches passed every check before.
_checked_kvcache = Cache("attention.kvcache_checked", 1024)


class KVCachePlan:
    """:func:`_kvcache` for one kind of call (shapes, strides, dtypes and options): the value
    checks, the append and a :class:`DecodePlan` over the caches' ``b h n d`` views. Made from
    :func:`_kvcache`'s argument tuple (:data:`_TENSORS` tensors, then its options).

    The kernels index ``cache_seqlens`` and the block table's rows densely: other strides are
    made dense per call (``B`` or ``B·max_pages`` ints, a no-op when they are dense already;
    cheaper than two more strides through every tile load of the decode kernel)."""

    def __init__(self, args: tuple) -> None:
        q, k_cache, v_cache, cache_seqlens, k_new, _, block_table = args[:_TENSORS]
        causal, scale, window_left, window_right, softcap, num_splits, validate = args[_TENSORS:]
        self.validate = validate
        self.slots, self.num_pages = k_cache.shape[1], k_cache.shape[0]
        self.capacity = block_table.shape[1] * self.slots if block_table is not None else self.slots
        self.n_new = 0 if k_new is None else k_new.shape[1]
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        if block_table is not None:
            block_table = block_table.contiguous()
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.decode = DecodePlan(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
            o.transpose(1, 2), cache_seqlens.contiguous(), block_table, causal, scale,
            (window_left, window_right), softcap or None, num_splits or None, None, None,
        )  # fmt: skip

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run on tensors of the planned kind: ``out`` ``(B, Nq, Hq, D)``, LSE ``(B, Hq, Nq)``."""
        if self.validate:  # every check that reads values, before anything is written (a sync)
            _check_cache_values(cache_seqlens, self.n_new, self.capacity, block_table,
                                self.slots, self.num_pages)  # fmt: skip
        lengths = cache_seqlens = cache_seqlens.contiguous()
        if block_table is not None:
            block_table = block_table.contiguous()
        if self.n_new:
            lengths = _append(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                              self.capacity)  # type: ignore[arg-type]  # fmt: skip
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.decode(q, k_cache, v_cache, lengths, block_table, o, lse)
        return o, lse


def _append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor | None,
    capacity: int,
) -> torch.Tensor:
    """Write ``k_new``/``v_new`` into the caches at ``cache_seqlens[b]``; the new lengths."""
    bsz, n_new, slots = k_new.shape[0], k_new.shape[1], k_cache.shape[1]
    # (clamped: without validation a bad length must still stay inside the cache)
    pos = (cache_seqlens.long()[:, None] + torch.arange(n_new, device=k_new.device)[None, :]
           ).clamp(0, capacity - 1)  # fmt: skip
    if block_table is None:
        rows = torch.arange(bsz, device=k_new.device)[:, None].expand_as(pos)
        k_cache[rows, pos] = k_new
        v_cache[rows, pos] = v_new
    else:
        pages = block_table.long().clamp(0, k_cache.shape[0] - 1)
        page = torch.gather(pages, 1, pos // slots)
        k_cache[page, pos % slots] = k_new
        v_cache[page, pos % slots] = v_new
    return (cache_seqlens + n_new).to(torch.int32)


#: :class:`KVCachePlan` per kind of :func:`_kvcache` call.
_kvcache_plans = Cache("attention.kvcache", 1024)


#: The tensors that lead :func:`_kvcache`'s arguments (q, the caches, lengths, new keys and
#: values, the block table); the options follow.
_TENSORS = 7


def _kvcache_plan(args: tuple) -> KVCachePlan:
    """The :class:`KVCachePlan` of :func:`_kvcache`'s (checked) arguments, made on first use."""
    key = (*map(_meta, args[:_TENSORS]), *args[_TENSORS:])
    return _planned(_kvcache_plans, key, lambda: KVCachePlan(args))


def _kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    block_table: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_kvcache` after its argument checks: the value checks, the append, the
    decode kernel (:class:`KVCachePlan`). ``num_splits`` 0 chooses; ``softcap`` 0.0 is none."""
    args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale,
            window_left, window_right, softcap, num_splits, validate)  # fmt: skip
    return _kvcache_plan(args)(*args[:_TENSORS])


#: ``flashlite::attention_kvcache``: :func:`_kvcache` as a custom op that declares the caches
#: written (the append), so ``torch.compile`` traces a decode step through it.
_attention_kvcache_op = torch.library.custom_op(
    "flashlite::attention_kvcache", mutates_args=("k_cache", "v_cache")
)(_kvcache)


@_attention_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale,  # type: ignore[no-untyped-def]
      window_left, window_right, softcap, num_splits, validate):  # fmt: skip
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                            dtype=torch.float32)  # fmt: skip
