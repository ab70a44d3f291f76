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

Two loop variants, chosen per :class:`Config`, give the same result: lazy rescaling (the
accumulator is rescaled only on tiles that move a row's reference maximum) and the overlapped
loop of :func:`_attend_overlapped` (each tile's ``p·v`` runs on the tensor cores while the next
tile's softmax is computed).

Loads go through 4-D ``(B, H, N, D)`` tensor descriptors built on the host (TMA on Hopper;
out-of-bounds rows and columns padded with zeros) when the strides are 16-byte aligned, else
through plain masked pointer loads.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import triton
import triton.language as tl

from flashlite.stats import LOG2E, finalize_lse, online_update, online_update_lazy


# ----------------------------------------------------------------------------- configs
class Config(NamedTuple):
    """One launch config: tile sizes, Triton's ``num_warps``/``num_stages``, and the loop
    variants (all give the same results; which is fastest depends on the tile and head dim)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: ``tl.range(warp_specialize=True)`` on the unmasked loop (TMA loads only)
    warp_specialize: bool = False
    #: rescale the accumulator only on tiles that move a row's reference maximum
    lazy_rescale: bool = False
    #: leave each tile's ``p·v`` running on the tensor cores under the next tile's softmax
    overlap: bool = False

    def constexprs(self) -> dict[str, object]:
        """The kernel constexprs this config sets (warps and stages are launch options)."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "WARP_SPECIALIZE": self.warp_specialize, "LAZY_RESCALE": self.lazy_rescale,
                "OVERLAP": self.overlap}  # fmt: skip

    @classmethod
    def of(cls, c: triton.Config) -> Config:
        """The config an autotuner's ``triton.Config`` (from :func:`as_triton_config`) holds."""
        kw = c.kwargs
        return cls(kw["BLOCK_M"], kw["BLOCK_N"], c.num_warps, c.num_stages,
                   kw["WARP_SPECIALIZE"], kw["LAZY_RESCALE"], kw["OVERLAP"])  # fmt: skip


#: Configs the GPU autotuner tries for shapes without a measured entry below; ``keep_config``
#: drops the ones that cannot fit a shape. The last ones are small fallbacks for fp32 and head
#: dims up to 256. Warp specialisation is supported but left out: with Triton 3.6 on the H200 it
#: was no faster than the same config without it, and two such configs crashed the compiler.
GPU_CONFIGS = [
    Config(128, 128, 8, 3, lazy_rescale=True),
    Config(128, 128, 8, 2, lazy_rescale=True),
    Config(128, 64, 4, 3),
    Config(64, 64, 4, 2, overlap=True),
    Config(64, 64, 4, 3),
    Config(64, 128, 4, 2, overlap=True),
    Config(64, 64, 4, 2),
    Config(64, 32, 4, 2),
]
#: The config Hopper (sm_90) runs for 16-bit inputs at these ``(BLOCK_D, causal)``, without
#: autotuning: the fastest in three sweeps on an H200 (bf16, B·N = 16k tokens, N = 4k and
#: 16k; ``benchmarks/NOTES.md``). Autotuning over ``GPU_CONFIGS`` picks between configs a few
#: percent apart from one timing each, so its choice moved between runs; a table does not.
HOPPER_CONFIGS = {
    (64, False): Config(128, 64, 4, 3),
    (64, True): Config(64, 64, 4, 3),
    (128, False): Config(64, 64, 4, 2, overlap=True),
    (128, True): Config(64, 64, 4, 2, overlap=True),
}
#: The config the interpreter (CPU) runs: small tiles keep it quick; several tiles per sequence
#: in the tests exercise the loop bounds.
CPU_CONFIG = Config(16, 16, 4, 1)
#: ``FLASHLITE_ATTENTION_CONFIG="BM,BN,warps,stages[,ws[,lazy[,overlap]]]"`` (0/1 flags) pins
#: one config (tests, benchmarks).
PIN_ENV = "FLASHLITE_ATTENTION_CONFIG"
#: Shared memory a config may plan for (Hopper gives a block 227 KB).
SMEM_BUDGET = 224 * 1024


def pinned_config() -> Config | None:
    """The config pinned through the environment, if any."""
    text = os.environ.get(PIN_ENV)
    if not text:
        return None
    fields = [int(v) for v in text.split(",")]
    if not 4 <= len(fields) <= 7:
        raise ValueError(
            f"{PIN_ENV}={text!r}: expected 4 to 7 comma-separated integers "
            "BM,BN,warps,stages[,ws[,lazy[,overlap]]]"
        )
    bm, bn, w, s, *flags = fields
    return Config(bm, bn, w, s, *(bool(f) for f in flags))


def as_triton_config(cfg: Config, pre_hook: object = None) -> triton.Config:
    return triton.Config(
        cfg.constexprs(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, pre_hook=pre_hook
    )


def set_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: give the host descriptors the block shape of the config being run."""
    if not nargs["USE_DESC"]:
        return
    bm, bn, bd = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
    nargs["Q"].block_shape = nargs["O"].block_shape = [1, 1, bm, bd]
    nargs["K"].block_shape = nargs["V"].block_shape = [1, 1, bn, bd]


def keep_config(cfg: Config, block_d: int, elem_bytes: int, use_desc: bool) -> bool:
    """Whether a config fits this shape: ``stages`` K and V tiles (plus room for Q) in shared
    memory, the fp32 accumulator and score tile in registers; warp specialisation only with TMA
    loads. fp32 counts double: its three-pass TF32 dots keep split copies of the operands (the
    H200 refused fp32 configs this estimate now rejects). The overlapped loop loads one more K
    and V tile outside the pipelined loop (its first scores and last values)."""
    if cfg.warp_specialize and not use_desc:
        return False
    elem = 2 * elem_bytes if elem_bytes >= 4 else elem_bytes
    kv_tiles = 2 * cfg.num_stages + (2 if cfg.overlap else 0)
    smem = (kv_tiles * cfg.block_n + cfg.block_m) * block_d * elem
    threads = 32 * cfg.num_warps
    return (
        smem <= SMEM_BUDGET
        and cfg.block_m * block_d <= 128 * threads
        and cfg.block_m * cfg.block_n <= 64 * threads
    )


def default_config(block_d: int, elem_bytes: int, use_desc: bool) -> Config:
    """The first config that fits: what runs when nothing is tuned or pinned."""
    for cfg in GPU_CONFIGS:
        if keep_config(cfg, block_d, elem_bytes, use_desc):
            return cfg
    return Config(32, 32, 4, 1)


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _load_tile(src, b, h, row0, n_rows, stride_row, stride_d, offs_r, offs_d,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr,
               CHECK_ROWS: tl.constexpr):  # fmt: skip
    """A ``[rows, BLOCK_D]`` tile of head (b, h) starting at row ``row0``; zeros past the ends.

    ``src`` is a 4-D ``(B, H, N, D)`` tensor descriptor (TMA; it pads out-of-bounds rows and
    columns itself) or a pointer already offset to head (b, h).
    """
    # (one return at the end: the compiler builds both arms of a constexpr `if` otherwise)
    if USE_DESC:
        tile = src.load([b, h, row0, 0]).reshape(offs_r.shape[0], BLOCK_D)
    else:
        rows = row0 + offs_r
        ptrs = src + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :] * stride_d
        if HEAD_DIM == BLOCK_D and not CHECK_ROWS:
            tile = tl.load(ptrs)
        else:
            mask = offs_d[None, :] < HEAD_DIM
            if CHECK_ROWS:
                mask = mask & (rows[:, None] < n_rows)
            tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _scores(q, k_src, b, h_kv, start_n, offs_m, offs_n, offs_d, seq_k, diag, stride_kn, stride_kd,
            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr, DOT_FP32: tl.constexpr,
            DOT_PRECISION: tl.constexpr):  # fmt: skip
    """fp32 scores ``q·kᵀ`` of the key tile at ``start_n``; ``MASKED`` tiles get −inf past the
    sequence end and above the causal diagonal (``diag = Nk − Nq``)."""
    k = _load_tile(k_src, b, h_kv, start_n, seq_k, stride_kn, stride_kd, offs_n, offs_d,
                   HEAD_DIM, BLOCK_D, USE_DESC, MASKED)  # fmt: skip
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        cols = start_n + offs_n
        visible = cols[None, :] < seq_k
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
        qk = tl.where(visible, qk, float("-inf"))
    return qk


@triton.jit
def _update(m, s, qk, exp_scale, LAZY_RESCALE: tl.constexpr):
    """Fold a score tile into ``(m, s)``: ``(m, s, alpha, p, moved)``; the accumulator needs
    ``acc·alpha`` only where ``moved`` (always, unless the reference moves lazily)."""
    if LAZY_RESCALE:  # the reference moves only when a row's maximum grows by a factor > 2^8
        m, s, alpha, p, moved = online_update_lazy(m, s, qk, exp_scale, 8.0)
    else:
        m, s, alpha, p = online_update(m, s, qk, exp_scale)
        moved = True
    return m, s, alpha, p, moved


@triton.jit
def _accumulate(acc, alpha, moved, p, v_src, b, h_kv, start_n, seq_k, stride_vn, stride_vd,
                offs_n, offs_d, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr, DOT_FP32: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """``acc·alpha + p·v`` for the value tile at ``start_n`` (the multiply only where
    :func:`_update` says the reference ``moved``)."""
    if moved:
        acc = acc * alpha[:, None]
    v = _load_tile(v_src, b, h_kv, start_n, seq_k, stride_vn, stride_vd, offs_n, offs_d,
                   HEAD_DIM, BLOCK_D, USE_DESC, MASKED)  # fmt: skip
    p = p.to(v.dtype)  # tensor-core operands in the input precision, fp32 accumulation
    if DOT_FP32:  # the interpreter: bf16 values (p keeps its bf16 rounding), fp32 dot
        p, v = p.to(tl.float32), v.to(tl.float32)
    return tl.dot(p, v, acc, input_precision=DOT_PRECISION)


@triton.jit
def _attend(acc, m, s, q, k_src, v_src, b, h_kv, lo, hi, offs_m, offs_n, offs_d, seq_k, diag,
            exp_scale, stride_kn, stride_kd, stride_vn, stride_vd,
            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr,
            DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr,
            WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    """Fold key tiles ``[lo, hi)`` into ``(acc, m, s)``, one tile after the other: scores,
    statistics, ``acc = acc·alpha + p·v``."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        qk = _scores(q, k_src, b, h_kv, start_n, offs_m, offs_n, offs_d, seq_k, diag, stride_kn,
                     stride_kd, MASKED, IS_CAUSAL, HEAD_DIM, BLOCK_D, USE_DESC, DOT_FP32,
                     DOT_PRECISION)  # fmt: skip
        m, s, alpha, p, moved = _update(m, s, qk, exp_scale, LAZY_RESCALE)
        acc = _accumulate(acc, alpha, moved, p, v_src, b, h_kv, start_n, seq_k, stride_vn,
                          stride_vd, offs_n, offs_d, MASKED, HEAD_DIM, BLOCK_D, USE_DESC,
                          DOT_FP32, DOT_PRECISION)  # fmt: skip
    return acc, m, s


@triton.jit
def _attend_overlapped(acc, m, s, q, k_src, v_src, b, h_kv, lo, hi, offs_m, offs_n, offs_d,
                       seq_k, diag, exp_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_DESC: tl.constexpr, DOT_FP32: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr):  # fmt: skip
    """:func:`_attend` over unmasked tiles ``[lo, hi)`` (``hi > lo``), reordered so that the
    tensor cores work while the statistics are computed: the loop computes tile j's softmax,
    then tile j+1's scores, then issues tile j's ``p·v`` and moves on without waiting for it, so
    that product runs under tile j+1's softmax. Same arithmetic, same order of accumulation."""
    qk = _scores(q, k_src, b, h_kv, lo, offs_m, offs_n, offs_d, seq_k, diag, stride_kn,
                 stride_kd, False, False, HEAD_DIM, BLOCK_D, USE_DESC, DOT_FP32,
                 DOT_PRECISION)  # fmt: skip
    for start_n in tl.range(lo, hi - BLOCK_N, BLOCK_N):
        m, s, alpha, p, moved = _update(m, s, qk, exp_scale, LAZY_RESCALE)
        # the next scores; Triton waits for this dot (and the p·v still running) right here
        qk = _scores(q, k_src, b, h_kv, start_n + BLOCK_N, offs_m, offs_n, offs_d, seq_k, diag,
                     stride_kn, stride_kd, False, False, HEAD_DIM, BLOCK_D, USE_DESC, DOT_FP32,
                     DOT_PRECISION)  # fmt: skip
        # the rescale reads acc after that wait; the product is left in flight: only the next
        # iteration's score dot waits for it
        acc = _accumulate(acc, alpha, moved, p, v_src, b, h_kv, start_n, seq_k, stride_vn,
                          stride_vd, offs_n, offs_d, False, HEAD_DIM, BLOCK_D, USE_DESC,
                          DOT_FP32, DOT_PRECISION)  # fmt: skip
    m, s, alpha, p, moved = _update(m, s, qk, exp_scale, LAZY_RESCALE)
    acc = _accumulate(acc, alpha, moved, p, v_src, b, h_kv, hi - BLOCK_N, seq_k, stride_vn,
                      stride_vd, offs_n, offs_d, False, HEAD_DIM, BLOCK_D, USE_DESC, DOT_FP32,
                      DOT_PRECISION)  # fmt: skip
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
    IS_CAUSAL: tl.constexpr, USE_DESC: tl.constexpr, PRESCALE_Q: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    OVERLAP: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``. Writes O ``(B, Hq, Nq, D)`` and fp32 LSE ``(B·Hq, Nq)``.

    Q, K, V, O are 4-D tensor descriptors when ``USE_DESC``, else tensors read through strides.
    """
    n_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = n_m_blocks - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    h_kv = h // group  # GQA/MQA: query heads of a group share one K/V head, no copies
    if USE_DESC:
        q_src, k_src, v_src = Q, K, V
    else:
        q_src = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        k_src = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
        v_src = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(q_src, b, h, start_m, seq_q, stride_qm, stride_qd, tl.arange(0, BLOCK_M),
                   offs_d, HEAD_DIM, BLOCK_D, USE_DESC, True)  # fmt: skip
    qk_scale = sm_scale * LOG2E
    if PRESCALE_Q:
        # Fold sm_scale·log2(e) into Q once per block: the scores arrive in exp2's units and
        # the update's exponent is one subtraction per score instead of a subtract and a
        # multiply. Costs one rounding of Q·scale to the input dtype.
        q = (q * qk_scale).to(q.dtype)
        exp_scale: tl.constexpr = 1.0
    else:
        exp_scale = qk_scale
    if DOT_FP32:
        q = q.to(tl.float32)
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
    if OVERLAP:
        if full_hi > 0:
            acc, m, s = _attend_overlapped(acc, m, s, q, k_src, v_src, b, h_kv, 0, full_hi,
                                           offs_m, offs_n, offs_d, seq_k, diag, exp_scale,
                                           stride_kn, stride_kd, stride_vn, stride_vd, HEAD_DIM,
                                           BLOCK_D, BLOCK_N, USE_DESC, DOT_FP32, DOT_PRECISION,
                                           LAZY_RESCALE)  # fmt: skip
    else:
        acc, m, s = _attend(acc, m, s, q, k_src, v_src, b, h_kv, 0, full_hi, offs_m, offs_n,
                            offs_d, seq_k, diag, exp_scale, stride_kn, stride_kd, stride_vn,
                            stride_vd, False, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, USE_DESC,
                            DOT_FP32, DOT_PRECISION, LAZY_RESCALE,
                            WARP_SPECIALIZE)  # fmt: skip
    acc, m, s = _attend(acc, m, s, q, k_src, v_src, b, h_kv, full_hi, hi, offs_m, offs_n,
                        offs_d, seq_k, diag, exp_scale, stride_kn, stride_kd, stride_vn,
                        stride_vd, True, IS_CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, USE_DESC,
                        DOT_FP32, DOT_PRECISION, LAZY_RESCALE, False)  # fmt: skip

    # Rows that saw no key (causal with Nq > Nk) have s = 0: output 0 and LSE −inf, not NaN.
    inv_s = tl.where(s > 0.0, 1.0 / s, 0.0)
    lse = finalize_lse(m, s, exp_scale)
    tl.store(LSE + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)
    if USE_DESC:
        o = (acc * inv_s[:, None]).to(O.dtype)
        O.store([b, h, start_m, 0], o.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o = (acc * inv_s[:, None]).to(O.dtype.element_ty)
        o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(ptrs, o, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))
