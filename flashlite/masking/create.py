"""Block masks for :func:`~flashlite.ops.attention.flex.flex_attention`: :func:`create_block_mask`
(torch's call, a classifier kernel on the device: :mod:`flashlite.masking.classify`), the tables
of no mask (:func:`dense_block_mask`), and the checks a call's block mask passes
(:func:`block_mask_for`). The tables themselves are :mod:`flashlite.masking.block_mask`'s."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import triton
import triton.language as tl  # noqa: F401  (the jit mask below runs with it in scope)

from flashlite import _backend
from flashlite._caches import Cache, register
from flashlite.masking import block_mask as BM
from flashlite.masking import mods as M
from flashlite.masking import python_masks as PM
from flashlite.masking.classify import classify_tiles
from flashlite.masking.mod_args import check_mod

__all__ = ["create_block_mask", "dense_block_mask", "block_mask_for"]


def _check_block_size(block_size: object) -> tuple[int, int]:
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    ok = (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 16 and x & (x - 1) == 0
            for x in pair
        )
    )
    if not ok:
        raise ValueError(
            f"BLOCK_SIZE must be a power of two >= 16 or a pair of them, got {block_size!r}"
        )
    return int(pair[0]), int(pair[1])


def _check_len(n: object, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    return n


def create_block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BM.BlockMask:
    """Classify every tile of the score matrix as empty, full or partial for ``mask_mod``
    (torch's ``create_block_mask``). A jit mask is evaluated by a kernel on the device (one
    evaluation per (query, key) pair, no host sync) and again by the attention kernels on
    partial tiles; a plain Python mask is evaluated once here, on ``device``, and its partial
    tiles kept as bits that the attention kernels read (:mod:`flashlite.masking.python_masks`).

    Args:
        mask_mod: a :class:`~flashlite.masking.mods.MaskMod` (:mod:`flashlite.masking.gallery`,
            :func:`flashlite.masking.mods.mask_mod`), a bare ``@triton.jit`` mask, or a plain
            Python function ``(b, h, q_idx, kv_idx) -> bool tensor`` in torch ops (closing over
            tensors on ``device`` if it likes), as torch's ``create_block_mask`` takes it.
        B, H: batch and heads the mask depends on; None: it does not (one table, broadcast).
        Q_LEN, KV_LEN: the sequence lengths.
        device: where the tables live (default: the current CUDA device, else CPU).
        BLOCK_SIZE: the tile, ``bm`` or ``(bm, bn)``, powers of two >= 16.

    Returns:
        A :class:`~flashlite.masking.block_mask.BlockMask`.

    Raises:
        TypeError: ``mask_mod`` is neither a mask function of four indices nor a jit mask
            (or has the wrong arity); a Python mask returns something other than bools.
        ValueError: bad lengths or block size, a buffer on another device, more batches,
            heads or positions than the mod's buffers hold (its ``limits``).
    """
    python = PM.is_python_mask(mask_mod)
    mod = None if python else M.as_mask_mod(mask_mod)
    b = 1 if B is None else _check_len(B, "B")
    h = 1 if H is None else _check_len(H, "H")
    nq, nk = _check_len(Q_LEN, "Q_LEN"), _check_len(KV_LEN, "KV_LEN")
    bm, bn = _check_block_size(BLOCK_SIZE)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if mod is None:  # (evaluated here once, kept as bits: python_masks)
        return PM.python_block_mask(mask_mod, b, h, (nq, nk), (bm, bn), device)
    check_mod(mod, "mask_mod", device, B, H, max(nq, nk))
    classes = classify_tiles(mod, b, h, nq, nk, (bm, bn), device)
    return BM.BlockMask.from_classes(classes, (nq, nk), (bm, bn), mod)


_DENSE: Cache = Cache("flex_dense_tables", 32)


def dense_block_mask(
    nq: int, nk: int, block: tuple[int, int], device: torch.device
) -> BM.BlockMask:
    """The tables of no mask: every tile full but a ragged last key tile (partial, bounds only).
    Built once per shape and device."""
    return _DENSE.made((nq, nk, block, device), _dense_tables, nq, nk, block, device)


def _dense_tables(nq: int, nk: int, block: tuple[int, int], device: torch.device) -> BM.BlockMask:
    classes = torch.full(
        (1, 1, BM.cdiv(nq, block[0]), BM.cdiv(nk, block[1])),
        BM.FULL,
        dtype=torch.int8,
        device=device,
    )
    if nk % block[1]:
        classes[..., -1] = BM.PARTIAL
    return BM.BlockMask.from_classes(classes, (nq, nk), block, _EVERYTHING)


@triton.jit
def _everything(b, h, q_idx, kv_idx):
    return (q_idx >= 0) & (kv_idx >= 0)


_EVERYTHING = M.mask_mod(_everything, name="flashlite.flex.everything", tile_reads=lambda bm, bn: 0)


#: Block masks whose tables :func:`_check_tables` accepted: a BlockMask is frozen, so its
#: tables' shapes and dtypes cannot change after (a call with one checks it once).
_checked: weakref.WeakSet[BM.BlockMask] = register("flex.checked_block_masks", weakref.WeakSet())


def _check_tables(bm: BM.BlockMask) -> None:
    """A BlockMask's tables agree with its lengths and tile (one made by hand may not)."""
    if bm in _checked:
        return
    bq, bk = _check_block_size(tuple(bm.BLOCK_SIZE))
    nq, nk = bm.seq_lengths
    nqb, nkb = BM.cdiv(nq, bq), BM.cdiv(nk, bk)
    lead = tuple(bm.kv_num_blocks.shape[:2])
    want = {
        "kv_num_blocks": (*lead, nqb),
        "kv_indices": (*lead, nqb, nkb),
        "full_kv_num_blocks": (*lead, nqb),
        "full_kv_indices": (*lead, nqb, nkb),
        "q_num_blocks": (*lead, nkb),
        "q_indices": (*lead, nkb, nqb),
        "full_q_num_blocks": (*lead, nkb),
        "full_q_indices": (*lead, nkb, nqb),
    }
    for name, shape in want.items():
        t = getattr(bm, name)
        if tuple(t.shape) != shape or t.dtype != torch.int32:
            raise ValueError(
                f"block_mask.{name} is {tuple(t.shape)} {t.dtype}; for (Q_LEN, KV_LEN) = "
                f"{(nq, nk)} and BLOCK_SIZE {(bq, bk)} it must be {shape} torch.int32"
            )
    _checked.add(bm)


