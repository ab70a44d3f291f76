"""Shared-prefix (cascade) decoding's bytes: one step of :func:`flashlite.attention_shared_prefix`
against :func:`flashlite.attention_kvcache` over per-request copies of the prefix.

B requests share a prefix of ``Np`` keys (stored once, ``(Np, Hkv, D)``) and each has a suffix
cache of ``L`` keys. The step is the decode kernel twice (each request against its own suffix;
every request's rows against the prefix at once) and one merge, so the prefix is read once per
row block of its pass instead of once per request. What each pass runs (tiles, key chunks) comes
from the plan functions the op calls (:func:`~flashlite.ops.attention.decode_tiles`,
:func:`~flashlite.ops.attention.splits_for`, the decode plan's ``key_chunks``).
"""

from __future__ import annotations

from dataclasses import replace

from flashlite.masking import masks
from flashlite.ops.attention import DecodeConfig, decode_tiles, prefix_splits, splits_for
from flashlite.traffic.model.decode import (
    decode_lanes,
    decode_rows_per_head,
    model_flashlite_decode,
)
from flashlite.traffic.shapes import AttentionShape, Traffic


def prefix_pass_shape(shape: AttentionShape, n_prefix: int) -> AttentionShape:
    """The prefix pass as the decode kernel sees it: q viewed as ``(1, Hkv, B·Nq·G, D)`` (every
    request's rows of a KV head are one problem, G = Hq/Hkv) against ``Np`` keys, unmasked (every
    query sits after the prefix)."""
    return AttentionShape(
        1,
        shape.hkv,
        shape.batch * decode_rows_per_head(shape),
        shape.head_dim,
        seq_k=n_prefix,
        kv_heads=shape.hkv,
        dtype=shape.dtype,
        causal=False,
    )


def shared_prefix_tiles(
    shape: AttentionShape, interpreted: bool = False
) -> tuple[DecodeConfig, DecodeConfig]:
    """``(suffix, prefix)``: the decode tiles of the step's two passes, as their decode plans
    pick them (the interpreter's where ``interpreted``): ``Nq·G`` rows per KV head over ``B·Hkv``
    programs for the suffix, ``B·Nq·G`` rows over ``Hkv`` for the prefix."""
    itemsize, d = shape.itemsize, shape.head_dim
    rows = decode_rows_per_head(shape)
    suffix = decode_tiles(rows, shape.batch * shape.hkv, d, itemsize, interpreted)
    prefix = decode_tiles(shape.batch * rows, shape.hkv, d, itemsize, interpreted)
    return suffix, prefix


def shared_prefix_splits(
    shape: AttentionShape, n_prefix: int, suffix_block_m: int, sms: int = 132
) -> tuple[int, int]:
    """``(suffix, prefix)``: the key chunks :func:`flashlite.attention_shared_prefix` picks with
    ``num_splits=None`` on a GPU of ``sms`` SMs (the H200 has 132): the suffix pass's as
    :func:`flashlite.attention_kvcache` picks them for a contiguous cache of ``L`` keys (one
    program per SM), the prefix pass's by :func:`~flashlite.ops.attention.prefix_splits` (two
    programs per SM, from the tile it picks itself)."""
    rows = decode_rows_per_head(shape)
    suffix = splits_for(shape.batch * shape.hkv, rows, shape.nk, sms, suffix_block_m)
    prefix = prefix_splits(
        shape.batch * rows, shape.hkv, n_prefix, shape.head_dim, shape.itemsize, sms
    )
    return suffix, prefix


def _renamed(traffic: Traffic, prefix: str, into: Traffic) -> None:
    """Add every part of ``traffic`` to ``into`` as ``"<prefix> <part>"``."""
    for name, (read, write) in traffic.parts.items():
        into.add(f"{prefix} {name}", read, write)


