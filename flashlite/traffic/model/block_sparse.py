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
"""

from __future__ import annotations

import torch

from flashlite.block_mask import FULL, PARTIAL, BlockMask, cdiv
from flashlite.mods import MaskMod, ScoreMod
from flashlite.traffic.shapes import AttentionShape, Traffic


def _tiles(shape: AttentionShape, block_mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """The classes as ``(B, H, nQ, nK)`` and the keys each key block holds below ``Nk``."""
    classes = block_mask.classes().expand(shape.batch, shape.heads, -1, -1)
    tbn, nk = block_mask.BLOCK_SIZE[1], shape.nk
    keys = [min(tbn, nk - j * tbn) for j in range(classes.shape[-1])]
    return classes, torch.tensor(keys, dtype=torch.int64)


def _tile_reads(mod: MaskMod | ScoreMod | None, bm: int, bn: int) -> int | None:
    if mod is None:
        return 0
    reads = getattr(mod, "tile_reads", None)
    return None if reads is None else reads(bm, bn)


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
    tbm, tbn = block_mask.BLOCK_SIZE
    bm, bn = kernel_block or (tbm, tbn)
    e, D = shape.itemsize, shape.head_dim
    B, H, Nq = shape.batch, shape.heads, shape.seq_q
    classes, block_keys = _tiles(shape, block_mask)
    subs = tbn // bn  # kernel tiles per table block
    full, part = (classes == FULL).long(), (classes == PARTIAL).long()
    mask_tile = _tile_reads(block_mask.mask_mod, bm, bn)
    score_tile = _tile_reads(score_mod, bm, bn)
    t = Traffic()
    q_rows = 0
    keys = listed = mod_bytes = 0
    for m0 in range(0, Nq, bm):
        row = m0 // tbm
        q_rows += min(bm, Nq - m0)
        f, p = full[:, :, row], part[:, :, row]  # (B, H, nK)
        listed += int(f.sum() + p.sum())
        keys += int((f * block_keys).sum() + (p * block_keys).sum())
        if mask_tile is not None and score_tile is not None:
            mod_bytes += (
                int(p.sum()) * subs * mask_tile + int(f.sum() + p.sum()) * subs * score_tile
            )
    progs = cdiv(Nq, bm)
    t.add("q", B * H * q_rows * D * e, 0)
    t.add("tables", B * H * progs * 8 + listed * 4, 0)
    t.add("k", keys * D * e, 0)
    t.add("v", keys * D * e, 0)
    if mask_tile is not None and score_tile is not None and (mask_tile or score_tile):
        t.add("mods", mod_bytes, 0)
    t.add("o", 0, B * H * Nq * D * e)
    t.add("lse", 0, B * H * Nq * 4)
    n_full, n_part = int((classes == FULL).sum()), int((classes == PARTIAL).sum())
    t.info = {"full": n_full, "partial": n_part, "empty": classes.numel() - n_full - n_part,
              "mods_modelled": mask_tile is not None and score_tile is not None,
              "tiles": (bm, bn)}  # fmt: skip
    return t


def dram_flex_attention(shape: AttentionShape, block_mask: BlockMask) -> Traffic:
    """DRAM bytes of :func:`flashlite.flex_attention`'s forward when L2 serves every repeated
    read (as it does for the dense kernel, whose estimate of this kind is within 8% of ncu on
    the H200): Q, O and the LSE once, the tables once, and K and V once per key block that at
    least one tile of its (batch, KV head) lists. Keys no query sees are never read at all."""
    e, D = shape.itemsize, shape.head_dim
    B, H, Hkv, Nq = shape.batch, shape.heads, shape.hkv, shape.seq_q
    classes, block_keys = _tiles(shape, block_mask)
    visited = (classes != 0).any(2)  # (B, H, nK): some query block lists the key block
    visited = visited.reshape(B, Hkv, H // Hkv, -1).any(2)  # a GQA group reads its KV head once
    keys = int((visited.long() * block_keys).sum())
    tables = sum(getattr(block_mask, n).numel() * 4 for n in ("kv_num_blocks", "kv_indices",
                                                            "full_kv_num_blocks",
                                                            "full_kv_indices"))  # fmt: skip
    t = Traffic()
    t.add("q", B * H * Nq * D * e, 0)
    t.add("tables", tables, 0)
    t.add("k", keys * D * e, 0)
    t.add("v", keys * D * e, 0)
    t.add("o", 0, B * H * Nq * D * e)
    t.add("lse", 0, B * H * Nq * 4)
    return t
