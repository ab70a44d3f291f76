"""The key-tile loop of the decode kernel (:mod:`flashlite.kernels.attention.decode`): the K and V
tiles of a paged or plain cache (:func:`kv_tile`) folded into the running statistics, with the
mask and score functions of :mod:`flashlite.mods` (:func:`decode_attend`)."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import head_ptr, load_tile, score_tile, update
from flashlite.kernels.common import cast
from flashlite.masking.mods import apply_mask, apply_score
from flashlite.stats import LN2


@triton.jit
def kv_tile(
    X, strides, pages, b, h_kv, start_n, offs_n, offs_d, seq_k, MASKED: tl.constexpr, tiles
):
    """The ``[BLOCK_N, BLOCK_D]`` tile of keys (or values) ``start_n + offs_n`` of KV head
    ``(b, h_kv)``; zeros past ``seq_k`` on ``MASKED`` tiles.

    ``X`` is a ``(B, Hkv, Ncap, D)`` cache of ``strides`` (a tensor descriptor with
    ``USE_DESC``) or, with ``PAGE_SIZE`` > 0, a paged one ``(num_pages, Hkv, PAGE_SIZE, D)``
    whose key ``j`` of batch b lives in page ``TABLE[b, j // PAGE_SIZE]``: each row finds its
    page, so tiles may span pages of any size (a page id outside ``[0, num_pages)`` is clamped:
    a wrong answer, never a read outside the cache). ``pages``: ``(TABLE, stride_tb,
    num_pages)``; ``tiles``: the constexprs ``(PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
    USE_DESC)``.
    """
    # (constexprs leave their tuple by index into annotated names: unpacking would make them
    # tensors)
    PAGE_SIZE: tl.constexpr = tiles[0]
    HEAD_DIM: tl.constexpr = tiles[1]
    BLOCK_D: tl.constexpr = tiles[2]
    BLOCK_N: tl.constexpr = tiles[3]
    USE_DESC: tl.constexpr = tiles[4]
    stride_b, stride_h, stride_n, stride_d = strides
    TABLE, stride_tb, num_pages = pages
    if PAGE_SIZE > 0:
        rows = start_n + offs_n
        # tiles start at multiples of BLOCK_N: a page of a multiple of BLOCK_N keys holds a whole
        # tile (one table read); any other page size (192 keys and 128-key tiles, say) may end
        # inside a tile, so each row reads its own entry
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(TABLE + b.to(tl.int64) * stride_tb + start_n // PAGE_SIZE)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
            row_off = page * stride_b + (rows % PAGE_SIZE).to(tl.int64) * stride_n
        else:
            page = tl.load(
                TABLE + b.to(tl.int64) * stride_tb + rows // PAGE_SIZE, mask=rows < seq_k, other=0
            )
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
            row_off = page * stride_b + (rows % PAGE_SIZE).to(tl.int64) * stride_n
        ptrs = X + h_kv.to(tl.int64) * stride_h + row_off[:, None] + offs_d[None, :] * stride_d
        mask = offs_d[None, :] < HEAD_DIM
        if MASKED:
            mask = mask & (rows[:, None] < seq_k)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        src = X if USE_DESC else head_ptr(X, b, h_kv, stride_b, stride_h)
        tile = load_tile(
            src,
            b,
            h_kv,
            start_n,
            seq_k,
            stride_n,
            stride_d,
            offs_n,
            offs_d,
            HEAD_DIM,
            BLOCK_D,
            USE_DESC,
            MASKED,
        )
    return tile


@triton.jit
def _apply_mods(qk, start_n, ids, scoring, bufs, mods):
    """The score tile ``qk`` ``[BLOCK_M, BLOCK_N]`` (keys ``start_n + offs_n``) rewritten by the
    ``SCORE_MOD`` and masked by the ``MASK_MOD`` of the constexprs ``mods`` ``(MASK_MOD,
    N_MASK_BUF, SCORE_MOD, N_SCORE_BUF)``, with their buffers ``bufs`` ``(MB0..MB3,
    SB0..SB3)``; as :func:`decode_attend` says."""
    MASK_MOD: tl.constexpr = mods[0]
    N_MASK_BUF: tl.constexpr = mods[1]
    SCORE_MOD: tl.constexpr = mods[2]
    N_SCORE_BUF: tl.constexpr = mods[3]
    b, _h_kv, head, pos, offs_n, _offs_d = ids
    seq_q, seq_k, _left, _right, _cap, exp_scale = scoring
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3 = bufs
    keys = start_n + offs_n
    q_idx = (seq_k - seq_q + tl.minimum(pos, seq_q - 1))[:, None]
    if SCORE_MOD is not None:
        units = exp_scale * LN2  # natural units per unit of qk (Q may be prescaled)
        y = apply_score(
            SCORE_MOD,
            qk * units,
            b,
            head[:, None],
            q_idx,
            tl.minimum(keys, seq_k - 1)[None, :],
            SB0,
            SB1,
            SB2,
            SB3,
            N_SCORE_BUF,
        )
        # (pairs masked above stay masked whatever the function makes of −inf)
        qk = tl.where(qk > float("-inf"), y * (1.0 / units), float("-inf"))
    if MASK_MOD is not None:
        seen = apply_mask(
            MASK_MOD,
            b,
            head[:, None],
            q_idx,
            tl.minimum(keys, seq_k - 1)[None, :],
            MB0,
            MB1,
            MB2,
            MB3,
            N_MASK_BUF,
        )
        qk = tl.where(seen & (keys < seq_k)[None, :], qk, float("-inf"))
    return qk


@triton.jit
def decode_attend(
    acc, m, s, q, K, V, lo, hi, MASKED: tl.constexpr, cache, ids, scoring, bufs, mods, tiles, flags
):
    """Fold key tiles ``[lo, hi)`` into ``(acc, m, s)``: the forward's loop body, with rows at
    query positions ``pos`` (packed rows of several heads share positions) and K/V tiles from
    :func:`kv_tile`. A ``MASK_MOD`` (:mod:`flashlite.mods`) masks every tile, called with each
    row's query head ``head`` and its position in the sequence, ``seq_k − seq_q + pos``; a
    ``SCORE_MOD`` rewrites the scores first, in natural units (``q·k·scale``), on the pairs
    the built-in masks leave.

    The rest comes in tuples: ``cache`` ``(k_strides, v_strides, (TABLE, stride_tb,
    num_pages))``, ``ids`` ``(b, h_kv, head, pos, offs_n, offs_d)``, ``scoring`` ``(seq_q,
    seq_k, left, right, cap, exp_scale)``, ``bufs`` and ``mods`` (:func:`_apply_mods`), and the
    constexprs ``tiles`` (:func:`kv_tile`) and ``flags`` ``(IS_CAUSAL, WINDOW, SOFTCAP,
    DOT_FP32, DOT_PRECISION, ROUND_BF16, FP8)``; ``FP8`` (a 16-bit dtype, or None): the e4m3
    tiles are widened to it as they are read."""
    IS_CAUSAL: tl.constexpr = flags[0]
    WINDOW: tl.constexpr = flags[1]
    SOFTCAP: tl.constexpr = flags[2]
    DOT_FP32: tl.constexpr = flags[3]
    DOT_PRECISION: tl.constexpr = flags[4]
    ROUND_BF16: tl.constexpr = flags[5]
    FP8: tl.constexpr = flags[6]
    BLOCK_N: tl.constexpr = tiles[3]
    k_strides, v_strides, pages = cache
    b, h_kv, _head, pos, offs_n, offs_d = ids
    seq_q, seq_k, left, right, cap, exp_scale = scoring
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = kv_tile(K, k_strides, pages, b, h_kv, start_n, offs_n, offs_d, seq_k, MASKED, tiles)
        if FP8 is not None:
            k = k.to(FP8)
        qk = score_tile(
            q,
            k,
            start_n,
            pos,
            offs_n,
            seq_q,
            seq_k,
            left,
            right,
            cap,
            MASKED,
            IS_CAUSAL,
            WINDOW,
            SOFTCAP,
            DOT_FP32,
            DOT_PRECISION,
        )
        qk = _apply_mods(qk, start_n, ids, scoring, bufs, mods)
        m, s, alpha, p, _moved = update(m, s, qk, exp_scale, False)
        v = kv_tile(V, v_strides, pages, b, h_kv, start_n, offs_n, offs_d, seq_k, MASKED, tiles)
        if FP8 is not None:
            v = v.to(FP8)
        p = cast(p, v.dtype, ROUND_BF16)
        if DOT_FP32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m, s
