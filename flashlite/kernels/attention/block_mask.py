"""The tile classifier behind :func:`flashlite.create_block_mask`: evaluates a mask function once
per ``(query block, key block)`` tile on the device and writes its class (empty 0, partial 1,
full 2; :mod:`flashlite.block_mask`). Its torch twin is :func:`flashlite.block_mask.torch_classify`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.mods import apply_mask


@triton.jit(do_not_specialize=("seq_q", "seq_k", "n_kb", "B0", "B1", "B2", "B3"))
def _classify_tiles_kernel(
    CLS, n_heads, seq_q, seq_k, n_kb,
    B0, B1, B2, B3,
    MASK_MOD: tl.constexpr, N_BUF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
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
