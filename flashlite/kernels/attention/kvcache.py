"""The KV-cache step's bookkeeping on the device: the value checks and the append of ``k_new`` /
``v_new``, in one launch, with no host sync.

Program ``(b, n)`` handles token ``n`` of batch ``b``'s new keys: it writes them into the cache
at position ``cache_seqlens[b] + n`` (page ``block_table[b, pos // PAGE_SIZE]`` of a paged cache)
and program ``(b, 0)`` writes the new length. With ``CHECK``, a row whose values are bad (a
negative length, ``length + Nnew`` past the capacity, a block-table entry outside the pool among
the pages the row uses) writes no key, and the first such row is recorded for the host:
``RECORD = (flag, kind, b, j, value, Nnew, limit)``, kind 1 a negative length, 2 one past the
capacity ``limit``, 3 a bad page ``block_table[b, j]`` of a pool of ``limit`` pages; and
``HOST_FLAG[0]`` is set to 1 (pinned host memory on a GPU, which the host reads without waiting).
Without ``CHECK`` positions and page ids are clamped: bad values give wrong results, never a
write outside the caches. ``FP8``: e4m3 caches; the new keys and values are divided by their
head's descale factor (``K_SCALE``, ``V_SCALE``: ``(B, Hkv)`` fp32, strides ``stride_sb``,
``stride_sh``) and quantised as they are written (:func:`~flashlite.kernels.common.to_e4m3`).
``KEYS_ONLY``: one cache holds keys and values (absorbed MLA's latent rows): written once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.common import to_e4m3


@triton.jit
def _row_problem(
    SEQLENS, b, n_new, capacity, table, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr
):
    """``(kind, j, value)`` of batch ``b``'s first bad value (kind 0: none); ``table`` is
    ``(TABLE, stride_table, num_pages, max_pages)``."""
    TABLE, stride_table, num_pages, max_pages = table
    length = tl.load(SEQLENS + b).to(tl.int64)
    end = length + n_new
    kind = tl.where(length < 0, 1, tl.where(end > capacity, 2, 0))
    value = length
    # (a tensor from the start: a table of one page passes max_pages as a constant 1, and a
    # loop-carried value must keep one type)
    first = tl.zeros((), dtype=tl.int32) + max_pages
    if PAGE_SIZE > 0:  # the entries of the pages the row uses, once its length is clamped
        used = (tl.minimum(tl.maximum(end, 0), capacity) + PAGE_SIZE - 1) // PAGE_SIZE
        for j0 in range(0, max_pages, BLOCK_P):
            j = j0 + tl.arange(0, BLOCK_P)
            in_use = j < used
            page = tl.load(TABLE + b * stride_table + j, mask=in_use, other=0)
            wrong = in_use & ((page < 0) | (page >= num_pages))
            first = tl.minimum(first, tl.min(tl.where(wrong, j, max_pages), axis=0))
        bad_page = first < max_pages
        kind = tl.where((kind == 0) & bad_page, 3, kind)
        if kind == 3:
            value = tl.load(TABLE + b * stride_table + first).to(tl.int64)
    return kind, tl.where(kind == 3, first, 0), value


@triton.jit
def _copy_token(NEW, CACHE, at, new_strides, cache_strides, scales, FP8: tl.constexpr):
    """Copy token ``n`` of batch ``b`` of a ``(B, Nnew, Hkv, D)`` tensor of new keys (or values)
    into slot ``slot`` of row ``row`` (a page, or the batch row) of its cache, the ``(Hkv, D)``
    block at ``h`` ``[BLOCK_H, 1]`` and ``d`` ``[1, BLOCK_D]`` under ``mask``; ``at`` is ``(b,
    n, row, slot, h, d, mask)``, the strides ``(b, n, h, d)`` and ``(row, slot, h, d)``;
    ``scales``: ``(SCALE, stride_sb, stride_sh, EXACT)`` of an ``FP8`` cache."""
    b, n, row, slot, h, d, mask = at
    stride_b, stride_n, stride_h, stride_d = new_strides
    stride_c0, stride_c1, stride_ch, stride_cd = cache_strides
    src = b.to(tl.int64) * stride_b + n.to(tl.int64) * stride_n
    x = tl.load(NEW + src + h * stride_h + d * stride_d, mask=mask)
    if FP8:  # quantised with the cache's factor of this batch row and head
        SCALE, stride_sb, stride_sh, EXACT = scales
        at_head = SCALE + b.to(tl.int64) * stride_sb + h * stride_sh + d * 0  # [BLOCK_H, BLOCK_D]
        factor = tl.load(at_head, mask=mask, other=1.0)
        x = to_e4m3(x.to(tl.float32) / factor, EXACT)
    tl.store(
        CACHE + row * stride_c0 + slot * stride_c1 + h * stride_ch + d * stride_cd, x, mask=mask
    )


@triton.jit
def _kvcache_append_kernel(
    K_CACHE,
    V_CACHE,
    K_NEW,
    V_NEW,
    SEQLENS,
    LENGTHS,
    TABLE,
    RECORD,
    HOST_FLAG,
    stride_kc0,
    stride_kc1,
    stride_kch,
    stride_kcd,
    stride_vc0,
    stride_vc1,
    stride_vch,
    stride_vcd,
    stride_knb,
    stride_knn,
    stride_knh,
    stride_knd,
    stride_vnb,
    stride_vnn,
    stride_vnh,
    stride_vnd,
    stride_table,
    K_SCALE,
    V_SCALE,
    stride_sb,
    stride_sh,
    n_heads,
    head_dim,
    n_new,
    capacity,
    num_pages,
    max_pages,
    PAGE_SIZE: tl.constexpr,
    CHECK: tl.constexpr,
    APPEND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FP8: tl.constexpr = False,
    EXACT: tl.constexpr = False,
    KEYS_ONLY: tl.constexpr = False,
):
    b = tl.program_id(0)
    n = tl.program_id(1)
    length = tl.load(SEQLENS + b).to(tl.int64)
    write = True
    if CHECK:
        table = (TABLE, stride_table, num_pages, max_pages)
        kind, j, value = _row_problem(SEQLENS, b, n_new, capacity, table, PAGE_SIZE, BLOCK_P)
        write = kind == 0
        zero = value * 0  # (an int64 0: the record's type; sizes of value 1 arrive as constants)
        if (n == 0) & (kind != 0):  # noqa: SIM102  (Triton's `and` would not short-circuit)
            if tl.atomic_cas(RECORD, zero, zero + 1) == 0:  # the first report stands till read
                tl.store(RECORD + 1, zero + kind)
                tl.store(RECORD + 2, zero + b)
                tl.store(RECORD + 3, zero + j)
                tl.store(RECORD + 4, value)
                tl.store(RECORD + 5, zero + n_new)
                tl.store(RECORD + 6, zero + tl.where(kind == 3, num_pages, capacity))
                tl.store(HOST_FLAG, 1)
    if n == 0:  # the decode kernel clamps lengths to the capacity when it reads them
        tl.store(LENGTHS + b, (length + n_new).to(tl.int32))
    if APPEND & write:
        pos = tl.minimum(tl.maximum(length + n, 0), capacity - 1)
        if PAGE_SIZE > 0:
            page = tl.load(TABLE + b * stride_table + pos // PAGE_SIZE).to(tl.int64)
            row, slot = tl.minimum(tl.maximum(page, 0), num_pages - 1), pos % PAGE_SIZE
        else:
            row, slot = b.to(tl.int64), pos
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < n_heads) & (d < head_dim)
        at = (b, n, row, slot, h, d, mask)
        k_new = (stride_knb, stride_knn, stride_knh, stride_knd)
        k_cache = (stride_kc0, stride_kc1, stride_kch, stride_kcd)
        k_scale = (K_SCALE, stride_sb, stride_sh, EXACT)
        _copy_token(K_NEW, K_CACHE, at, k_new, k_cache, k_scale, FP8)
        if not KEYS_ONLY:  # (absorbed MLA: one latent cache, its values the keys' bytes)
            v_new = (stride_vnb, stride_vnn, stride_vnh, stride_vnd)
            v_cache = (stride_vc0, stride_vc1, stride_vch, stride_vcd)
            v_scale = (V_SCALE, stride_sb, stride_sh, EXACT)
            _copy_token(V_NEW, V_CACHE, at, v_new, v_cache, v_scale, FP8)


def append_config(n_heads: int, head_dim: int) -> dict[str, int]:
    """Tiles of the append kernel: one token's ``(Hkv, D)`` block, the table in 256 entries."""
    return {
        "BLOCK_H": triton.next_power_of_2(n_heads),
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "BLOCK_P": 256,
        "num_warps": 4,
    }
