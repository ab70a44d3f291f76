"""Tiled attention forward (FlashAttention-2 loop order) on the shared (m, s) statistics.

One program owns ``BLOCK_M`` query rows of one (batch, head). It loads its Q block once, then
walks the key/value tiles of ``BLOCK_N`` keys, folding each tile of scores into the running pair
with :func:`flashlite.stats.online_update` — the very helper the row softmax uses — and rescaling
its fp32 output accumulator by the factor the update returns. The ``Nq × Nk`` score matrix never
leaves the chip. HBM traffic per program: its Q block once, one K and one V tile per visited key
tile, its O block and LSE once.

Causal attention is bottom-right aligned (query i sees key j iff ``j <= i + Nk − Nq``). The key
range splits in two loops: tiles every row of the block sees completely (no mask arithmetic) and
the diagonal/boundary tiles (masked); tiles above the diagonal are never visited.

Loads go through tensor descriptors (TMA on Hopper; out-of-bounds rows padded with zeros) when
the host finds the strides 16-byte aligned, else through plain masked pointer loads.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from flashlite.stats import LOG2E, finalize_lse, online_update

# ----------------------------------------------------------------------------- configs
#: (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize) tried by the GPU autotuner.
GPU_CONFIGS = [
    (128, 128, 8, 2, False),
    (128, 128, 8, 3, False),
    (128, 64, 8, 3, False),
    (128, 64, 4, 3, False),
    (128, 128, 8, 2, True),
    (128, 64, 4, 3, True),
    (64, 64, 4, 3, False),
    (64, 128, 4, 3, False),
]
#: The config the interpreter (CPU) runs: small tiles keep it quick; several tiles per sequence
#: in the tests exercise the loop bounds.
CPU_CONFIG = (16, 16, 4, 1, False)
#: ``FLASHLITE_ATTENTION_CONFIG="BM,BN,warps,stages,ws"`` pins one config (tests, benchmarks).
PIN_ENV = "FLASHLITE_ATTENTION_CONFIG"


def pinned_config() -> tuple[int, int, int, int, bool] | None:
    """The config pinned through the environment, if any."""
    text = os.environ.get(PIN_ENV)
    if not text:
        return None
    bm, bn, w, s, ws = (int(v) for v in text.split(","))
    return bm, bn, w, s, bool(ws)


def as_triton_config(cfg: tuple[int, int, int, int, bool]) -> triton.Config:
    bm, bn, w, s, ws = cfg
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": ws}, num_warps=w, num_stages=s
    )


def keep_config(cfg: tuple[int, int, int, int, bool], head_dim_pad: int, use_desc: bool) -> bool:
    """Filter configs that cannot win or cannot run for this shape."""
    bm, bn, w, s, ws = cfg
    if ws and not use_desc:  # warp specialisation pays with TMA loads only
        return False
    if head_dim_pad >= 256 and (bm * bn > 64 * 64 or s > 2):  # shared memory and registers
        return False
    return not (head_dim_pad <= 64 and bm * bn < 128 * 64 and w == 8)


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _load_tile(src, row0, n_rows, stride_row, stride_d, offs_r, offs_d,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr,
               CHECK_ROWS: tl.constexpr):  # fmt: skip
    """A ``[rows, BLOCK_D]`` tile starting at row ``row0``; zeros past the ends."""
    if USE_DESC:
        return src.load([row0, 0])
    rows = row0 + offs_r
    ptrs = src + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :] * stride_d
    mask = offs_d[None, :] < HEAD_DIM
    if CHECK_ROWS:
        mask = mask & (rows[:, None] < n_rows)
    if HEAD_DIM == BLOCK_D and not CHECK_ROWS:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _attend(acc, m, s, q, k_src, v_src, lo, hi, offs_m, offs_n, offs_d, seq_k, diag, qk_scale,
            stride_kn, stride_kd, stride_vn, stride_vd,
            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr,
            DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
            WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    """Fold key tiles ``[lo, hi)`` into ``(acc, m, s)``; ``MASKED`` tiles check key bounds and
    the causal diagonal (``diag = Nk − Nq``)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = _load_tile(k_src, start_n, seq_k, stride_kn, stride_kd, offs_n, offs_d, HEAD_DIM,
                       BLOCK_D, USE_DESC, MASKED)  # fmt: skip
        if DOT_FP32:
            k = k.to(tl.float32)
        # raw scores in fp32; the softmax scale is folded into online_update's exp2
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            cols = start_n + offs_n
            visible = cols[None, :] < seq_k
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(visible, qk, float("-inf"))
        m, s, alpha, p = online_update(m, s, qk, qk_scale)
        acc = acc * alpha[:, None]
        v = _load_tile(v_src, start_n, seq_k, stride_vn, stride_vd, offs_n, offs_d, HEAD_DIM,
                       BLOCK_D, USE_DESC, MASKED)  # fmt: skip
        p = p.to(v.dtype)  # tensor-core operands in the input precision, fp32 accumulation
        if DOT_FP32:  # the interpreter: bf16 values (p keeps its bf16 rounding), fp32 dot
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc, m, s


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    n_heads, group, seq_q, seq_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_DESC: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``. Writes O ``(B, Hq, Nq, D)`` and fp32 LSE ``(B·Hq, Nq)``."""
    n_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = n_m_blocks - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    h_kv = h // group  # GQA/MQA: query heads of a group share one K/V head, no copies
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    o_base = O + b * stride_ob + h * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_DESC:
        q_src = tl.make_tensor_descriptor(q_base, [seq_q, HEAD_DIM], [stride_qm, 1],
                                          [BLOCK_M, BLOCK_D])  # fmt: skip
        k_src = tl.make_tensor_descriptor(k_base, [seq_k, HEAD_DIM], [stride_kn, 1],
                                          [BLOCK_N, BLOCK_D])  # fmt: skip
        v_src = tl.make_tensor_descriptor(v_base, [seq_k, HEAD_DIM], [stride_vn, 1],
                                          [BLOCK_N, BLOCK_D])  # fmt: skip
    else:
        q_src, k_src, v_src = q_base, k_base, v_base

    q = _load_tile(q_src, start_m, seq_q, stride_qm, stride_qd, tl.arange(0, BLOCK_M), offs_d,
                   HEAD_DIM, BLOCK_D, USE_DESC, True)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key tiles [0, full_hi) are seen by every row of the block and lie inside the sequence;
    # [full_hi, hi) are the diagonal and boundary tiles. Causal: row i sees keys j <= i + diag.
    diag = seq_k - seq_q
    if IS_CAUSAL:
        first_row_sees = tl.minimum(tl.maximum(start_m + diag + 1, 0), seq_k)
        full_hi = (first_row_sees // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), seq_k)
    else:
        full_hi = (seq_k // BLOCK_N) * BLOCK_N
        hi = seq_k
    acc, m, s = _attend(acc, m, s, q, k_src, v_src, 0, full_hi, offs_m, offs_n, offs_d, seq_k,
                        diag, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, False,
                        IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, USE_DESC, DOT_FP32,
                        DOT_PRECISION, WARP_SPECIALIZE)  # fmt: skip
    acc, m, s = _attend(acc, m, s, q, k_src, v_src, full_hi, hi, offs_m, offs_n, offs_d, seq_k,
                        diag, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, True,
                        IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, USE_DESC, DOT_FP32,
                        DOT_PRECISION, False)  # fmt: skip

    # Rows that saw no key (causal with Nq > Nk) have s = 0: output 0 and LSE −inf, not NaN.
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)
    o = (acc * inv_s[:, None]).to(O.dtype.element_ty)
    lse = finalize_lse(m, s, qk_scale)
    tl.store(LSE + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)
    if USE_DESC:
        o_dst = tl.make_tensor_descriptor(o_base, [seq_q, HEAD_DIM], [stride_om, 1],
                                          [BLOCK_M, BLOCK_D])  # fmt: skip
        o_dst.store([start_m, 0], o)
    else:
        ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(ptrs, o, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))
