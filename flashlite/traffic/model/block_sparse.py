"""Block-sparse attention's bytes, read off the block tables: what :func:`flashlite.flex_attention`
issues, against the same kernel over every tile (dense) and the materialising reference.

One forward program per (batch, query head, ``bm`` rows): its Q rows once, its table row (two
counts and one index per listed block), K and V once per listed tile (full tiles whole; partial
ones only their keys below ``Nk``), what the mods read from their buffers, then O and the fp32
LSE once. Empty tiles appear in no table: their K and V are never read, the bytes a mask saves::

    read  = Σ_programs (rows·D·b + 8 + 4·listed + 2·D·b·keys + mods)
    write = Σ_programs rows·(D·b + 4)

``rows`` are the program's rows below ``Nq`` and ``keys`` the keys its listed tiles hold below
``Nk``. A mod's buffer reads are modelled when it says what one tile costs (the gallery's do);
the model reports ``mods_modelled=False`` otherwise.

Packed sequences (:func:`flashlite.attention_varlen` with mods) run the same programs per
sequence over the longest sequence's tables: every program first reads its sequence's four
offsets (16 bytes); one whose rows start past its sequence's end stops there, and the others
skip the listed key tiles that start past its keys (their indices are still read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashlite.masking import FULL, PARTIAL, BlockMask, MaskMod, ScoreMod, cdiv
from flashlite.traffic.shapes import AttentionShape, Traffic


def _classes(shape: AttentionShape, block_mask: BlockMask) -> torch.Tensor:
    """The tiles' classes as ``(B, H, nQ, nK)``."""
    return block_mask.classes().expand(shape.batch, shape.heads, -1, -1)


def _block_keys(tbn: int, n_blocks: int, keys: int) -> torch.Tensor:
    """The keys each of ``n_blocks`` key blocks of ``tbn`` holds below ``keys``."""
    starts = torch.arange(n_blocks, dtype=torch.int64) * tbn
    return (keys - starts).clamp(0, tbn)


def _tile_reads(mod: MaskMod | ScoreMod | None, bm: int, bn: int) -> int | None:
    if mod is None:
        return 0
    reads = getattr(mod, "tile_reads", None)
    return None if reads is None else reads(bm, bn)


@dataclass
class _Walk:
    """What the forward's programs over some sequences read, summed."""

    programs: int = 0  # programs that ran past the offsets
    rows: int = 0  # query rows, summed over heads
    listed: int = 0  # table indices read
    keys: int = 0  # keys of the key tiles run
    masked: int = 0  # kernel tiles run with the mask (partial)
    scored: int = 0  # kernel tiles run (each runs the score function)


