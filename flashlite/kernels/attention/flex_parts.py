"""The block tables and the scored tiles of the flex kernels
(:mod:`flashlite.kernels.attention.flex`): a program's row of the tables (:func:`table_row`,
:func:`listed`), its rows of the LSE (:func:`lse_row`), a key tile's scores through the mask and
score functions (:func:`scored_tile`, :func:`mod_scores`) and the forward's fold of that tile
into the online softmax (:func:`fold_tile`)."""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import accumulate, load_tile, update
from flashlite.masking.mods import apply_mask, apply_score
from flashlite.stats import LOG2E


@triton.jit
def _mod_scores(
    x,
    b,
    h,
    q_idx,
    kv_idx,
    in_range,
    bufs,
    MASK_MOD: tl.constexpr,
    N_MASK_BUF: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    MASKED: tl.constexpr,
    BOUNDED: tl.constexpr = False,
):
    """Natural-unit scores ``x`` after ``score_mod`` and (``MASKED``) ``mask_mod``: pairs a
    query does not see, or past the keys (``in_range`` false), become −inf. ``BOUNDED``
    without ``MASKED``: the keys' bounds only (varlen's full tiles, listed for the longest
    sequence). ``q_idx`` and ``kv_idx`` broadcast against each other (either way round: the
    dK/dV loop is keys-major). ``bufs = (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3)``: the mask's
    buffers, then the score function's."""
    MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3 = bufs
    y = x
    if HAS_SCORE:
        y = apply_score(SCORE_MOD, x, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF)
    if MASKED:
        seen = apply_mask(MASK_MOD, b, h, q_idx, kv_idx, MB0, MB1, MB2, MB3, N_MASK_BUF)
        y = tl.where(seen & in_range, y, float("-inf"))
    elif BOUNDED:
        y = tl.where(in_range, y, float("-inf"))
    return y


@triton.jit
def score_grad(
    ds,
    x,
    b,
    h,
    q_idx,
    kv_idx,
    bufs,
    SCORE_GRAD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
):
    """``ds`` times the score function's derivative at the natural-unit scores ``x`` (``ds``
    itself without a score function); ``bufs`` as :func:`_mod_scores`'."""
    _MB0, _MB1, _MB2, _MB3, SB0, SB1, SB2, SB3 = bufs
    if HAS_SCORE:
        ds = ds * apply_score(SCORE_GRAD, x, b, h, q_idx, kv_idx, SB0, SB1, SB2, SB3, N_SCORE_BUF)
    return ds


