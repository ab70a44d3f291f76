"""The absorbed MLA decode step's kernel plan (:mod:`flashlite.kernels.attention.mla`): the query
heads packed against one latent cache whose first ``D_LATENT`` columns are the values, the keys
split across programs and merged by the decode kernel's combine, planned once per kind of call
(:class:`MLADecodePlan`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from flashlite import _backend, _launch
from flashlite.kernels import configs as C
from flashlite.kernels.attention import mla as KM
from flashlite.ops.attention.backends.common import dot_flags
from flashlite.ops.attention.backends.split_kv.decode import Partials, key_chunks
from flashlite.ops.attention.backends.split_kv.splits import default_splits


def mla_tiles(interpreted: bool) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_N, num_warps)`` of the MLA kernel: small in the interpreter; on a GPU 32
    heads by 32 keys on 8 warps, which an sm_90 build at 512 + 64 runs without spilling (64 heads,
    FlashMLA's block, spilled 1.5 kB or more: a tile to measure on the GPU)."""
    return (16, 16, 4) if interpreted else (32, 32, 8)


class MLADecodePlan:
    """:func:`~flashlite.attention_mla_decode`'s kernels for one kind of call: the tile, the key
    chunks, the grids, the scalar arguments, the launches bound at the first run.

    Called as the decode plan is (:class:`~flashlite.ops.attention.backends.split_kv.decode.
    DecodePlan`): ``(q, kv, kv, lengths, block_table, o, lse, ...)`` on ``b h n d`` views, q
    ``(B, Hq, Nq, D_LATENT + D_ROPE)``, the latent cache ``(B, 1, Ncap, ·)`` or paged ``(num_pages,
    1, page_size, ·)`` (given twice: keys and values are its bytes), o ``(B, Hq, Nq,
    D_LATENT)``. ``tiles``: pin ``(BLOCK_H, BLOCK_N, num_warps)`` (the traffic tools count the
    GPU's in the interpreter), else :func:`mla_tiles`."""

    def __init__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        o: torch.Tensor,
        block_table: torch.Tensor | None,
        scale: float,
        causal: bool,
        num_splits: int | None,
        tiles: tuple[int, int, int] | None = None,
    ) -> None:
        b, hq, nq, d = q.shape
        d_latent = o.shape[3]  # (the rest of a row, d − d_latent, is the rotary key: 64)
        page_size = kv.shape[2] if block_table is not None else 0
        nk = block_table.shape[1] * page_size if block_table is not None else kv.shape[2]
        self.empty = b * hq * nq == 0 or nk == 0
        self.splits = 1
        if self.empty:
            return
        interpreted = _backend.kernels_interpreted()
        block_h, block_n, warps = tiles or mla_tiles(interpreted)
        rows = nq * hq
        if num_splits is None:
            num_splits = default_splits(q.device, b, rows, nk, block_h, 2 if page_size else 1)
        split_len, splits = key_chunks(nk, block_n, num_splits)
        self.splits = splits
        self.grid = (C.cdiv(rows, block_h), b, splits)
        self.options = {
            "D_LATENT": d_latent,
            "D_ROPE": d - d_latent,
            "BLOCK_H": block_h,
            "BLOCK_N": block_n,
            "IS_CAUSAL": causal,
            "PAGE_SIZE": page_size,
            "DOT_FP32": dot_flags(q.dtype)["DOT_FP32"],
            "ROUND_BF16": _backend.round_bf16(q.dtype),
            "num_warps": warps,
            "num_stages": 2,
        }
        self.parts = Partials(splits, b, hq, nq, d_latent, o)
        self.head = (
            *q.stride(),
            *kv.stride(),
            *self.parts.out_strides,
            hq,
            nq,
            nk,
            scale,
            block_table.stride(0) if block_table is not None else 0,
            kv.shape[0],
            split_len,
        )
        self._decode: Any = None

    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        _v: torch.Tensor,
        lengths: torch.Tensor,
        block_table: torch.Tensor | None,
        o: torch.Tensor,
        lse: torch.Tensor,
        *_unused: Any,
    ) -> int:
        """Run on tensors of the planned kind; returns the chunks used."""
        if self.empty:
            o.zero_()
            lse.fill_(-math.inf)
            return 1
        parts = self.parts
        o_out, lse_out = (o, lse) if parts.size is None else parts.buffers(o.device)
        table = block_table if block_table is not None else lengths
        args = (q, kv, o_out, lse_out, lengths, table, *self.head)
        if self._decode is None:
            self._decode = _launch.launcher(KM._mla_decode_kernel).bind(args, self.options)
        self._decode(self.grid, *args)
        if parts.size is not None:
            parts.merge(o_out, lse_out, o, lse)
        return self.splits
