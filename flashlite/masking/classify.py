"""The tile classifier behind :func:`flashlite.create_block_mask`: evaluates a mask function once
per ``(query block, key block)`` tile on the device and writes its class (empty 0, partial 1,
full 2; :mod:`flashlite.masking.block_mask`). Its torch twin is :func:`torch_classify`;
:func:`classify_tiles` launches one or the other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlite import _backend
from flashlite.masking.block_mask import EMPTY, FULL, PARTIAL, cdiv
from flashlite.masking.mods import MaskMod, apply_mask, kernel_buffers, torch_indices

__all__ = ["classify_tiles", "torch_classify"]


@triton.jit(do_not_specialize=("seq_q", "seq_k", "n_kb", "B0", "B1", "B2", "B3"))
def _classify_tiles_kernel(
    CLS,
    n_heads,
    seq_q,
    seq_k,
    n_kb,
    B0,
    B1,
    B2,
    B3,
    MASK_MOD: tl.constexpr,
    N_BUF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(nQ, B·H)``: one program per query block of one (batch, head), walking every key
    block. Rows past ``seq_q`` are ignored; a tile crossing ``seq_k`` is never full (full tiles
    run without bounds checks). The mask sees indices clamped into range, so that buffers
    indexed by position are never read out of bounds."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    q_idx = tl.minimum(rows, seq_q - 1)[:, None]
    n_rows = tl.sum(row_ok.to(tl.int32), 0)
    out = CLS + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * n_kb
    for kb in range(0, n_kb):
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_idx = tl.minimum(cols, seq_k - 1)[None, :]
        seen = apply_mask(MASK_MOD, b, h, q_idx, kv_idx, B0, B1, B2, B3, N_BUF)
        seen = seen & row_ok[:, None] & (cols < seq_k)[None, :]
        n_seen = tl.sum(tl.sum(seen.to(tl.int32), 1), 0)
        cls = tl.where(n_seen > 0, 1, 0)
        # full: every row in range sees every key, and the tile lies inside the keys
        full = (n_seen == n_rows * BLOCK_N) & (kb * BLOCK_N + BLOCK_N <= seq_k)
        cls = tl.where(full, 2, cls)
        tl.store(out + kb, cls.to(tl.int8))


#: mask evaluations per band of query blocks (bounded memory at long lengths)
BAND_PAIRS = 1 << 24


def band_blocks(b: int, h: int, block: tuple[int, int], nkb: int) -> int:
    """Query blocks per band when a mask is evaluated in torch over ``nkb`` key blocks."""
    return max(1, BAND_PAIRS // max(1, b * h * block[0] * nkb * block[1]))


def classify_band(
    seen: torch.Tensor, n_rows: torch.Tensor, nk: int, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One band's tiles from its seen pairs ``(B, H, R·bm, nK·bn)`` (padded to whole tiles;
    ``n_rows`` ``(R,)``: each query block's rows in range): int8 classes ``(B, H, R, nK)``
    (a tile crossing ``Nk`` is never full: full tiles run without bounds checks), the tiles'
    pairs ``(B, H, R, nK, bm, bn)``, how many pairs each sees and how many are in range."""
    bm, bn = block
    b, h, r, nkb = seen.shape[0], seen.shape[1], seen.shape[2] // bm, seen.shape[3] // bn
    tiles = seen.view(b, h, r, bm, nkb, bn).permute(0, 1, 2, 4, 3, 5)
    n_seen = tiles.sum((4, 5))
    n_cols = (nk - torch.arange(nkb, device=seen.device) * bn).clamp(max=bn)
    in_range = n_rows.view(-1, 1) * n_cols.view(1, -1)
    full = (n_seen == in_range) & (n_cols == bn)
    cls = torch.where(full, FULL, torch.where(n_seen > 0, PARTIAL, EMPTY)).to(torch.int8)
    return cls, tiles, n_seen, in_range


def torch_classify(
    mod: MaskMod,
    b: int,
    h: int,
    nq: int,
    nk: int,
    block: tuple[int, int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Twin of the classifier kernel: int8 classes ``(B, H, cdiv(Nq, bm), cdiv(Nk, bn))`` from
    the mask over every pair (rows past ``Nq`` ignored; tiles crossing ``Nk`` never full),
    evaluated a band of query blocks at a time (:func:`classify_band`)."""
    bm, bn = block
    nqb, nkb = cdiv(nq, bm), cdiv(nk, bn)
    out = torch.empty(b, h, nqb, nkb, dtype=torch.int8, device=device)
    band = band_blocks(b, h, block, nkb)
    for r0 in range(0, nqb, band):
        r1 = min(nqb, r0 + band)
        q0, q1 = r0 * bm, min(nq, r1 * bm)
        idx = torch_indices(b, h, q1 - q0, nk, device)
        seen = torch.zeros(b, h, (r1 - r0) * bm, nkb * bn, dtype=torch.bool, device=device)
        got = mod(idx[0], idx[1], idx[2] + q0, idx[3])
        seen[:, :, : q1 - q0, :nk] = torch.as_tensor(got, device=device).to(torch.bool)
        rows = (nq - torch.arange(r0, r1, device=device) * bm).clamp(max=bm)
        out[:, :, r0:r1] = classify_band(seen, rows, nk, block)[0]
    return out


def classify_tiles(
    mod: MaskMod, b: int, h: int, nq: int, nk: int, block: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """Int8 classes ``(B, H, cdiv(Nq, bm), cdiv(Nk, bn))`` of ``mod``'s tiles of ``block``
    (:data:`~flashlite.masking.block_mask.EMPTY`, ``PARTIAL``, ``FULL``), on ``device``."""
    bm, bn = block
    nqb, nkb = cdiv(nq, bm), cdiv(nk, bn)
    # On CPU the twin stands in when no kernel runs here, and for long sequences, where it is
    # the same classification (tested equal) without the interpreter's Python per program.
    if device.type == "cpu" and (not _backend.INTERPRETED or b * h * nq * nk > _TWIN_PAIRS):
        return torch_classify(mod, b, h, nq, nk, (bm, bn), device)
    classes = torch.empty((b, h, nqb, nkb), dtype=torch.int8, device=device)
    bufs, n_buf = kernel_buffers(mod.buffers)
    _classify_tiles_kernel[(nqb, b * h)](
        classes, h, nq, nk, nkb, *bufs, MASK_MOD=mod.fn, N_BUF=n_buf, BLOCK_M=bm, BLOCK_N=bn
    )
    return classes


#: mask evaluations past which a CPU classification takes the torch twin
_TWIN_PAIRS = 1 << 22