def _walk(
    w: _Walk,
    classes: torch.Tensor,
    lq: int,
    lk: int,
    block: tuple[int, int],
    kernel_block: tuple[int, int],
    varlen: bool,
) -> None:
    """Add to ``w`` the programs over ``classes[..., nQ, nK]`` (one ``(…)`` entry per (sequence,
    head)) for ``lq`` query rows and ``lk`` keys. ``varlen``: tiles past ``lk`` are skipped,
    else every listed kernel tile runs (its loads masked past ``lk``)."""
    (tbm, tbn), (bm, bn) = block, kernel_block
    full, part = (classes == FULL).long(), (classes == PARTIAL).long()
    keys = _block_keys(tbn, classes.shape[-1], lk)
    # kernel tiles run per listed key block
    subs = (keys + bn - 1) // bn if varlen else torch.full_like(keys, tbn // bn)
    heads = classes[..., 0, 0].numel()
    for m0 in range(0, lq, bm):
        f, p = full[..., m0 // tbm, :], part[..., m0 // tbm, :]
        w.programs += heads
        w.rows += heads * min(bm, lq - m0)
        w.listed += int(f.sum() + p.sum())
        w.keys += int(((f + p) * keys).sum())
        w.masked += int((p * subs).sum())
        w.scored += int(((f + p) * subs).sum())


def _bytes(
    shape: AttentionShape, w: _Walk, mask_tile: int | None, score_tile: int | None, offsets: int = 0
) -> Traffic:
    e, D = shape.itemsize, shape.head_dim
    t = Traffic()
    if offsets:
        t.add("offsets", offsets, 0)
    t.add("q", w.rows * D * e, 0)
    t.add("tables", w.programs * 8 + w.listed * 4, 0)
    t.add("k", w.keys * D * e, 0)
    t.add("v", w.keys * D * e, 0)
    if mask_tile is not None and score_tile is not None and (mask_tile or score_tile):
        t.add("mods", w.masked * mask_tile + w.scored * score_tile, 0)
    t.add("o", 0, w.rows * D * e)
    t.add("lse", 0, w.rows * 4)
    return t


def _counts(classes: torch.Tensor) -> dict[str, int]:
    """How many tiles of ``classes`` are full, partial and empty."""
    n_full, n_part = int((classes == FULL).sum()), int((classes == PARTIAL).sum())
    return {"full": n_full, "partial": n_part, "empty": classes.numel() - n_full - n_part}


def _info(
    classes: torch.Tensor,
    mask_tile: int | None,
    score_tile: int | None,
    kernel_block: tuple[int, int],
) -> dict[str, object]:
    return {
        **_counts(classes),
        "mods_modelled": mask_tile is not None and score_tile is not None,
        "tiles": kernel_block,
    }


def _setup(
    shape: AttentionShape,
    block_mask: BlockMask,
    score_mod: ScoreMod | None,
    kernel_block: tuple[int, int] | None,
) -> tuple[Any, ...]:
    """``(table tile, kernel tile, mask and score bytes per kernel tile, classes)``."""
    block = block_mask.BLOCK_SIZE
    kernel_block = kernel_block or block
    return (
        block,
        kernel_block,
        _tile_reads(block_mask.mask_mod, *kernel_block),
        _tile_reads(score_mod, *kernel_block),
        _classes(shape, block_mask),
    )


def model_flex_attention(
    shape: AttentionShape,
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
    kernel_block: tuple[int, int] | None = None,
) -> Traffic:
    """Bytes :func:`flashlite.flex_attention`'s forward issues for ``shape`` with these tables.

    ``kernel_block``: the kernel's ``(BLOCK_M, BLOCK_N)`` (dividing the table's; default the
    table's own, as in the interpreter). ``info`` holds the tile counts (``full``, ``partial``,
    ``empty``) and whether the mods' buffer reads are in the model.
    """
    block, kernel_block, mask_tile, score_tile, classes = _setup(
        shape, block_mask, score_mod, kernel_block
    )
    w = _Walk()
    _walk(w, classes, shape.seq_q, shape.nk, block, kernel_block, varlen=False)
    t = _bytes(shape, w, mask_tile, score_tile)
    t.info = _info(classes, mask_tile, score_tile, kernel_block)
    return t


def _check_lengths(
    shape: AttentionShape, lengths_q: Sequence[int], lengths_k: Sequence[int]
) -> None:
    if not len(lengths_q) == len(lengths_k) == shape.batch:
        raise ValueError(
            f"lengths_q and lengths_k must give shape.batch={shape.batch} sequences, "
            f"got {len(lengths_q)} and {len(lengths_k)}"
        )
    for name, lengths, most in (
        ("lengths_q", lengths_q, shape.seq_q),
        ("lengths_k", lengths_k, shape.nk),
    ):
        bad = [n for n in lengths if not 0 <= n <= most]
        if bad:
            raise ValueError(
                f"{name} must lie in [0, {most}] (the shape's longest sequence), got {bad[0]}"
            )


def model_flex_varlen(
    shape: AttentionShape,
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
    kernel_block: tuple[int, int] | None = None,
) -> Traffic:
    """Bytes :func:`flashlite.attention_varlen`'s forward with mods issues for packed sequences
    of these lengths (query and key rows per sequence).

    ``shape``: ``batch`` the number of sequences, ``seq_q``/``seq_k`` ``max_seqlen_q``/``_k``
    (the tables' lengths), and the heads, head dim and dtype. ``block_mask``: the tables the
    call takes (``B`` the number of sequences, or 1). ``kernel_block`` as
    :func:`model_flex_attention`'s. ``info``: the table tiles within each sequence's own
    lengths (``full``, ``partial``, ``empty``, summed), the kernel tiles that run
    (``tiles_run``) and whether the mods' buffer reads are in the model.
    """
    _check_lengths(shape, lengths_q, lengths_k)
    block, kernel_block, mask_tile, score_tile, classes = _setup(
        shape, block_mask, score_mod, kernel_block
    )
    w = _Walk()
    counts = {"full": 0, "partial": 0, "empty": 0}
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        _walk(w, classes[b], lq, lk, block, kernel_block, varlen=True)
        own = _counts(classes[b, :, : cdiv(lq, block[0]), : cdiv(lk, block[1])])
        counts = {name: n + own[name] for name, n in counts.items()}
    # every program reads its sequence's offsets, also those past a shorter sequence's rows
    programs = shape.batch * shape.heads * classes.shape[-2] * (block[0] // kernel_block[0])
    t = _bytes(shape, w, mask_tile, score_tile, offsets=16 * programs)
    t.info = {
        **_info(classes, mask_tile, score_tile, kernel_block),
        **counts,
        "tiles_run": w.scored,
    }
    return t


def _table_bytes(block_mask: BlockMask) -> int:
    return sum(
        getattr(block_mask, n).numel() * 4
        for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    )


def _visited_keys(shape: AttentionShape, classes: torch.Tensor, lk: int, tbn: int) -> int:
    """Keys below ``lk`` of the key blocks some tile of a (sequence, KV head) lists, summed
    over ``classes[B, H, nQ, nK]``'s sequences and KV heads (a GQA group reads its KV head
    once)."""
    visited = (classes != 0).any(-2)  # (B, H, nK)
    visited = visited.reshape(visited.shape[0], shape.hkv, shape.heads // shape.hkv, -1).any(2)
    return int((visited.long() * _block_keys(tbn, classes.shape[-1], lk)).sum())


def _dram(shape: AttentionShape, rows: int, keys: int, tables: int, offsets: int = 0) -> Traffic:
    e, D = shape.itemsize, shape.head_dim
    t = Traffic()
    if offsets:
        t.add("offsets", offsets, 0)
    t.add("q", rows * D * e, 0)
    t.add("tables", tables, 0)
    t.add("k", keys * D * e, 0)
    t.add("v", keys * D * e, 0)
    t.add("o", 0, rows * D * e)
    t.add("lse", 0, rows * 4)
    return t


def dram_flex_attention(shape: AttentionShape, block_mask: BlockMask) -> Traffic:
    """DRAM bytes of :func:`flashlite.flex_attention`'s forward when L2 serves every repeated
    read (as it does for the dense kernel, whose estimate of this kind is within 8% of ncu on
    the H200): Q, O and the LSE once, the tables once, and K and V once per key block that at
    least one tile of its (batch, KV head) lists. Keys no query sees are never read at all."""
    keys = _visited_keys(shape, _classes(shape, block_mask), shape.nk, block_mask.BLOCK_SIZE[1])
    return _dram(shape, shape.batch * shape.heads * shape.seq_q, keys, _table_bytes(block_mask))


def dram_flex_varlen(
    shape: AttentionShape, lengths_q: Sequence[int], lengths_k: Sequence[int], block_mask: BlockMask
) -> Traffic:
    """:func:`dram_flex_attention` for packed sequences (``shape`` and the lengths as
    :func:`model_flex_varlen`'s): each sequence's Q, O and LSE rows once, the offsets and
    tables once, and K and V once per key block below the sequence's keys that a tile of its
    (sequence, KV head) lists among the rows it has."""
    _check_lengths(shape, lengths_q, lengths_k)
    classes = _classes(shape, block_mask)
    tbm, tbn = block_mask.BLOCK_SIZE
    keys = sum(
        _visited_keys(shape, classes[b : b + 1, :, : cdiv(lq, tbm)], lk, tbn)
        for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k, strict=True))
    )
    rows = shape.heads * sum(lengths_q)
    return _dram(shape, rows, keys, _table_bytes(block_mask), offsets=4 * (shape.batch + 1) * 2)
