"""Counted bytes of block-sparse attention: :func:`flashlite.flex_attention`'s forward run in the
interpreter with every load and store counted (:func:`flashlite.traffic.counters.count_kernels`),
to hold against :func:`flashlite.traffic.model.block_sparse.model_flex_attention` (and packed
sequences', :func:`flashlite.attention_varlen` with mods, against ``model_flex_varlen``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flashlite.masking import BlockMask, ScoreMod
from flashlite.traffic.counters import count_kernels, count_torch_ops
from flashlite.traffic.shapes import AttentionShape, Traffic, make_inputs
from flashlite.traffic.sparse_calls import packed_inputs


def count_flex_attention(
    shape: AttentionShape, block_mask: BlockMask, score_mod: ScoreMod | None = None
) -> Traffic:
    """Counted bytes of one :func:`flashlite.flex_attention` forward over CPU tensors of ``shape``
    with ``block_mask`` (built before counting: its classifier is not counted). ``parts`` holds
    the bytes that touched q, k, v and the tables (``@q`` and the like); torch ops, if any ran,
    as ``"torch ops"``."""
    import flashlite

    q, k, v = make_inputs(shape, "cpu")

    def call() -> Any:
        return flashlite.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return _counted(call, block_mask, q=q, k=k, v=v)


def count_flex_varlen(
    shape: AttentionShape,
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
) -> Traffic:
    """Counted bytes of one :func:`flashlite.attention_varlen` forward with mods over packed CPU
    tensors of these lengths (``shape`` as :func:`~flashlite.traffic.model.block_sparse.
    model_flex_varlen`'s), offsets unvalidated (their check is torch ops, not the kernel).
    ``parts`` as :func:`count_flex_attention`'s, the offsets as ``@cu_q`` and ``@cu_k``."""
    import flashlite

    q, k, v, cu_q, cu_k = packed_inputs(shape, lengths_q, lengths_k)
    opts: dict[str, Any] = {"validate": False, "score_mod": score_mod, "block_mask": block_mask}

    def call() -> Any:
        return flashlite.attention_varlen(q, k, v, cu_q, cu_k, shape.seq_q, shape.nk, **opts)

    return _counted(call, block_mask, q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k)


def _counted(call: Callable[[], Any], block_mask: BlockMask, **watched: Any) -> Traffic:
    """The kernels' bytes of ``call()``, those that touched ``watched`` and the forward's tables
    by name, plus any torch ops' as ``"torch ops"``."""
    with count_kernels() as kern, count_torch_ops() as ops:
        kern.watch(
            **watched, kv_indices=block_mask.kv_indices, full_kv_indices=block_mask.full_kv_indices
        )
        call()
    t = kern.traffic
    if ops.traffic.total:
        t.add("torch ops", ops.traffic.read, ops.traffic.write)
    return t
