"""The KV-cache decode step behind :func:`flashlite.attention_kvcache`: the value checks, the
append of ``k_new``/``v_new`` and the decode kernel, planned once per kind of call
(:class:`KVCachePlan`), and its custom op ``flashlite::attention_kvcache``."""

from __future__ import annotations

import torch

from flashlite.ops.attention.checks import _check_cache_values
from flashlite.ops.attention.decode import DecodePlan
from flashlite.ops.attention.plan import _meta, _planned


def _sub_pages(cache: torch.Tensor, factor: int) -> torch.Tensor:
    """A paged cache ``(num_pages, factor·256, Hkv, D)`` as ``(num_pages·factor, 256, Hkv, D)``:
    a view (:func:`_check_page_size` checked the strides)."""
    n, slots, h, d = cache.shape
    return cache.unflatten(1, (factor, slots // factor)).view(n * factor, slots // factor, h, d)


def _sub_table(block_table: torch.Tensor, factor: int) -> torch.Tensor:
    """``block_table`` over pages of ``factor`` sub-pages: entry p becomes ``p·factor + j``,
    ``j < factor`` (entries outside the pool stay outside it: ``p < 0`` or ``p >= pages``)."""
    steps = torch.arange(factor, device=block_table.device, dtype=torch.int32)
    return (block_table[:, :, None] * factor + steps).flatten(1)


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
_checked_kvcache: dict[tuple, KVCachePlan] = {}


#: Largest page the decode kernel reads as one; bigger pages (multiples of it) are split.
MAX_PAGE = 256


class KVCachePlan:
    """:func:`_kvcache` for one kind of call (shapes, strides, dtypes and options): the value
    checks, the append and a :class:`DecodePlan` over the caches' ``b h n d`` views. Made from
    :func:`_kvcache`'s argument tuple (:data:`_TENSORS` tensors, then its options).

    The kernels index ``cache_seqlens`` and the block table's rows densely: other strides are
    made dense per call (``B`` or ``B·max_pages`` ints). Pages of more than :data:`MAX_PAGE`
    keys are read as that many sub-pages each (views of the caches, the table rewritten)."""

    def __init__(self, args: tuple) -> None:
        q, k_cache, v_cache, cache_seqlens, k_new, _, block_table = args[:_TENSORS]
        causal, scale, window_left, window_right, softcap, num_splits, validate = args[_TENSORS:]
        self.validate = validate
        self.slots, self.num_pages = k_cache.shape[1], k_cache.shape[0]
        self.capacity = block_table.shape[1] * self.slots if block_table is not None else self.slots
        self.n_new = 0 if k_new is None else k_new.shape[1]
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.dense_lengths = cache_seqlens.is_contiguous()
        self.dense_table = block_table is None or block_table.is_contiguous()
        paged = block_table is not None and self.slots > MAX_PAGE
        self.factor = self.slots // MAX_PAGE if paged else 1
        k_cache, v_cache, block_table = self._kernel_view(k_cache, v_cache, block_table)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.decode = DecodePlan(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
            o.transpose(1, 2), cache_seqlens.contiguous(), block_table, causal, scale,
            (window_left, window_right), softcap or None, num_splits or None, None, None,
        )  # fmt: skip

    def _kernel_view(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The caches and block table as the kernels read them: a dense table, and pages of at
        most :data:`MAX_PAGE` keys."""
        if not self.dense_table:
            block_table = block_table.contiguous()  # type: ignore[union-attr]
        if self.factor > 1:
            k_cache, v_cache = _sub_pages(k_cache, self.factor), _sub_pages(v_cache, self.factor)
            block_table = _sub_table(block_table, self.factor)  # type: ignore[arg-type]
        return k_cache, v_cache, block_table

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
        if not self.dense_lengths:
            cache_seqlens = cache_seqlens.contiguous()
        if not self.dense_table or self.factor > 1:
            k_cache, v_cache, block_table = self._kernel_view(k_cache, v_cache, block_table)
        lengths = cache_seqlens
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
_kvcache_plans: dict[tuple, KVCachePlan] = {}


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
