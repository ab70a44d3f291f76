"""Plain Python mask functions, as FlexAttention users write them: ``(b, h, q_idx, kv_idx) ->
bool`` in torch ops on index tensors, closing over whatever tensors they like
(``ids[b, q_idx] == ids[b, kv_idx]``). The kernels cannot run Python, so the mask is evaluated
**once per block mask** on the tables' device, a band of query blocks at a time, and kept as
bits:

- every ``(query block, key block)`` tile is classified (empty, partial, full) from the bits;
- only the tiles whose pairs are mixed (some seen, some not) keep their bits, packed 32 keys to
  an int32 word: ``BITS`` ``(n_mixed, bm, cdiv(bn, 32))``;
- a slot table ``SLOT`` ``(B, H, nQ, nK)`` int32 says where: a tile's index into ``BITS``, or
  :data:`EMPTY_SLOT` / :data:`FULL_SLOT` (every pair in range seen: a ragged last key tile that
  is classified partial for its bounds still stores nothing).

The kernels read the bits through one built-in mask function, :func:`bits_mask` (its jit
function and torch twin registered once, as ``flashlite.bits``), whose buffers are the two
tables and a small int32 ``META`` of sizes: all tensors, so a new mask or new lengths make no
new kernel. Masks cheaper to compute than to read stay ``@triton.jit`` functions
(:func:`flashlite.mods.mask_mod`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from flashlite.masking.block_mask import FULL, PARTIAL, BlockMask, cdiv
from flashlite.masking.classify import band_blocks, classify_band
from flashlite.masking.mods import MaskMod, mask_mod

__all__ = [
    "EMPTY_SLOT",
    "FULL_SLOT",
    "BITS_NAME",
    "is_python_mask",
    "evaluate_mask",
    "bits_mask",
    "python_block_mask",
]

#: Slot-table entries of tiles that keep no bits.
EMPTY_SLOT, FULL_SLOT = -1, -2
#: The name the bits mask is registered under (one entry for every plain Python mask).
BITS_NAME = "flashlite.bits"
#: ``META`` entries: batch and head strides of ``SLOT`` (0: broadcast), its key blocks, the
#: tile, the words per tile row, the lengths.
_META = ("stride_b", "stride_h", "n_kb", "bm", "bn", "words", "nq", "nk")


def is_python_mask(fn: object) -> bool:
    """Whether ``fn`` is a plain Python mask function: callable with the four indices, and
    neither a :class:`MaskMod` nor a jit function (a gallery maker passed uncalled takes no
    indices, so it is not one: its hint comes from :func:`flashlite.mods.mask_mod`)."""
    if isinstance(fn, MaskMod) or not callable(fn) or hasattr(fn, "fn"):  # (jit: has .fn)
        return False
    try:
        inspect.signature(fn).bind(0, 0, 0, 0)
    except TypeError:
        return False
    except ValueError:  # (no signature to read: a builtin; let the call tell)
        return True
    return True


# --------------------------------------------------------------------------- evaluation
def _call(fn: Callable[..., Any], idx: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``fn`` on 1-D index tensors ``(b, h, q, kv)``: ``(B, H, Nq, Nk)`` bools. Broadcast index
    tensors first (one call); a function written for scalars (a Python ``if`` on them) is
    vmapped over the four indices instead, as torch's ``create_block_mask`` does."""
    b, h, q, kv = idx
    shape = (len(b), len(h), len(q), len(kv))
    try:
        got = fn(
            b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1)
        )
        got = torch.as_tensor(got, device=q.device).broadcast_to(shape)
    except Exception:  # noqa: BLE001 - any failure: try it the way torch calls it
        mapped = fn
        for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
            mapped = torch.vmap(mapped, in_dims=dims)
        got = torch.vmap(mapped, in_dims=(0, None, None, None))(b, h, q, kv)
    if got.dtype != torch.bool:
        raise TypeError(
            f"mask_mod {getattr(fn, '__name__', type(fn).__name__)} must return a bool tensor "
            f"(which keys each query sees), it returned {got.dtype}"
        )
    return got


