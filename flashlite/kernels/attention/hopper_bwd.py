"""Attention backward for Hopper (sm_90) in Gluon: one fused kernel, five products per tile.

The Triton backward (:mod:`flashlite.kernels.attention.bwd`) runs two kernels: dK/dV walks the
queries for a block of keys, dQ walks the keys for a block of queries, and each recomputes
``P`` and ``dP`` — seven products per tile of (query, key) pairs. This kernel does what
FlashAttention-3 and cuDNN do: one program owns ``BLOCK_N = 128`` keys of one K/V head, walks
the query blocks that see them (over the GQA group's heads), and adds its share of dQ into an
fp32 accumulator with a TMA reduction (``cp.reduce.async.bulk.tensor`` add): five products
per tile. The kernel adds ``scale·dS·K`` already, so a copy that rounds the accumulator
finishes dQ. The sums' order varies from run to run, so dQ is not bit-for-bit deterministic (dK
and dV are); the front-end keeps the Triton kernels under deterministic algorithms.

Per program, three partitions, as in the forward (:mod:`flashlite.kernels.attention.hopper`):

* a **producer** warp loads K and V once, then Qs and dO tiles of ``BLOCK_M = 64`` rows into a
  ring of ``STAGES`` shared-memory slots (TMA), and the tile's LSE and delta (through registers:
  64 values each);
* two **consumer** warpgroups, each owning 64 of the 128 keys: per query tile each computes
  ``Sᵀ − LSE = K·Qsᵀ`` and ``dPᵀ − delta = V·dOᵀ`` for its keys (the products start from −LSE
  and −delta broadcast over the keys: no row vector lives in registers across the step, which
  keeps ptxas's spills to a few loop counters), ``Pᵀ = 2^(Sᵀ − LSE)``,
  ``dSᵀ = Pᵀ ∘ (dPᵀ − delta)``, and accumulates ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Qs`` in
  registers (``Pᵀ`` and ``dSᵀ`` enter those products from registers);
* for dQ the two warpgroups split **columns**, not keys (FlashAttention-3's split): each
  writes its half of ``dSᵀ`` to shared memory, and once both halves are there each computes
  ``dQ[:, its 64 columns] = dS · K[:, its columns]`` over all 128 keys. Every dQ byte is then
  reduced once per 128 keys, not once per 64, and each warpgroup holds a 64×64 dQ tile, not
  64×128.

The query blocks are walked from the last down, the causal diagonal's (masked) ones last.
Without causal masking the last key block, when it runs past Nk, masks every step: TMA reads
the missing keys' rows as zeros, so their ``P = 2^(0 − LSE)`` is not 0, and with few keys and
large scores (a very negative LSE) it overflows 16 bits, and ``inf·0`` in ``dS·K`` made dQ NaN.

Qs is the backward preprocess's ``Q·scale·log2 e`` (:mod:`flashlite.kernels.attention.bwd`),
so the scores are the forward's bit for bit and ``P = 2^(Sᵀ − LSE·log2 e)``: the producer
converts the LSE with :func:`flashlite.stats_gluon.lse_log2`, and a score function's
probabilities come from :func:`~flashlite.stats_gluon.probs_from_lse_t` (the Gluon twins of the
stats helpers, which a Gluon kernel cannot call).

The same kernel serves :func:`flashlite.flex_attention`'s backward (``LISTED``): a key block
walks the query blocks its row of the ``q_*`` block tables lists for each head of the group
(two 64-row steps per 128-row table block), full ones first, then partial ones, where
``mask_mod`` zeroes ``Pᵀ``. A score function sees the natural-unit scores ``Sᵀ·ln 2`` before
the LSE is subtracted (the products then start from 0, not −LSE), and its derivative multiplies
``dPᵀ − delta``.

Runs only on a CUDA sm_90 device with Triton's Gluon (3.6 measured). Dense attention: causal
(bottom-right aligned) or not, GQA, any lengths; no window, soft cap, per-batch lengths or
packed sequences (those take the Triton kernels); or block tables with mask and score
functions.
"""

from __future__ import annotations

from flashlite.kernels.attention.hopper_bwd_parts import GLUON_BWD_ERROR as GLUON_BWD_ERROR
from flashlite.kernels.attention.hopper_parts import GLUON_IMPORT_ERROR as GLUON_IMPORT_ERROR

