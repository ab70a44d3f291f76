"""Block tables: which tiles of the score matrix a mask function leaves empty, full or partial.

A mask function (:mod:`flashlite.masking.mods`) is evaluated once per call shape, tile by tile,
and each ``(query block, key block)`` tile of each ``(batch, head)`` gets a class:

- **empty** (0): no query of the block sees a key of the block. The kernels never visit it: its
  K and V are not read (the traffic story: bytes saved);
- **full** (2): every query sees every key. The kernels run it without evaluating the mask;
- **partial** (1): some pairs are seen. The kernels evaluate the mask on it.

:class:`BlockMask` keeps the classes as FlexAttention's index tables, per query block the key
blocks to visit (``kv_*``, the forward and dQ) and per key block the query blocks (``q_*``, dK
and dV), partial and full apart, the same names and layout as
``torch.nn.attention.flex_attention.BlockMask``. Query rows past ``Nq`` do not count (nothing
is stored for them); tiles crossing ``Nk`` are never full, so that full tiles need no bounds.

:mod:`flashlite.masking.classify` computes the classes (a kernel, or its torch twin);
:func:`tables` turns classes into index tables on the device without a host sync;
:meth:`BlockMask.from_torch` converts torch's own tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashlite._launch import is_jit as _is_jit
from flashlite.masking.mods import MaskMod, as_mask_mod

__all__ = ["EMPTY", "PARTIAL", "FULL", "BlockMask", "tables", "cdiv"]

EMPTY, PARTIAL, FULL = 0, 1, 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tables(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, indices)`` of a ``(..., R, C)`` bool selection: per row how many columns are
    selected (int32 ``(..., R)``) and their indices first, ascending, then the others (int32
    ``(..., R, C)``). Device ops only: no host sync."""
    c = selected.shape[-1]
    cols = torch.arange(c, device=selected.device, dtype=torch.int32)
    key = torch.where(selected, cols, cols + c)  # selected columns sort first, in order
    # (contiguous: a transposed selection would hand back transposed strides, and the kernels
    # step along the last dimension by one)
    num = selected.sum(-1, dtype=torch.int32).contiguous()
    return num, key.argsort(dim=-1).to(torch.int32).contiguous()


