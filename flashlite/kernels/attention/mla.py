"""Absorbed multi-head latent attention (DeepSeek-V2/V3) for decoding: every query head attends to
one shared latent cache, whose first ``D_LATENT`` columns are also the values.

With the key up-projection absorbed into the queries, head h's query is ``[q_nope ; q_pe]``
(``D_LATENT + D_ROPE`` = 512 + 64 columns) and the cache holds one row per token, ``[c ; k_pe]``:
the compressed latent ``c`` and the shared rotary key. Scores are ``q_nope·cᵀ + q_pe·k_peᵀ`` and
the output is ``P·c``, 512 columns (the value up-projection is applied by the model after).

:func:`_mla_decode_kernel` is the decode kernel's split-KV loop specialised to that shape:

* **All heads share one K/V head.** Program ``(row block, batch, chunk)`` packs ``BLOCK_H`` of
  the ``Nq·Hq`` query rows (query ``r // Hq``, head ``r % Hq``), so each latent tile read from
  HBM serves ``BLOCK_H`` heads at once.
* **The values are the keys' first columns.** One ``[BLOCK_N, D_LATENT]`` tile of ``c`` is
  loaded per step and used twice: in the scores (``q_nope·cᵀ``) and in ``acc += p·c``; the rotary
  part ``k_pe`` is a ``[BLOCK_N, D_ROPE]`` tile of the same rows. The cache is read once.
* **The scores in two products** (512 + 64 columns) keep every tile a power of two wide.

Partials merge exactly as :mod:`~flashlite.kernels.attention.decode`'s do (its combine kernel),
with the same online statistics (:mod:`flashlite.stats`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention.common import update
from flashlite.kernels.attention.decode_parts import kv_tile
from flashlite.kernels.common import cast
from flashlite.masking.masks import visible
from flashlite.stats import LOG2E, finalize_lse


@triton.jit
def _mla_scores(q_nope, q_pe, c, k_pe, DOT_FP32: tl.constexpr):
    """``q_nope·cᵀ + q_pe·k_peᵀ`` in fp32 (the interpreter's bf16 dots take fp32 operands)."""
    if DOT_FP32:
        c, k_pe = c.to(tl.float32), k_pe.to(tl.float32)
    qk = tl.dot(q_nope, tl.trans(c))
    return tl.dot(q_pe, tl.trans(k_pe), qk)


@triton.jit
def _mla_decode_kernel(
    Q, KV, O, LSE, SEQLENS_K, TABLE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, seq_q, seq_k, sm_scale, stride_tb, num_pages, split_len,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq·Hq, BLOCK_H), B, S)``: packed rows ``[pid0·BLOCK_H, +BLOCK_H)`` of batch
    b against keys ``[s·split_len, (s + 1)·split_len)`` of its first ``SEQLENS_K[b]`` (clamped
    to ``[0, seq_k]``).

    Q ``(B, Hq, Nq, D_LATENT + D_ROPE)``; KV the latent cache as a ``(B, 1, Ncap, D_LATENT +
    D_ROPE)`` view, or with ``PAGE_SIZE`` > 0 a paged one ``(num_pages, 1, PAGE_SIZE, ·)`` read
    through ``TABLE`` (:func:`~flashlite.kernels.attention.decode_parts.kv_tile`); O ``(S·B, Hq,
    Nq, D_LATENT)`` and the fp32 LSE ``(S·B·Hq, Nq)``: chunk s's partials at batch rows
    ``s·B + b`` (with ``S = 1`` the result itself, in O's dtype). ``IS_CAUSAL``: query i of Nq
    sees keys up to ``seq_k − Nq + i`` (the new tokens' own positions).
    """
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_mem = seq_q
    seq_k = tl.minimum(tl.maximum(tl.load(SEQLENS_K + b), 0), seq_k)
    rows = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos, head = rows // n_heads, rows % n_heads
    row_ok = rows < seq_q * n_heads
    offs_l, offs_r = tl.arange(0, D_LATENT), tl.arange(0, D_ROPE)
    q_at = (
        Q
        + b.to(tl.int64) * stride_qb
        + head.to(tl.int64)[:, None] * stride_qh
        + pos.to(tl.int64)[:, None] * stride_qm
    )
    q_nope = tl.load(q_at + offs_l[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_at + (D_LATENT + offs_r)[None, :] * stride_qd, mask=row_ok[:, None],
                   other=0.0)  # fmt: skip
    if DOT_FP32:
        q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)
    exp_scale = sm_scale * LOG2E
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LATENT], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_k)
    if IS_CAUSAL:  # the block's last query sees up to seq_k − Nq + its position
        last = tl.minimum((tl.program_id(0) * BLOCK_H + BLOCK_H - 1) // n_heads, seq_q - 1)
        hi = tl.minimum(hi, seq_k - seq_q + last + 1)
    strides = (stride_kb, stride_kh, stride_kn, stride_kd)
    pages = (TABLE, stride_tb, num_pages)
    latent: tl.constexpr = (PAGE_SIZE, D_LATENT, D_LATENT, BLOCK_N, False)
    rope: tl.constexpr = (PAGE_SIZE, D_ROPE, D_ROPE, BLOCK_N, False)
    offs_n = tl.arange(0, BLOCK_N)
    h0 = b * 0  # the one latent head (a tensor, as kv_tile's head index is)
    for start_n in tl.range(lo, hi, BLOCK_N):
        c = kv_tile(KV, strides, pages, b, h0, start_n, offs_n, offs_l, seq_k, True, latent)
        k_pe = kv_tile(KV + D_LATENT * stride_kd, strides, pages, b, h0, start_n, offs_n, offs_r,
                       seq_k, True, rope)  # fmt: skip
        qk = _mla_scores(q_nope, q_pe, c, k_pe, DOT_FP32)
        seen = visible(pos, start_n + offs_n, seq_q, seq_k, 0, 0, IS_CAUSAL, False)
        qk = tl.where(seen, qk, float("-inf"))
        m, s, alpha, p, _moved = update(m, s, qk, exp_scale, False)
        p = cast(p, c.dtype, ROUND_BF16)  # the values' precision, as the tensor cores take it
        if DOT_FP32:
            p, c = p.to(tl.float32), c.to(tl.float32)
        acc = tl.dot(p, c, acc * alpha[:, None])
    # rows that saw no key (a chunk past the length, a query before every key): 0, LSE −inf
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)
    part = split * tl.num_programs(1) + b  # batch row of the partials
    bh = part.to(tl.int64) * n_heads + head
    tl.store(LSE + bh * q_mem + pos, finalize_lse(m, s, exp_scale), mask=row_ok)
    o = cast(acc * inv_s[:, None], O.dtype.element_ty, ROUND_BF16)
    o_at = (
        O
        + part.to(tl.int64) * stride_ob
        + head.to(tl.int64)[:, None] * stride_oh
        + pos.to(tl.int64)[:, None] * stride_om
        + offs_l[None, :] * stride_od
    )
    tl.store(o_at, o, mask=row_ok[:, None])
