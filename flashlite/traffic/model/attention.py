"""Attention's bytes, forward and backward: the compulsory floor, the naive reference's ops,
flashlite's kernels (Q once, K and V once per query block), and their DRAM estimates."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import triton

from flashlite.masking import masks
from flashlite.ops.attention import BwdConfig, Config, block_d, bwd_tiles, smem_bytes
from flashlite.traffic.model.common import (
    DEFAULT_L2_BYTES,
    GPUS,
    effective_l2,
    flashlite_config,
    written_back,
)
from flashlite.traffic.shapes import (
    ATTENTION_METHODS,
    DESCALE_BYTES,
    AttentionShape,
    Traffic,
)


def l2_note(shape: AttentionShape, l2_bytes: int | None = None) -> str | None:
    """A warning when the call's data fits in L2, where DRAM counters understate traffic."""
    if l2_bytes is None:
        l2_bytes = DEFAULT_L2_BYTES
        if torch.cuda.is_available():
            l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    data = compulsory_attention(shape).total
    if data <= l2_bytes:
        return (
            f"Q, K, V and O ({data / 1e6:.1f} MB) fit in L2 ({l2_bytes / 1e6:.0f} MB): "
            "measured DRAM bytes are misleading for this shape (writes can stay in L2, "
            "re-reads hit it)"
        )
    return None


def compulsory_attention(shape: AttentionShape) -> Traffic:
    """Bytes no attention implementation can avoid: Q, K, V read once and O written once (FP8:
    the three descale factors read once, O in bf16)."""
    b, t = shape.itemsize, Traffic()
    rows = shape.batch * shape.heads * shape.seq_q
    keys = shape.batch * shape.hkv * shape.nk
    t.add("q", rows * shape.head_dim * b, 0)
    t.add("k", keys * shape.head_dim * b, 0)
    t.add("v", keys * shape.dv * b, 0)
    if shape.fp8:
        t.add("descales", DESCALE_BYTES, 0)
    t.add("o", 0, rows * shape.dv * shape.out_itemsize)
    return t