@dataclass(frozen=True, eq=False, repr=False)
class BlockMask:
    """Which tiles a mask leaves empty, full or partial, as index tables (FlexAttention's names).

    Its ``repr`` is a one-line summary (shape, tile, sparsity, the mask's name), short at any
    size; :meth:`classes` gives every tile's class and the attributes the tables themselves.

    Attributes:
        seq_lengths: ``(Nq, Nk)`` it was built for.
        BLOCK_SIZE: ``(bm, bn)``, the tile the kernels step by.
        kv_num_blocks, kv_indices: per query block the partial key blocks (int32
            ``(B, H, nQ)`` and ``(B, H, nQ, nK)``; B or H is 1 when the mask ignores it).
        full_kv_num_blocks, full_kv_indices: the full key blocks.
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: per key block the partial
            and full query blocks (``(B, H, nK)``, ``(B, H, nK, nQ)``).
        mask_mod: the mask, evaluated by the kernels on partial tiles.
    """

    seq_lengths: tuple[int, int]
    BLOCK_SIZE: tuple[int, int]
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    mask_mod: MaskMod

    @classmethod
    def from_classes(
        cls,
        classes: torch.Tensor,
        seq_lengths: tuple[int, int],
        block_size: tuple[int, int],
        mask_mod: MaskMod,
    ) -> BlockMask:
        """The tables of int8 classes ``(B, H, nQ, nK)`` (:data:`EMPTY`, :data:`PARTIAL`,
        :data:`FULL`)."""
        partial, full = classes == PARTIAL, classes == FULL
        kv = tables(partial) + tables(full)
        q = tables(partial.transpose(-1, -2)) + tables(full.transpose(-1, -2))
        return cls(tuple(seq_lengths), tuple(block_size), *kv, *q, mask_mod)  # type: ignore[arg-type]

    def classes(self) -> torch.Tensor:
        """The int8 classes ``(B, H, nQ, nK)``, from the ``kv_*`` tables."""
        return _classes_of(self)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Nq, Nk)`` (B or H 1 when broadcast)."""
        b, h = self.kv_num_blocks.shape[:2]
        return (b, h, *self.seq_lengths)

    def sparsity(self) -> float:
        """The fraction of tiles that are empty (never visited)."""
        return float((self.classes() == EMPTY).float().mean())

    def __repr__(self) -> str:
        name = self.mask_mod.name
        if len(name) > 120:  # (a deeply nested qualname: its tail names it)
            name = "..." + name[-117:]
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={tuple(self.BLOCK_SIZE)}, "
            f"sparsity={self.sparsity():.2%}, mask_mod={name})"
        )

    def to(self, device: torch.device | str) -> BlockMask:
        """The tables on ``device`` (the mask's buffers stay where they are)."""
        moved = {k: getattr(self, k).to(device) for k in _TABLES}
        return BlockMask(self.seq_lengths, self.BLOCK_SIZE, **moved, mask_mod=self.mask_mod)

    @classmethod
    def from_torch(
        cls, block_mask: Any, mask_mod: Any = None, block_size: tuple[int, int] | None = None
    ) -> BlockMask:
        """Torch's ``BlockMask`` as flashlite's, re-tiled to ``block_size`` (default: its own).

        With a jit mask (``mask_mod``, a :class:`~flashlite.mods.MaskMod` or jit function, or
        torch's mask itself when it was built from a flashlite ``MaskMod``) a finer tile
        inherits its block's class (a partial block's pieces stay partial: the kernels evaluate
        the mask there); a coarser tile is empty or full when all its blocks are, else partial.
        A plain Python mask (torch's own ``mask_mod``, as FlexAttention users write it) is
        evaluated again over torch's batches, heads and lengths and kept as bits
        (:mod:`flashlite.masking.python_masks`).

        Raises:
            TypeError: a mask that is neither a jit mask nor a function of four indices.
            ValueError: block sizes that do not divide one another.
        """
        mod = mask_mod if mask_mod is not None else getattr(block_mask, "mask_mod", None)
        nq, nk = (int(n) for n in block_mask.seq_lengths)
        tbm, tbn = (int(s) for s in block_mask.BLOCK_SIZE)
        bm, bn = block_size if block_size is not None else (tbm, tbn)
        if not isinstance(mod, MaskMod) and not _is_jit(mod):
            return _from_python(block_mask, mod, (nq, nk), (bm, bn))
        mod = as_mask_mod(mod)
        classes = _classes_of(block_mask)
        classes = _retile(classes, tbm, bm, nq, dim=2)
        classes = _retile(classes, tbn, bn, nk, dim=3)
        if nk % bn:  # a tile crossing Nk is never full (the full path has no bounds check)
            last = classes[..., -1]
            classes[..., -1] = torch.where(last == FULL, PARTIAL, last)
        return cls.from_classes(classes, (nq, nk), (bm, bn), mod)


def _from_python(
    block_mask: Any, fn: Any, lengths: tuple[int, int], block: tuple[int, int]
) -> BlockMask:
    """torch's block mask of a plain Python mask ``fn``, evaluated over its batches and heads
    on its tables' device and held to its tables (a hand-made one's empty blocks see nothing
    and full blocks everything, as in torch). Imported here: python_masks builds on this
    module."""
    from flashlite.masking import python_masks

    if not python_masks.is_python_mask(fn):
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"block_mask's mask_mod {name} is neither a mask function (b, h, q_idx, kv_idx) "
            "nor a @triton.jit mask; pass BlockMask.from_torch(block_mask, mask_mod=fn)"
        )
    classes = _classes_of(block_mask)  # (torch's tables hold the mask: see python_block_mask)
    b, h = classes.shape[:2]
    given = (classes, tuple(int(s) for s in block_mask.BLOCK_SIZE))
    return python_masks.python_block_mask(fn, b, h, lengths, block, classes.device, given)


_TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _classes_of(block_mask: Any) -> torch.Tensor:
    """Int8 classes from a block mask's ``kv_*`` tables, flashlite's or torch's (whose full
    tables may be None: then every listed block is partial)."""
    idx = block_mask.kv_indices
    out = torch.zeros(idx.shape, dtype=torch.int8, device=idx.device)
    pairs = [(block_mask.kv_num_blocks, idx, PARTIAL)]
    if block_mask.full_kv_num_blocks is not None:
        pairs.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))
    for num, ind, value in pairs:
        listed = torch.arange(ind.shape[-1], device=ind.device) < num.unsqueeze(-1)
        out.scatter_add_(-1, ind.long(), (listed * value).to(torch.int8))
    return out


def _retile(classes: torch.Tensor, old: int, new: int, n: int, dim: int) -> torch.Tensor:
    """Classes along ``dim`` from blocks of ``old`` to blocks of ``new`` over length ``n``."""
    want = cdiv(n, new)
    if new == old:
        return classes.narrow(dim, 0, want).clone()
    if old % new == 0:  # finer: each piece inherits
        return classes.repeat_interleave(old // new, dim=dim).narrow(dim, 0, want).clone()
    if new % old:
        raise ValueError(f"block_size {new} and torch's BLOCK_SIZE {old} must divide one another")
    r = new // old
    pad = want * r - classes.shape[dim]
    if pad > 0:  # blocks past the end: empty
        shape = list(classes.shape)
        shape[dim] = pad
        classes = torch.cat([classes, classes.new_zeros(shape)], dim)
    classes = classes.narrow(dim, 0, want * r)
    shape = list(classes.shape)
    shape[dim : dim + 1] = [want, r]
    grouped = classes.reshape(shape)
    empty = (grouped == EMPTY).all(dim + 1)
    full = (grouped == FULL).all(dim + 1)
    return torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)