def model_flashlite_shared_prefix(
    shape: AttentionShape,
    n_prefix: int,
    *,
    suffix_tiles: tuple[int, int],
    prefix_tiles: tuple[int, int],
    suffix_splits: int,
    prefix_splits: int,
) -> Traffic:
    """Bytes one step of :func:`flashlite.attention_shared_prefix` issues: ``B`` requests of
    ``Nq`` queries (``shape``: B, Hq, Hkv, Nq, D, dtype) that share a prefix of ``n_prefix``
    keys, each with a full contiguous suffix cache of ``L = shape.nk`` keys, no new keys, no
    window, validate off. ``*_tiles`` are ``(BLOCK_M, BLOCK_N)`` and ``*_splits`` the requested
    key chunks of each pass (:func:`shared_prefix_tiles`, :func:`shared_prefix_splits`, or the
    ``num_splits`` of the call, which both passes take).

    Four parts, each itemised in the result (``"suffix k"``, ``"prefix v"``, ...)::

        suffix pass  model_flashlite_decode(B, Hq, Nq, L; shape's mask)        (+ its combine)
        q copy       B·Nq·Hq·D·b read and written: q as (Hq, B, Nq, D) (none when G = 1 or
                     B·Nq = 1: then torch's reshape is a view)
        prefix pass  model_flashlite_decode(1, Hkv, B·Nq·G rows, Np; unmasked, no lengths)
                     (+ its combine): K and V each ⌈B·Nq·G / BLOCK_M⌉·Hkv·Np·D·b (the
                     chunks split the keys; the last tile's lanes past Np masked), i.e. the
                     prefix read once per row block of the pass, not once per request
        merge        read B·Hq·Nq·(2·D·b + 8), write B·Hq·Nq·(D·b + 4)

    Raises:
        ValueError: ``n_prefix < 1``, or a causal shape with ``Nq > 1``: without new keys the
            causal diagonal may cut into the prefix, which the op serves on its exact torch
            path (not modelled).
    """
    if n_prefix < 1:
        raise ValueError(f"n_prefix={n_prefix} must be >= 1 (no prefix: plain attention_kvcache)")
    if shape.causal and shape.seq_q > 1:
        raise ValueError(
            f"Nq={shape.seq_q} causal queries without new keys may sit before the prefix's end: "
            "attention_shared_prefix takes its exact torch path there, which is not modelled "
            "(use Nq=1, or a non-causal shape)"
        )
    b, D = shape.itemsize, shape.head_dim
    rows = shape.batch * shape.heads * shape.seq_q  # (B·Hq·Nq output rows)
    t = Traffic()
    suffix = model_flashlite_decode(shape, *suffix_tiles, suffix_splits, mask=shape.mask)
    _renamed(suffix, "suffix", t)
    group = shape.heads // shape.hkv
    copies = group > 1 and shape.batch * shape.seq_q > 1  # (else the reshape is a view)
    t.add("q copy", rows * D * b if copies else 0, rows * D * b if copies else 0)
    prefix = model_flashlite_decode(
        prefix_pass_shape(shape, n_prefix),
        *prefix_tiles,
        prefix_splits,
        mask=masks.NO_MASK,
        lengths=False,
    )
    _renamed(prefix, "prefix", t)
    t.add("merge", rows * (2 * D * b + 8), rows * (D * b + 4))
    t.info = {
        "suffix_config": suffix.info["config"],
        "suffix_splits": suffix.info["splits"],
        "prefix_config": prefix.info["config"],
        "prefix_splits": prefix.info["splits"],
        "prefix_row_blocks": -(-shape.batch * decode_rows_per_head(shape) // prefix_tiles[0]),
    }
    return t


def model_kvcache_prefix_copies(
    shape: AttentionShape, n_prefix: int, block_m: int, block_n: int, splits: int
) -> Traffic:
    """Bytes of the alternative users run today: :func:`flashlite.attention_kvcache` over
    per-request caches that hold a copy of the prefix, ``Np + L`` keys each (full, contiguous),
    with the shape's mask: :func:`~flashlite.traffic.model.model_flashlite_decode` at
    ``Nk = Np + L``, its K and V split into the prefix's keys (``"prefix k"``: read once per
    request, ``B·Hkv·Np·D·b`` when each row block sees every key) and the suffix's."""
    whole = replace(shape, seq_k=n_prefix + shape.nk, kv_heads=shape.hkv)
    model = model_flashlite_decode(whole, block_m, block_n, splits, mask=shape.mask)
    lanes = decode_lanes(whole, block_m, block_n, splits, shape.mask, keys=(0, n_prefix))
    prefix_kv = shape.batch * shape.hkv * lanes * shape.head_dim * shape.itemsize
    t = Traffic(info=dict(model.info))
    for name, (read, write) in model.parts.items():
        if name in ("k", "v"):
            t.add(f"prefix {name}", prefix_kv, 0)
            t.add(f"suffix {name}", read - prefix_kv, write)
        else:
            t.add(name, read, write)
    return t