def model_naive_attention(shape: AttentionShape, *, return_lse: bool = False) -> Traffic:
    """Bytes of :func:`flashlite.reference.attention` (``upcast=False``), op by op.

    Each op reads its tensor inputs once and writes its output once. With ``S`` the
    ``B·H·Nq·Nk`` score elements, ``b`` the element size and ``G = H / Hkv``:

    ==============  ===============================  ==============================
    op              read                             write
    ==============  ===============================  ==============================
    expand K, V     ``B·Hkv·Nk·D·b`` each (G > 1)    ``B·H·Nk·D·b`` each
    S = Q Kᵀ        ``Q + K'``                       ``S·b``
    S·scale         ``S·b``                          ``S·b``
    causal mask     int64 aranges (tiny)             ``Nq·Nk`` bools (+ tiny)
    where (mask)    ``S·b + Nq·Nk``                  ``S·b``
    softmax         ``S·b``                          ``S·b``
    nan_to_num      ``S·b`` (causal only)            ``S·b``
    O = P V         ``S·b + V'``                     ``O``
    ==============  ===============================  ==============================

    ``K' = K`` without GQA; with GQA ``torch.matmul`` broadcasts K and V over the group and its
    reshape of the broadcast view copies them (unless ``B·Hkv = 1``, where it stays a view), so
    the matmuls read the ``G``-fold copies. FP8 inputs: torch has no FP8 attention, so the
    naive path widens q, k and v to bf16 first (``x.to(torch.bfloat16)``: read 1 byte, write 2
    per element; the factors of one per tensor folded into the scale) and runs in bf16.
    """
    if shape.fp8:
        return _widened_naive(shape, return_lse)
    b = shape.itemsize
    B, H, Hkv, Nq, Nk, D = (
        shape.batch,
        shape.heads,
        shape.hkv,
        shape.seq_q,
        shape.nk,
        shape.head_dim,
    )
    q = B * H * Nq * D * b
    kv = B * Hkv * Nk * D * b
    v = B * Hkv * Nk * shape.dv * b  # (V's own head dim, where it has one)
    s = B * H * Nq * Nk * b
    t = Traffic()
    kv_read, v_read = kv, v
    # torch.matmul folds (B, Hkv, G) into one batch dim; with a broadcast G that is a view only
    # when B·Hkv == 1, otherwise its reshape copies K and V G-fold first
    if Hkv != H and B * Hkv > 1:
        kv_read, v_read = kv * (H // Hkv), v * (H // Hkv)
        t.add("expand k", kv, kv_read)
        t.add("expand v", v, v_read)
    t.add("S = Q K^T", q + kv_read, s)
    t.add("S * scale", s, s)
    if shape.causal:
        i64 = 8
        # arange(Nq), arange(Nk), i + (Nk - Nq), j > i + (Nk - Nq)
        t.add("causal mask", i64 * (Nq + Nk + Nq), i64 * (Nq + Nk + Nq) + Nq * Nk)
        t.add("where (mask)", s + Nq * Nk, s)
    t.add("softmax", s, s)
    if shape.causal:
        t.add("nan_to_num", s, s)
    t.add("O = P V", s + v_read, B * H * Nq * shape.dv * b)
    if return_lse:
        s32 = B * H * Nq * Nk * 4
        if b != 4:
            t.add("S.float()", s, s32)
        t.add("logsumexp", s32, B * H * Nq * 4)
    return t


def _widened_naive(shape: AttentionShape, return_lse: bool) -> Traffic:
    """:func:`model_naive_attention` of FP8 inputs: q, k, v widened to bf16, then bf16's."""
    q = shape.batch * shape.heads * shape.seq_q * shape.head_dim
    kv = shape.batch * shape.hkv * shape.nk * shape.head_dim
    t = Traffic()
    for name, n in (("q", q), ("k", kv), ("v", kv)):
        t.add(f"{name}.to(bf16)", n, 2 * n)
    bf16 = model_naive_attention(replace(shape, dtype=torch.bfloat16), return_lse=return_lse)
    for name, (read, write) in bf16.parts.items():
        t.add(name, read, write)
    return t


def model_flashlite_attention(
    shape: AttentionShape, block_m: int | None = None, block_n: int | None = None
) -> Traffic:
    """Bytes the flashlite forward kernel issues, with its real ``BLOCK_M × BLOCK_N`` tiles.

    One program per (query block, batch·head): Q block loaded once, then K and V tiles of
    ``BLOCK_N`` keys — all ``⌈Nk/BLOCK_N⌉`` tiles, or when causal the tiles up to the last key the
    block's last row sees — then O and the fp32 LSE stored once. Lanes past ``Nq`` / ``Nk`` are
    masked and not counted, so for ``n_m = ⌈Nq/BLOCK_M⌉`` query blocks::

        read  = B·H·(Nq·D·b + 2·D·b·Σ_blocks keys_loaded(block))
        write = B·H·Nq·(D·b + 4)

    with ``keys_loaded = Nk`` without a mask and ``min(Nk, BLOCK_N·⌈vis/BLOCK_N⌉)`` causal, ``vis``
    the keys visible to the block's last row. Each query head reads its KV head's tiles itself,
    so GQA does not reduce the K/V term (only the compulsory bytes). FP8: ``b`` = 1, O in bf16,
    and each program reads its three descale factors (12 bytes).
    """
    if block_m is None or block_n is None:
        cfg = flashlite_config(shape)
        block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    b = shape.itemsize
    B, H, Nq, Nk, D, Dv = shape.batch, shape.heads, shape.seq_q, shape.nk, shape.head_dim, shape.dv
    keys = 0
    for m0 in range(0, Nq, block_m):
        # the kernel's own key range: tiles [0, hi) step BLOCK_N, lanes past Nk masked
        hi = masks.torch_key_range(m0, block_m, block_n, Nq, Nk, shape.mask)[3]
        keys += min(Nk, block_n * triton.cdiv(hi, block_n))
    bh = B * H
    t = Traffic()
    t.add("q", bh * Nq * D * b, 0)
    t.add("k", bh * keys * D * b, 0)
    t.add("v", bh * keys * Dv * b, 0)
    if shape.fp8:
        t.add("descales", bh * triton.cdiv(Nq, block_m) * DESCALE_BYTES, 0)
    t.add("o", 0, bh * Nq * Dv * shape.out_itemsize)
    t.add("lse", 0, bh * Nq * 4)
    return t


def model_attention(method: str, shape: AttentionShape, **config: int) -> Traffic | None:
    """Model bytes of ``method`` (``naive`` or ``flashlite``); None for the sdpa-* methods."""
    if method == "naive":
        return model_naive_attention(shape)
    if method == "flashlite":
        return model_flashlite_attention(shape, config.get("BLOCK_M"), config.get("BLOCK_N"))
    if method in ATTENTION_METHODS:
        return None
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def dram_naive_attention(
    shape: AttentionShape, *, gpu: str = "h200", l2_bytes: int | None = None
) -> Traffic:
    """DRAM bytes of naive attention: each op of :func:`model_naive_attention` is one kernel that
    reads its inputs once from a cold L2 and writes back what does not stay dirty in L2."""
    l2 = effective_l2(gpu, l2_bytes)
    t = Traffic()
    for name, (read, write) in model_naive_attention(shape).parts.items():
        t.add(name, read, written_back(read, write, l2))
    return t


def dram_flashlite_attention(
    shape: AttentionShape,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    num_warps: int = 4,
    num_stages: int = 2,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> Traffic:
    """DRAM bytes of the flashlite kernel, one launch from a cold L2.

    The grid runs the query blocks of one head next to each other (axis 0 is the block), and
    the ``P`` programs in flight (SMs × programs per SM, from the tile's shared memory and warps)
    start together and sweep the same K/V tiles at about the same pace, so within a wave every
    re-read of a tile hits L2. A head's ``n_m = ⌈Nq / BLOCK_M⌉`` query blocks take
    ``⌈n_m / P⌉`` waves; a later wave re-reads the head's K/V from L2 if the K/V of the heads in
    flight (``⌈P / n_m⌉`` heads, ``⌈that / G⌉`` K/V heads with GQA groups of ``G``) fit in L2
    beside the programs' Q and O tiles, else from DRAM once more per wave. Q is read once; O and
    the LSE are written back as :func:`written_back` says.
    """
    if block_m is None or block_n is None:
        cfg = flashlite_config(shape, gpu=gpu)
        block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
        num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    issued = model_flashlite_attention(shape, block_m, block_n)
    device, l2 = GPUS[gpu], effective_l2(gpu, l2_bytes)
    smem = smem_bytes(
        Config(block_m, block_n, num_warps, num_stages), block_d(shape.head_dim), shape.itemsize
    )
    b = shape.itemsize
    per_sm = max(1, min(device.smem_per_sm // max(smem, 1), 64 // num_warps))
    programs = device.sms * per_sm
    n_m = triton.cdiv(shape.seq_q, block_m)
    heads = min(shape.batch * shape.heads, triton.cdiv(programs, n_m))
    kv_heads = triton.cdiv(heads, shape.heads // shape.hkv)
    working_set = kv_heads * 2 * shape.nk * shape.head_dim * b
    working_set += programs * 2 * block_m * shape.head_dim * b  # Q and O tiles in flight
    waves = 1 if working_set <= l2 else triton.cdiv(n_m, programs)
    comp = compulsory_attention(shape)
    t = Traffic(
        info={
            "programs_in_flight": programs,
            "kv_working_set": working_set,
            "kv_reads_per_head": waves,
        }
    )
    t.add("q", issued.parts["q"][0], 0)
    for name in ("k", "v"):  # never more than the kernel issues
        t.add(name, min(waves * comp.parts[name][0], issued.parts[name][0]), 0)
    if shape.fp8:  # (every program reads the same 12 bytes: L2 serves all but the first)
        t.add("descales", comp.parts["descales"][0], 0)

    write = issued.parts["o"][1] + issued.parts["lse"][1]
    t.add("o + lse", 0, written_back(t.read, write, l2))
    return t


def dram_flashlite_attention_bwd(
    shape: AttentionShape,
    *,
    with_lse_grad: bool = False,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> Traffic:
    """DRAM bytes of the three backward kernels, each from a cold L2 (as ncu measures them).

    Each kernel reads every operand it issues once from DRAM: the dK/dV programs of a K/V head
    sweep its query rows (Qs, dO, LSE, delta) together and the dQ programs its K/V, so, as in the
    forward's first wave, the re-reads hit L2 (true at the measured sizes: a K/V head's working
    set of one wave is a few MB). Writes as :func:`written_back`. With ``b`` the element size:
    preprocess reads O, dO (and Q for 16-bit inputs) and writes delta (and Qs); dK/dV reads K, V
    once and Qs, dO, LSE, delta once per query head; dQ the same; they write dK, dV and dQ.
    """
    l2 = effective_l2(gpu, l2_bytes)
    issued = model_flashlite_attention_bwd(shape, with_lse_grad=with_lse_grad)
    b, D = shape.itemsize, shape.head_dim
    rows, kv = shape.batch * shape.heads * shape.seq_q, shape.batch * shape.hkv * shape.nk
    per_query = rows * (2 * D * b + 8)  # Qs (or Q), dO, LSE, delta
    t = Traffic()
    pre_r = sum(issued.parts[k][0] for k in issued.parts if k.startswith("preprocess"))
    pre_w = sum(issued.parts[k][1] for k in issued.parts if k.startswith("preprocess"))
    for name, read, write in (
        ("preprocess", pre_r, pre_w),
        ("dk/dv", 2 * kv * D * b + per_query, 2 * kv * D * b),
        ("dq", 2 * kv * D * b + per_query, rows * D * b),
    ):
        t.add(name, read, written_back(read, write, l2))
    return t


def dram_attention(
    method: str,
    shape: AttentionShape,
    *,
    gpu: str = "h200",
    l2_bytes: int | None = None,
    **config: Any,
) -> Traffic | None:
    """DRAM estimate of ``method`` (``naive`` or ``flashlite``); None for the sdpa-* methods."""
    if method == "naive":
        return dram_naive_attention(shape, gpu=gpu, l2_bytes=l2_bytes)
    if method == "flashlite":
        extra = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
        return dram_flashlite_attention(
            shape, config.get("BLOCK_M"), config.get("BLOCK_N"), gpu=gpu, l2_bytes=l2_bytes, **extra
        )
    if method in ATTENTION_METHODS:
        return None
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


# =============================================================================== backward
def compulsory_attention_bwd(shape: AttentionShape) -> Traffic:
    """Read Q, K, V, O, dO (and the LSE) once; write dQ, dK, dV once."""
    if shape.fp8:
        raise ValueError("FP8 attention is forward only: no backward traffic to model")
    b = shape.itemsize
    q = shape.batch * shape.heads * shape.seq_q * shape.head_dim * b
    kv = shape.batch * shape.hkv * shape.nk * shape.head_dim * b
    t = Traffic()
    t.add("q, o, dO", 3 * q, 0)
    t.add("k, v", 2 * kv, 0)
    t.add("lse", shape.batch * shape.heads * shape.seq_q * 4, 0)
    t.add("dq", 0, q)
    t.add("dk, dv", 0, 2 * kv)
    return t


def counted_bwd_config(shape: AttentionShape) -> BwdConfig:
    """The backward config the model and the count use: the H200's for this shape."""
    return bwd_tiles(shape.itemsize, shape.head_dim, shape.causal, (9, 0))


def model_flashlite_attention_bwd(
    shape: AttentionShape,
    config: BwdConfig | None = None,
    *,
    with_lse_grad: bool = False,
) -> Traffic:
    """Bytes the three backward kernels issue (in-bounds lanes only, as they are counted).

    With ``b`` the element size, per (batch, head) and the fp32 statistics at 4 bytes a row:

    * preprocess: read O and dO (``Nq·D·b`` each) and dlse if given; write delta (``4·Nq``);
      for 16-bit inputs also read Q and write Qs, the prescaled Q (``Nq·D·b`` each);
    * dK/dV, per block of ``kv_block_n`` keys of a K/V head: read its K and V tiles once, then
      for each of the ``G`` query heads of its group the ``Nq − lo`` query rows that can see it
      (``lo`` from :func:`flashlite.masks.torch_query_range`): Qs (Q for fp32) and dO (``D·b``
      a row) and LSE and delta (4 bytes each); write the dK and dV tiles;
    * dQ, per block of ``q_block_m`` query rows: read Qs, dO, LSE, delta once and the K and V
      tiles up to the forward's ``hi`` (:func:`flashlite.masks.torch_key_range`); write dQ.
    """
    if shape.fp8:
        raise ValueError("FP8 attention is forward only: no backward traffic to model")
    cfg = config or counted_bwd_config(shape)
    b, D = shape.itemsize, shape.head_dim
    B, H, Hkv, Nq, Nk = shape.batch, shape.heads, shape.hkv, shape.seq_q, shape.nk
    G = H // Hkv
    t = Traffic(info=bwd_info(cfg))
    rows = B * H * Nq
    t.add("preprocess", 2 * rows * D * b + (4 * rows if with_lse_grad else 0), 4 * rows)
    if b < 4:
        t.add("preprocess: q -> qs", rows * D * b, rows * D * b)
    q_rows = 0  # query rows the dK/dV programs of one K/V head read, over its key blocks
    for n0 in range(0, Nk, cfg.kv_block_n):
        lo = masks.torch_query_range(n0, cfg.kv_block_m, cfg.kv_block_n, Nq, Nk, shape.mask)[0]
        q_rows += Nq - lo
    t.add("dk/dv: k, v", 2 * B * Hkv * Nk * D * b, 0)
    t.add("dk/dv: q, dO, lse, delta", B * Hkv * G * q_rows * (2 * D * b + 8), 0)
    t.add("dk/dv: dk, dv", 0, 2 * B * Hkv * Nk * D * b)
    keys = 0  # keys each query head's dQ programs read
    bm, bn = cfg.q_block_m, cfg.q_block_n
    for m0 in range(0, Nq, bm):
        hi = masks.torch_key_range(m0, bm, bn, Nq, Nk, shape.mask)[3]
        keys += min(Nk, bn * triton.cdiv(hi, bn))
    t.add("dq: q, dO, lse, delta", rows * (2 * D * b + 8), 0)
    t.add("dq: k, v", B * H * keys * 2 * D * b, 0)
    t.add("dq: dq", 0, rows * D * b)
    return t


def bwd_info(cfg: BwdConfig) -> dict[str, object]:
    """How a table or JSON names a backward config."""
    return {
        "config": f"dkdv {cfg.kv_block_m}x{cfg.kv_block_n}, dq {cfg.q_block_m}x{cfg.q_block_n}",
        **cfg._asdict(),
    }