@triton.jit
def load_rows(
    src,
    b,
    h,
    row0,
    n_rows,
    strides,
    offs,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """:func:`~flashlite.kernels.attention.common.load_tile` from the head pointer ``src``
    (no descriptors), with ``strides = (stride_row, stride_d)`` and ``offs = (offs_r,
    offs_d)``."""
    stride_row, stride_d = strides
    offs_r, offs_d = offs
    return load_tile(
        src,
        b,
        h,
        row0,
        n_rows,
        stride_row,
        stride_d,
        offs_r,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        False,
        CHECK_ROWS,
    )


@triton.jit
def table_row(b, h, block, strides):
    """Offsets of a program's row in the count tables and in the index tables (64-bit);
    ``strides = (stride_tb, stride_th, stride_tr, stride_ib, stride_ih, stride_ir)``, the
    count tables' strides then the index tables'."""
    stride_tb, stride_th, stride_tr, stride_ib, stride_ih, stride_ir = strides
    trow = b * stride_tb + h * stride_th + block * stride_tr
    irow = b.to(tl.int64) * stride_ib + h * stride_ih + block * stride_ir
    return trow, irow


@triton.jit
def listed(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, trow, irow, PART: tl.constexpr):
    """``(how many, where their indices start)`` of the row's full (``PART`` 0) or partial
    (``PART`` 1) blocks."""
    if PART == 0:
        n_blocks = tl.load(FULL_NUM + trow)
        idx_row = FULL_IDX + irow
    else:
        n_blocks = tl.load(PART_NUM + trow)
        idx_row = PART_IDX + irow
    return n_blocks, idx_row


@triton.jit
def lse_row(pid_bh, h, q0, q_mem, VARLEN: tl.constexpr):
    """Offset of a program's first row in the LSE (and delta): ``(B·Hq, Nq)``, or for varlen
    the packed ``(Hq, total)`` at the sequence's first row ``q0``."""
    if VARLEN:
        row = h.to(tl.int64) * q_mem + q0
    else:
        row = pid_bh.to(tl.int64) * q_mem
    return row


@triton.jit
def _scored_tile(
    q,
    q_idx,
    heads,
    kv,
    start_n,
    offs,
    sm_scale,
    bufs,
    MASK_MOD: tl.constexpr,
    N_MASK_BUF: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    MASKED: tl.constexpr,
    BOUNDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The key tile at ``start_n`` (``k``), its natural-unit scores ``x = q·kᵀ·scale`` and the
    scores the softmax takes, ``y`` (:func:`_mod_scores`; ``BOUNDED``: keys past ``seq_k``
    masked on full tiles too), and the tile's key positions. ``heads = (b, h, h_kv)``;
    ``kv = (k_src, v_src, k_strides, v_strides, seq_k)``: the K/V head's pointers, their
    ``(row, column)`` strides and the keys' count; ``offs = (offs_n, offs_d)``."""
    b, h, h_kv = heads
    k_src, _v_src, k_strides, _v_strides, seq_k = kv
    offs_n, _offs_d = offs
    k = load_rows(
        k_src, b, h_kv, start_n, seq_k, k_strides, offs, HEAD_DIM, BLOCK_D, MASKED | BOUNDED
    )
    if DOT_FP32:
        k = k.to(tl.float32)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    cols = start_n + offs_n
    kv_idx = tl.minimum(cols, seq_k - 1)[None, :]
    y = _mod_scores(
        x,
        b,
        h,
        q_idx,
        kv_idx,
        (cols < seq_k)[None, :],
        bufs,
        MASK_MOD,
        N_MASK_BUF,
        SCORE_MOD,
        N_SCORE_BUF,
        HAS_SCORE,
        MASKED,
        BOUNDED,
    )
    return k, x, y, kv_idx


@triton.jit
def fold_tile(
    m,
    s,
    acc,
    q,
    q_idx,
    heads,
    kv,
    start_n,
    offs,
    sm_scale,
    bufs,
    MASK_MOD: tl.constexpr,
    N_MASK_BUF: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    N_SCORE_BUF: tl.constexpr,
    HAS_SCORE: tl.constexpr,
    MASKED: tl.constexpr,
    BOUNDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The forward's step: the key tile at ``start_n`` scored (:func:`_scored_tile`, which
    says what the tuples hold), folded into ``(m, s)`` and ``acc += p·v`` (V ``HEAD_DIM_V``
    wide)."""
    _k, _x, y, _kv = _scored_tile(
        q,
        q_idx,
        heads,
        kv,
        start_n,
        offs,
        sm_scale,
        bufs,
        MASK_MOD,
        N_MASK_BUF,
        SCORE_MOD,
        N_SCORE_BUF,
        HAS_SCORE,
        MASKED,
        BOUNDED,
        HEAD_DIM,
        BLOCK_D,
        DOT_FP32,
        DOT_PRECISION,
    )
    m, s, alpha, p, moved = update(m, s, y, LOG2E, False)
    b, _h, h_kv = heads
    _k_src, v_src, _k_strides, v_strides, seq_k = kv
    stride_vn, stride_vd = v_strides
    offs_n, _offs_d = offs
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = accumulate(
        acc,
        alpha,
        moved,
        p,
        v_src,
        b,
        h_kv,
        start_n,
        0,
        seq_k,
        stride_vn,
        stride_vd,
        offs_n,
        offs_dv,
        MASKED | BOUNDED,
        HEAD_DIM_V,
        BLOCK_DV,
        False,
        DOT_FP32,
        DOT_PRECISION,
        ROUND_BF16,
        False,
    )
    return m, s, acc


# the backward's steps (flex_bwd_parts) call these two under their old names too
mod_scores = _mod_scores
scored_tile = _scored_tile