def evaluate_mask(
    fn: Callable[..., Any], b: int, h: int, rows: tuple[int, int], nk: int, device: torch.device
) -> torch.Tensor:
    """``fn`` over batches ``< b``, heads ``< h``, queries ``rows[0] <= q_idx < rows[1]`` and
    keys ``< nk``: bools ``(b, h, rows[1] - rows[0], nk)``."""
    ar = [torch.arange(n, device=device) for n in (b, h)]
    q = torch.arange(rows[0], rows[1], device=device)
    with torch.no_grad():
        return _call(fn, (*ar, q, torch.arange(nk, device=device)))


def _pack(tiles: torch.Tensor) -> torch.Tensor:
    """Bool tiles ``(n, bm, bn)`` as int32 words ``(n, bm, cdiv(bn, 32))``, key ``j`` of a row
    in bit ``j % 32`` of word ``j // 32``."""
    n, bm, bn = tiles.shape
    words = cdiv(bn, 32)
    padded = torch.zeros(n, bm, words * 32, dtype=torch.int64, device=tiles.device)
    padded[..., :bn] = tiles
    weights = torch.ones((), dtype=torch.int64, device=tiles.device) << torch.arange(
        32, device=tiles.device
    )
    packed = (padded.view(n, bm, words, 32) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


#: Classes ``(B, H, nQ', nK')`` of a ``(bm', bn')`` tile that a mask is held within (torch's
#: tables: its empty blocks see nothing and its full blocks everything, whatever the function)
Given = tuple[torch.Tensor, tuple[int, int]]


def _within(seen: torch.Tensor, given: Given, q0: int) -> torch.Tensor:
    """``seen`` (rows from ``q0``) held to the given classes."""
    classes, (gm, gn) = given
    q = torch.arange(q0, q0 + seen.shape[2], device=seen.device) // gm
    kv = torch.arange(seen.shape[3], device=seen.device) // gn
    cls = classes[:, :, q][..., kv]
    return torch.where(cls == FULL, True, (cls == PARTIAL) & seen)


def _tables(
    fn: Callable[..., Any],
    b: int,
    h: int,
    lengths: tuple[int, int],
    block: tuple[int, int],
    device: torch.device,
    given: Given | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(classes, slot, bits)`` of ``fn`` (module docstring), a band of query blocks at a
    time."""
    (nq, nk), (bm, bn) = lengths, block
    nqb, nkb = cdiv(nq, bm), cdiv(nk, bn)
    classes = torch.empty(b, h, nqb, nkb, dtype=torch.int8, device=device)
    slot = torch.empty(b, h, nqb, nkb, dtype=torch.int32, device=device)
    words: list[torch.Tensor] = []
    stored = 0
    band = band_blocks(b, h, block, nkb)
    for r0 in range(0, nqb, band):
        r1 = min(nqb, r0 + band)
        q0, q1 = r0 * bm, min(nq, r1 * bm)
        seen = torch.zeros(b, h, (r1 - r0) * bm, nkb * bn, dtype=torch.bool, device=device)
        got = evaluate_mask(fn, b, h, (q0, q1), nk, device)
        seen[:, :, : q1 - q0, :nk] = got if given is None else _within(got, given, q0)
        n_rows = (nq - torch.arange(r0, r1, device=device) * bm).clamp(max=bm)
        cls, tiles, n_seen, in_range = classify_band(seen, n_rows, nk, block)
        mixed = (n_seen > 0) & (n_seen < in_range)
        classes[:, :, r0:r1] = cls
        picked = tiles[mixed]  # (row-major over (b, h, q block, k block): the slots' order)
        here = torch.full(cls.shape, EMPTY_SLOT, dtype=torch.int32, device=device)
        here[cls == FULL] = FULL_SLOT
        here[(cls == PARTIAL) & ~mixed] = FULL_SLOT  # (ragged last key tile, all in range seen)
        here[mixed] = torch.arange(stored, stored + len(picked), device=device, dtype=torch.int32)
        slot[:, :, r0:r1] = here
        words.append(_pack(picked))
        stored += len(picked)
    return classes, slot, torch.cat(words).contiguous()


# --------------------------------------------------------------------------- the bits mask
@triton.jit
def _bits(b, h, q_idx, kv_idx, SLOT, BITS, META):
    stride_b = tl.load(META + 0)
    stride_h = tl.load(META + 1)
    n_kb = tl.load(META + 2)
    bm = tl.load(META + 3)
    bn = tl.load(META + 4)
    words = tl.load(META + 5)
    # (indices clamped into the lengths: a kernel's rows past the end read a real tile)
    q = tl.minimum(q_idx, tl.load(META + 6) - 1)
    kv = tl.minimum(kv_idx, tl.load(META + 7) - 1)
    tile = b * stride_b + h * stride_h + (q // bm) * n_kb + kv // bn
    slot = tl.load(SLOT + tile)
    col = kv % bn
    word_at = (slot.to(tl.int64) * bm + q % bm) * words + col // 32
    word = tl.load(BITS + word_at, mask=slot >= 0, other=0)
    return (slot == -2) | (((word >> (col % 32)) & 1) != 0)


def _bits_t(b, h, q_idx, kv_idx, SLOT, BITS, META):  # type: ignore[no-untyped-def]
    stride_b, stride_h, n_kb, bm, bn, words, nq, nk = (int(x) for x in META.tolist())
    q = torch.as_tensor(q_idx).clamp(max=nq - 1)
    kv = torch.as_tensor(kv_idx).clamp(max=nk - 1)
    tile = b * stride_b + h * stride_h + (q // bm) * n_kb + kv // bn
    slot = SLOT.reshape(-1)[tile].long()
    col = kv % bn
    word_at = ((slot.clamp(min=0) * bm + q % bm) * words + col // 32).clamp(max=BITS.numel() - 1)
    word = BITS.reshape(-1)[word_at] if BITS.numel() else torch.zeros_like(word_at)
    bit = ((word >> (col % 32)) & 1) != 0
    return (slot == FULL_SLOT) | ((slot >= 0) & bit)


def _bits_reads(bm: int, bn: int) -> int:
    # a slot and a word per pair, as issued (a tile mostly hits one slot and few words), and
    # the META sizes, read once per tile
    return bm * bn * 8 + 4 * len(_META)


def bits_mask(
    slot: torch.Tensor, bits: torch.Tensor, lengths: tuple[int, int], block: tuple[int, int]
) -> MaskMod:
    """The mask kept as bits: ``slot`` int32 ``(B, H, nQ, nK)`` (B or H 1: broadcast),
    ``bits`` int32 ``(n_mixed, bm, cdiv(bn, 32))`` of a ``block`` tile over ``lengths``
    ``(Nq, Nk)``. Registered as :data:`BITS_NAME` (one kernel for every such mask)."""
    b, h, nqb, nkb = slot.shape
    stride_b = 0 if b == 1 else h * nqb * nkb
    stride_h = 0 if h == 1 else nqb * nkb
    meta = (stride_b, stride_h, nkb, *block, cdiv(block[1], 32), *lengths)
    meta_t = torch.tensor(meta, dtype=torch.int32, device=slot.device)
    if bits.numel() == 0:  # (a pointer the kernels may form but never read through)
        bits = torch.zeros(1, dtype=torch.int32, device=slot.device)
    limits = (None if b == 1 else b, None if h == 1 else h, None)
    return mask_mod(
        _bits,
        slot.contiguous(),
        bits,
        meta_t,
        torch_fn=_bits_t,
        name=BITS_NAME,
        tile_reads=_bits_reads,
        limits=limits,
    )


def python_block_mask(
    fn: Callable[..., Any],
    b: int,
    h: int,
    lengths: tuple[int, int],
    block: tuple[int, int],
    device: torch.device,
    given: Given | None = None,
) -> BlockMask:
    """A :class:`BlockMask` of the plain Python mask ``fn`` over ``b`` batches and ``h`` heads
    (1: the mask does not depend on it) whose ``mask_mod`` reads its bits (:func:`bits_mask`).
    ``given``: classes ``(b, h, nQ', nK')`` of another tile (torch's tables) that the mask is
    held to: their empty tiles see nothing, their full tiles everything.

    Raises:
        TypeError: ``fn`` returns something other than bools.
    """
    classes, slot, bits = _tables(fn, b, h, lengths, block, device, given)
    mod = bits_mask(slot, bits, lengths, block)
    return BlockMask.from_classes(classes, lengths, block, mod)
