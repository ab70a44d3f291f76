"""Attention forward for Hopper (sm_90) in Gluon: warp-specialised, FlashAttention-3's schedule.

Triton's ``tl.dot`` leaves the scheduling of the tensor cores to its compiler. On the H200 its
128-row tiles (two warpgroups) ran slower than 64-row ones, and a Gluon loop without warp
specialisation showed a likely reason: the compiler puts a CTA-wide barrier before every load
issue and barrier wait, so the two warpgroups run in step and neither hides its softmax under
the other's products (``benchmarks/NOTES.md``). Gluon, Triton's lower-level dialect, states the
schedule explicitly. One program owns ``BLOCK_M = 128`` query rows
of one (batch, head) and runs three partitions:

* a **producer** warp issues every load as a TMA bulk copy: the two 64-row halves of Q once,
  then the K and V tiles of ``BLOCK_N`` keys into a ring of ``STAGES`` shared-memory slots. Each
  slot has a *ready* barrier (the copy engine signals the bytes landed) and an *empty* barrier
  (both consumers signal they are done with it) — the only synchronisation there is;
* two **consumer** warpgroups of 4 warps, one per 64-row half, each running the online softmax
  on its rows independently of the other, so that one's softmax overlaps the other's products.
  Within a warpgroup the loop keeps the tensor cores busy too: tile j+1's scores ``S = Q·Kᵀ``
  and tile j's ``P·V`` are issued together, tile j+1's softmax runs while ``P·V`` finishes,
  and only then is the new ``P`` written over the registers the product read.

The statistics are :mod:`flashlite.stats`'s pair: ``(m, s)`` with ``m`` the running maximum
and ``s = Σ 2^(x − m)``. Gluon cannot call the stats module's ``@triton.jit`` helpers, so the
kernel calls their Gluon twins in :mod:`flashlite.stats_gluon` (``online_update``,
``finalize_lse``). Q is scaled by ``scale·log2 e`` and rounded to the input dtype once, as the
Triton kernel's ``PRESCALE_Q`` does, so the backward's recomputed scores match the LSE saved
here.

The same kernel serves :func:`flashlite.flex_attention` (``LISTED``): the producer and the
consumers walk the key blocks a query block's row of the block tables lists, full blocks
first, and the consumers pass the scores through the call's ``score_mod`` and, on partial
tiles only, its ``mask_mod``. Those are ``@triton.jit`` functions of elementwise tile code,
and a Gluon kernel calls them unchanged: their tiles take the wgmma layout of the scores. A
causal mask function visits the built-in causal path's tiles in its order with its
arithmetic, so the two agree bit for bit.

Runs only on a CUDA sm_90 device with Triton's Gluon (3.6 measured); :func:`available` says
whether this process can use it. The interpreter cannot run Gluon, so CPU tests cover the
dispatch; the ``gpu`` tests cover the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from flashlite.kernels.attention.hopper_parts import GLUON_IMPORT_ERROR
from flashlite.stats import LOG2E


class HopperConfig(NamedTuple):
    """Rows per program (two warpgroups of ``block_m / 2``), keys per tile, ring slots, and the
    fewest keys for which this kernel beats the Triton one."""

    block_m: int
    block_n: int
    stages: int
    min_keys: int = 0


#: Per head dim: measured on the H200 (bf16, B·N = 16k, N = 4k and 16k, causal and not;
#: ``benchmarks/NOTES.md``). D=128: 128-key tiles with three slots (225 KB of shared memory)
#: beat 64-key tiles with 3–5 slots by 6–10% and 128-key tiles with two slots by 29–41%. D=64:
#: 128-key tiles with four slots, 0–6% ahead of three or six, 10–15% ahead of 64-key tiles;
#: below 4096 keys it lost to the Triton kernel (N = 1k causal 260 against 324 TFLOP/s).
CONFIGS = {64: HopperConfig(128, 128, 4, min_keys=4096), 128: HopperConfig(128, 128, 3)}


def available() -> bool:
    """Whether this Triton has the Gluon pieces the kernel uses."""
    return GLUON_IMPORT_ERROR is None


if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from flashlite.kernels.attention.hopper_parts import consumer as _consumer
    from flashlite.kernels.attention.hopper_parts import producer as _producer
    from flashlite.kernels.attention.hopper_parts import wgmma_layout as wgmma_layout

    @gluon.jit
    def _key_tiles(
        block,
        seq_q,
        seq_k,
        tables,
        table_strides,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        LISTED: gl.constexpr,
    ):
        """The key tiles of the query ``block`` ``(b, h, pid_m, start_m)`` (``start_m``: its
        first row): ``(n_tiles, n_full, full_row, part_row)``, tiles ``[0, n_full)`` seen whole
        by every row and ``[n_full, n_tiles)`` masked. ``LISTED``: the counts of this row of
        the ``tables`` ``(KV_NUM, KV_IDX, FULL_NUM, FULL_IDX)`` and its full and partial block
        lists; otherwise the causal bounds (bottom-right aligned) and placeholders for the
        lists."""
        b, h, pid_m, start_m = block
        KV_NUM, KV_IDX, FULL_NUM, FULL_IDX = tables
        stride_tb, stride_th, stride_tm, stride_ib, stride_ih, stride_im = table_strides
        if LISTED:  # this row of the tables: its full blocks, then its partial ones
            trow = b * stride_tb + h * stride_th + pid_m * stride_tm
            irow = b.to(gl.int64) * stride_ib + h * stride_ih + pid_m * stride_im
            n_full = gl.load(FULL_NUM + trow)
            n_tiles = n_full + gl.load(KV_NUM + trow)
            full_row = FULL_IDX + irow
            part_row = KV_IDX + irow
        else:
            if IS_CAUSAL:
                diag = seq_k - seq_q
                hi = gl.minimum(gl.maximum(start_m + BLOCK_M + diag, 0), seq_k)
                n_full = gl.minimum(gl.maximum(start_m + diag + 1, 0), seq_k) // BLOCK_N
            else:
                hi = seq_k
                n_full = seq_k // BLOCK_N
            n_tiles = gl.cdiv(hi, BLOCK_N)
            full_row = KV_IDX
            part_row = KV_IDX
        return n_tiles, n_full, full_row, part_row

    @gluon.jit
    def _ring(
        q_desc, k_desc, v_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr
    ):
        """The shared memory the partitions share, with its barriers initialised: ``(q_bufs,
        k_bufs, v_bufs, q_ready, k_ready, v_ready, empty)``, both 64-row halves of Q and
        ``STAGES`` slots of a K and a V tile, each slot's *empty* barrier counting two arrivals
        (one per consumer warpgroup)."""
        half: gl.constexpr = BLOCK_M // 2
        head_dim: gl.constexpr = q_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [2, 1, 1, half, head_dim], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, head_dim], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, head_dim], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        return q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, empty

    @gluon.jit
    def _attention_fwd_hopper_kernel(
        q_desc, k_desc, v_desc, o_desc, LSE, SINKS, n_heads, group, seq_q, seq_k, sm_scale,
        KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
        stride_tb, stride_th, stride_tm, stride_ib, stride_ih, stride_im,
        MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        IS_CAUSAL: gl.constexpr, HAS_SINKS: gl.constexpr = False, LISTED: gl.constexpr = False,
        MASK_MOD: gl.constexpr = None, N_MASK_BUF: gl.constexpr = 0,
        SCORE_MOD: gl.constexpr = None, N_SCORE_BUF: gl.constexpr = 0,
        HAS_SCORE: gl.constexpr = False, ALIBI: gl.constexpr = False,
    ):  # fmt: skip
        """Grid ``(cdiv(Nq, BLOCK_M), B·Hq)``; 4 warps (the first consumer) plus the worker
        partitions. Q, K, V, O: 4-D ``(B, H, N, D)`` descriptors of ``[1, 1, rows, D]`` blocks
        (out-of-bounds rows read as zeros and are never stored). Causal is bottom-right
        aligned; the last query blocks, which see the most keys, start first.

        ``LISTED``: the key tiles are the ones a program's row of the block tables lists
        (:mod:`flashlite.block_mask`, blocks of ``BLOCK_M × BLOCK_N``), full ones first, and
        ``mask_mod`` / ``score_mod`` (:mod:`flashlite.mods`, buffers ``MB*`` / ``SB*``) shape
        the scores, as :mod:`.flex`'s Triton kernel does; otherwise the table arguments are
        placeholders, never read. ``ALIBI``: the score function declares the head-linear bias
        (:func:`flashlite.masking.mods.score_mod`'s ``fast_path``; slopes in ``SB0``), applied
        as a column and a row term (:func:`~flashlite.kernels.attention.hopper_parts._fold`)."""
        qk_scale = sm_scale * LOG2E  # in fp32, as the Triton kernels and the backward take it
        pid_bh = gl.program_id(1)
        b = pid_bh // n_heads
        h = pid_bh % n_heads
        h_kv = h // group  # GQA: the group's query heads share one K/V head, no copies
        pid_m = gl.program_id(0)
        if IS_CAUSAL or LISTED:
            pid_m = gl.cdiv(seq_q, BLOCK_M) - 1 - pid_m
        start_m = pid_m * BLOCK_M
        tiles = _key_tiles(
            (b, h, pid_m, start_m),
            seq_q,
            seq_k,
            (KV_NUM, KV_IDX, FULL_NUM, FULL_IDX),
            (stride_tb, stride_th, stride_tm, stride_ib, stride_ih, stride_im),
            BLOCK_M,
            BLOCK_N,
            IS_CAUSAL,
            LISTED,
        )
        ring = _ring(q_desc, k_desc, v_desc, BLOCK_M, BLOCK_N, STAGES)
        # (argument tuples written out: constexprs must reach the partitions as literals)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        ring,
                        (o_desc, LSE, SINKS),
                        (b, h, pid_bh, start_m),
                        tiles,
                        (seq_q, seq_k, qk_scale),
                        (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3),
                        0,
                        (IS_CAUSAL, HAS_SINKS, LISTED, HAS_SCORE, ALIBI),
                        (MASK_MOD, N_MASK_BUF, SCORE_MOD, N_SCORE_BUF),
                    ),
                ),
                (
                    _consumer,
                    (
                        ring,
                        (o_desc, LSE, SINKS),
                        (b, h, pid_bh, start_m),
                        tiles,
                        (seq_q, seq_k, qk_scale),
                        (MB0, MB1, MB2, MB3, SB0, SB1, SB2, SB3),
                        1,
                        (IS_CAUSAL, HAS_SINKS, LISTED, HAS_SCORE, ALIBI),
                        (MASK_MOD, N_MASK_BUF, SCORE_MOD, N_SCORE_BUF),
                    ),
                ),
                (_producer, ((q_desc, k_desc, v_desc), ring, (b, h, h_kv, start_m), tiles, LISTED)),
            ],
            [4, 1],
            [240, 24],
        )
