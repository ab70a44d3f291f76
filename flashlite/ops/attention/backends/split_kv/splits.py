"""How many key chunks a split-KV call runs: per decode shape on this GPU (:func:`chosen_splits`,
:func:`default_splits`), the rule behind it (:func:`splits_for`), the shared prefix's
(:func:`prefix_splits`), and the decode kernel's tile (:func:`decode_tiles`)."""

from __future__ import annotations

import torch

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.kernels import configs as C


def default_splits(
    dev: torch.device, programs: int, rows: int, nk: int, block_m: int, per_sm: int = 1
) -> int:
    """Key chunks per row block on this device: :func:`splits_for` on a GPU, 1 in the
    interpreter (its programs run one after the other)."""
    if _backend.kernels_interpreted() or dev.type != "cuda":
        return 1
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return splits_for(programs, rows, nk, _backend.num_sms(index), block_m, per_sm)


def splits_for(programs: int, rows: int, nk: int, sms: int, block_m: int, per_sm: int = 1) -> int:
    """At most ``per_sm`` programs per SM, no chunk shorter than 256 keys, at most 64 chunks
    (``programs`` = batch·KV heads, ``rows`` = packed query rows per KV head). A contiguous
    cache streams fastest with one long chunk per SM (its loads are pipelined; a second program
    only splits the SM's bandwidth); a paged one, whose loads wait on the block table, with two
    (H200, ``benchmarks/NOTES.md``)."""
    blocks = programs * C.cdiv(rows, block_m)
    if blocks == 0:  # an empty batch or no query rows: nothing to split
        return 1
    return max(1, min(per_sm * sms // blocks, C.cdiv(nk, 256), 64))


def prefix_splits(
    rows: int, hkv: int, n_keys: int, head_dim: int, elem_bytes: int, sms: int
) -> int:
    """Key chunks of :func:`flashlite.attention_shared_prefix`'s prefix pass (``rows`` query rows
    per KV head, all requests together, against ``n_keys`` shared keys) on a GPU of ``sms`` SMs:
    two programs per SM, where a single decode step's one per SM leaves its few programs
    waiting on their loads (at Np = 32k and 256 rows per KV head, 8 chunks ran 0.100 ms on the
    H200 in a CUDA graph, 4 chunks 0.119 ms). Read by the op and by :mod:`flashlite.traffic`."""
    block_m = decode_tiles(rows, hkv, head_dim, elem_bytes).block_m
    return splits_for(hkv, rows, n_keys, sms, block_m, per_sm=2)


def decode_tiles(
    rows: int, programs: int, head_dim: int, elem_bytes: int, interpreted: bool = False
) -> C.DecodeConfig:
    """The decode kernel's tile for ``rows`` packed query rows per KV head (``Nq·Hq/Hkv``) over
    ``programs`` = B·Hkv of them: what :class:`~flashlite.ops.attention.DecodePlan` runs (the
    interpreter's small tile where ``interpreted``) and what :mod:`flashlite.traffic` counts
    and models."""
    return C.decode_config(rows, interpreted, programs, C.block_d(head_dim), elem_bytes)


def chosen_splits(q: torch.Tensor, k: torch.Tensor, num_splits: int | None) -> int:
    """The op's ``num_splits`` for :func:`attention`'s: 0 runs the forward kernel, n >= 1 the
    decode kernel with n key chunks. ``None`` takes the decode kernel on a GPU when the packed
    query rows per KV head (``Nq·Hq/Hkv``) fit one of its tiles, with the chunks that fill the
    GPU; ``1`` never splits."""
    if num_splits is not None:
        return 0 if num_splits == 1 else num_splits
    if not q.is_cuda or _backend.INTERPRETED:
        return 0
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = nq * (hq // hkv)
    if rows > DECODE_MAX_ROWS:
        return 0
    key = (q.shape, hkv, nk, q.dtype, q.device)
    found = _splits.get(key)
    if found is None:
        block_m = decode_tiles(rows, b * hkv, q.shape[3], q.element_size()).block_m
        found = _splits.put(key, default_splits(q.device, b * hkv, rows, nk, block_m))
    return found


#: :func:`chosen_splits` per decode shape (a decode loop asks once per step).
_splits = Cache("attention.decode_splits", 1024)


#: :func:`attention` runs the decode kernel by itself up to this many packed rows (one tile).
DECODE_MAX_ROWS = 64