if GLUON_BWD_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from flashlite.kernels.attention.hopper_bwd_consumer import consumer as _consumer
    from flashlite.kernels.attention.hopper_bwd_parts import producer as _producer

#: Keys per program (two warpgroups of 64), query rows per step, ring slots for Qs and dO.
BLOCK_N = 128
BLOCK_M = 64
STAGES = 2
#: Head dims this kernel is built for.
HEAD_DIMS = (64, 128)
#: Causal launches order programs in groups of this many (batch, K/V head) pairs, heads
#: fastest: each group's heaviest key blocks start first (balance), and the group's Qs, dO and
#: dQ rows stay in L2 (on the H200 at B 4, Hq 16, Hkv 8, N 4k: 4 beat 1 by 8%, 2 by 8% and 8
#: by 1%; 16k: 2 and 4 within 2%).
CAUSAL_GROUP_H = 4


def available() -> bool:
    """Whether this Triton has the Gluon pieces the kernel uses."""
    return GLUON_BWD_ERROR is None


if GLUON_BWD_ERROR is None:

    @gluon.jit
    def _key_block(
        qs_desc, k_desc, seq_q, seq_k, kv_heads, GROUP_H: gl.constexpr, IS_CAUSAL: gl.constexpr
    ):
        """This program's key block: ``(b, h_kv, start_n, lo, n_masked, n_qblocks)``, the query
        blocks that see it being the ``n_qblocks`` from row ``lo``, the first ``n_masked`` of
        them masked (walked last)."""
        block_m: gl.constexpr = qs_desc.block_type.shape[2]
        block_n: gl.constexpr = k_desc.block_type.shape[2]
        # 1-D grid over (key block, batch·head) in groups of GROUP_H heads: within a group the
        # heads run fastest, so the heaviest causal blocks of GROUP_H heads start first
        n_kb = gl.cdiv(seq_k, block_n)
        n_bh = gl.num_programs(0) // n_kb
        pid = gl.program_id(0)
        first_bh = (pid // (GROUP_H * n_kb)) * GROUP_H
        in_group = gl.minimum(n_bh - first_bh, GROUP_H)
        idx = pid - first_bh * n_kb
        pid_bh = first_bh + idx % in_group
        b = pid_bh // kv_heads
        h_kv = pid_bh % kv_heads
        start_n = (idx // in_group) * block_n
        # query blocks [lo, full_lo) hold the diagonal (masked), [full_lo, Nq) see every key
        if IS_CAUSAL:
            diag = seq_k - seq_q
            lo = (gl.maximum(start_n - diag, 0) // block_m) * block_m
            full_lo = gl.cdiv(gl.maximum(start_n + block_n - 1 - diag, 0), block_m) * block_m
        else:
            lo = 0
            full_lo = 0
        n_qblocks = gl.cdiv(gl.maximum(seq_q - lo, 0), block_m)
        n_masked = gl.minimum((full_lo - lo) // block_m, n_qblocks)
        if not IS_CAUSAL:  # the last key block, past Nk: every step masks the missing keys
            n_masked = gl.where(start_n + block_n > seq_k, n_qblocks, 0)
        return b, h_kv, start_n, lo, n_masked, n_qblocks

    @gluon.jit
    def _shared_memory(qs_desc, do_desc, k_desc, v_desc, dq_desc, STAGES: gl.constexpr):
        """The shared buffers and their barriers, initialised: the ring ``(qs_bufs, do_bufs,
        lse_bufs, delta_bufs, q_ready, do_ready, empty)`` of ``STAGES`` slots, K/V ``(k_buf,
        v_buf, kv_ready)``, and dS/dQ ``(ds_bufs, ds_ready, ds_free, dq_bufs)``: two dSᵀ
        buffers (the consumers alternate) and a dQ staging buffer per consumer."""
        block_m: gl.constexpr = qs_desc.block_type.shape[2]
        block_n: gl.constexpr = k_desc.block_type.shape[2]
        head_dim: gl.constexpr = qs_desc.block_type.shape[3]
        dtype: gl.constexpr = qs_desc.dtype
        qs_bufs = gl.allocate_shared_memory(
            dtype, [STAGES, 1, 1, block_m, head_dim], qs_desc.layout
        )
        do_bufs = gl.allocate_shared_memory(
            dtype, [STAGES, 1, 1, block_m, head_dim], do_desc.layout
        )
        stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, block_m], stat_layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, block_m], stat_layout)
        k_buf = gl.allocate_shared_memory(dtype, [1, 1, block_n, head_dim], k_desc.layout)
        v_buf = gl.allocate_shared_memory(dtype, [1, 1, block_n, head_dim], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([block_n, block_m], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [2, block_n, block_m], ds_layout)
        dq_bufs = gl.allocate_shared_memory(
            gl.float32, [2, 1, 1, block_m, head_dim // 2], dq_desc.layout
        )
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=2)
        ring = (qs_bufs, do_bufs, lse_bufs, delta_bufs, q_ready, do_ready, empty)
        return ring, (k_buf, v_buf, kv_ready), (ds_bufs, ds_ready, ds_free, dq_bufs)

    @gluon.jit
    def _attention_bwd_hopper_kernel(
        qs_desc, do_desc, k_desc, v_desc, dq_desc, LSE, DELTA, DK, DV,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        n_heads, kv_heads, group, seq_q, seq_k, sm_scale,
        FULL_NUM, FULL_IDX, Q_NUM, Q_IDX,
        stride_tb, stride_th, stride_tn,
        stride_ib, stride_ih, stride_in,
        MB0, MB1, MB2, MB3,
        SB0, SB1, SB2, SB3,
        STAGES: gl.constexpr, GROUP_H: gl.constexpr, IS_CAUSAL: gl.constexpr,
        LISTED: gl.constexpr = False, MASK_MOD: gl.constexpr = None, N_MASK_BUF: gl.constexpr = 0,
        SCORE_MOD: gl.constexpr = None, SCORE_GRAD: gl.constexpr = None,
        N_SCORE_BUF: gl.constexpr = 0, HAS_SCORE: gl.constexpr = False,
    ):  # fmt: skip
        """Grid ``(cdiv(Nk, 128), B·Hkv)``; 4 warps (the first consumer) plus the worker
        partitions. Qs, dO: ``[1, 1, 64, D]`` blocks; K, V: ``[1, 1, 128, D]``; dQ's fp32
        accumulator: ``[1, 1, 64, D/2]``. dK and dV (strided like K and V, with a unit last
        stride) are written by pointer. Causal is bottom-right aligned; the first key blocks,
        seen by the most queries, start first.

        ``LISTED`` (:func:`flashlite.flex_attention`): the query blocks are the ones a key
        block's row of the ``q_*`` block tables lists for each head of the group
        (:mod:`flashlite.block_mask`, blocks of 128 × 128: two steps each), full ones first,
        and ``mask_mod`` / ``score_mod`` with its derivative ``SCORE_GRAD``
        (:mod:`flashlite.mods`, buffers ``MB*`` / ``SB*``) shape the scores as the forward's;
        otherwise the table arguments are placeholders, never read."""
        blk = _key_block(qs_desc, k_desc, seq_q, seq_k, kv_heads, GROUP_H, IS_CAUSAL)
        smem = _shared_memory(qs_desc, do_desc, k_desc, v_desc, dq_desc, STAGES)
        out = (dq_desc, DK, DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn)
        loads = (qs_desc, do_desc, k_desc, v_desc, LSE, DELTA)
        table_strides = (stride_tb, stride_th, stride_tn, stride_ib, stride_ih, stride_in)
        tables = (FULL_NUM, FULL_IDX, Q_NUM, Q_IDX, table_strides)
        # (tuples that hold constexprs are written out in the calls: bound to a name, a
        # tuple's constexprs would become tensors)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        smem,
                        out,
                        blk,
                        (seq_q, seq_k, sm_scale, group),
                        tables,
                        (0, IS_CAUSAL, LISTED, HAS_SCORE),
                        (MASK_MOD, N_MASK_BUF, MB0, MB1, MB2, MB3),
                        (SCORE_MOD, SCORE_GRAD, N_SCORE_BUF, SB0, SB1, SB2, SB3),
                    ),
                ),
                (
                    _consumer,
                    (
                        smem,
                        out,
                        blk,
                        (seq_q, seq_k, sm_scale, group),
                        tables,
                        (1, IS_CAUSAL, LISTED, HAS_SCORE),
                        (MASK_MOD, N_MASK_BUF, MB0, MB1, MB2, MB3),
                        (SCORE_MOD, SCORE_GRAD, N_SCORE_BUF, SB0, SB1, SB2, SB3),
                    ),
                ),
                (_producer, (loads, smem, blk, (n_heads, group, seq_q), tables, LISTED)),
            ],
            [4, 1],
            [240, 24],
        )