#: torch's block masks of plain Python masks, converted (evaluating one costs a pass over every
#: pair: a model calling flex_attention with the same torch BlockMask pays it once)
_CONVERTED: weakref.WeakKeyDictionary[Any, BM.BlockMask] = register(
    "flex.converted_python_masks", weakref.WeakKeyDictionary()
)


def _from_torch(block_mask: Any) -> BM.BlockMask:
    fn = getattr(block_mask, "mask_mod", None)
    if not PM.is_python_mask(fn):  # (jit masks convert cheaply: tables only, no evaluation)
        return BM.BlockMask.from_torch(block_mask)
    found = _CONVERTED.get(block_mask)
    if found is None:
        found = _CONVERTED[block_mask] = BM.BlockMask.from_torch(block_mask)
    return found


def block_mask_for(
    block_mask: Any, q: torch.Tensor, k: torch.Tensor, lengths: tuple[int, int] | None = None
) -> BM.BlockMask:
    """The tables a :func:`~flashlite.ops.attention.flex.flex_attention` call runs over: the
    dense tables for None, flashlite's own from torch's ``BlockMask``, checked against the
    call's lengths (``(Nq, Nk)``, default q's and k's) and device."""
    nq, nk = lengths if lengths is not None else (q.shape[2], k.shape[2])
    if block_mask is None:
        return dense_block_mask(
            nq, nk, (128, 128) if not _backend.INTERPRETED else (32, 32), q.device
        )
    if not isinstance(block_mask, BM.BlockMask):
        if type(block_mask).__name__ != "BlockMask" or not hasattr(block_mask, "kv_indices"):
            raise TypeError(
                f"block_mask must be a flashlite or torch BlockMask, got "
                f"{type(block_mask).__name__}"
            )
        block_mask = _from_torch(block_mask)
    _check_tables(block_mask)
    if tuple(block_mask.seq_lengths) != (nq, nk):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN) = {block_mask.seq_lengths}, "
            f"the call has ({nq}, {nk})"
        )
    if not _backend.same_device(block_mask.kv_indices, q):
        raise ValueError(
            f"block_mask's tables are on {block_mask.kv_indices.device}, the call "
            f"on {q.device} (BlockMask.to(device))"
        )
    return block_mask
