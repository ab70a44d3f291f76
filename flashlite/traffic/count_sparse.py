"""Counted bytes of block-sparse attention: :func:`flashlite.flex_attention`'s forward run in the
interpreter with every load and store counted (:func:`flashlite.traffic.count.count_kernels`),
to hold against :func:`flashlite.traffic.model.block_sparse.model_flex_attention`."""

from __future__ import annotations

from flashlite.block_mask import BlockMask
from flashlite.mods import ScoreMod
from flashlite.traffic.count import count_kernels, count_torch_ops
from flashlite.traffic.shapes import AttentionShape, Traffic, make_inputs


def count_flex_attention(
    shape: AttentionShape, block_mask: BlockMask, score_mod: ScoreMod | None = None
) -> Traffic:
    """Counted bytes of one :func:`flashlite.flex_attention` forward over CPU tensors of ``shape``
    with ``block_mask`` (built before counting: its classifier is not counted). ``parts`` holds
    the bytes that touched q, k, v and the tables (``@q`` and the like); torch ops, if any ran,
    as ``"torch ops"``."""
    import flashlite

    q, k, v = make_inputs(shape, "cpu")
    with count_kernels() as kern, count_torch_ops() as ops:
        kern.watch(q=q, k=k, v=v, kv_indices=block_mask.kv_indices,
                   full_kv_indices=block_mask.full_kv_indices)  # fmt: skip
        flashlite.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    t = kern.traffic
    if ops.traffic.total:
        t.add("torch ops", ops.traffic.read, ops.traffic.write)
    return t
