"""Your own masks and score functions: :func:`flex_attention`, named and shaped as
``torch.nn.attention.flex_attention``'s, on :mod:`flashlite.kernels.attention.flex` (and the
Hopper kernels on an sm_90 device), over the tables of
:func:`~flashlite.ops.attention.block_mask.create_block_mask`.

The ops ``flashlite::flex_attention_fwd``/``_bwd`` carry a mod as its registered name
(:func:`flashlite.mods.registered`), its tensor buffers and its numbers, so that
``torch.compile(fullgraph=True)`` traces a call like any other custom op, and the block tables
as tensors: a new sequence length is new table shapes, never a new kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton

from flashlite import _backend
from flashlite import mods as M
from flashlite._caches import Cache
from flashlite.kernels.attention import block_mask as KB
from flashlite.kernels.attention import flex as KF
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops._dispatch import Op
from flashlite.ops.attention import hopper as HP
from flashlite.ops.attention.block_mask import block_mask_for
from flashlite.ops.attention.bwd import hopper_bwd_applies
from flashlite.ops.attention.bwd_launch import bwd_preprocess, plan_preprocess
from flashlite.ops.attention.checks import check_inputs
from flashlite.ops.attention.mod_args import check_buffers_on, spec_mod, unspec_mod
from flashlite.ops.attention.plan import _descriptor_ok, hopper_config

__all__ = ["flex_attention", "compiled_variants"]


# --------------------------------------------------------------------------- the ops
def _mod_args(mask: tuple[str, list[torch.Tensor], list[float]],
              score: tuple[str, list[torch.Tensor], list[float]],
              grad: bool) -> tuple[list[Any], dict[str, Any]]:  # fmt: skip
    """The kernels' eight buffer slots and their mod constexprs (``SCORE_GRAD`` with ``grad``;
    an absent score function's slots hold the mask, never called)."""
    (mfn, *_), mbufs, n_mbuf = unspec_mod(*mask)
    sfns, sbufs, n_sbuf = unspec_mod(*score)
    if grad and sfns is not None and sfns[2] is None:
        raise NotImplementedError(
            f"score_mod {score[0].rsplit(':', 1)[0]} has no derivative: make it with "
            "flashlite.mods.score_mod(fn, ..., grad=...) to differentiate through it"
        )
    consts = {"MASK_MOD": mfn, "N_MASK_BUF": n_mbuf, "SCORE_MOD": sfns[0] if sfns else mfn,
              "N_SCORE_BUF": n_sbuf, "HAS_SCORE": sfns is not None}  # fmt: skip
    if grad:
        consts["SCORE_GRAD"] = sfns[2] if sfns else mfn
    return [*mbufs, *sbufs], consts


def _options(q: torch.Tensor, tbm: int, tbn: int, bwd: bool) -> dict[str, Any]:
    """Kernel tiles (dividing the table's) and numerics."""
    d = q.shape[-1]
    if _backend.INTERPRETED:
        bm, bn, warps, stages = tbm, tbn, 4, 1
    elif bwd:
        bm, bn, warps, stages = min(tbm, 64), min(tbn, 64), 4, 2
    else:
        bm, bn = min(tbm, 128), min(tbn, 64)
        warps, stages = (8 if d > 64 else 4), 3
    return {
        "HEAD_DIM": d, "BLOCK_D": max(16, triton.next_power_of_2(d)), "BLOCK_M": bm,
        "BLOCK_N": bn, "TBM": tbm, "TBN": tbn, "DOT_FP32": _backend.dot_upcast(q.dtype),
        "DOT_PRECISION": "tf32x3" if q.dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(q.dtype), "num_warps": warps, "num_stages": stages,
    }  # fmt: skip


def _table_args(num: torch.Tensor, idx: torch.Tensor, b: int, h: int) -> tuple[Any, ...]:
    """Strides of ``(B|1, H|1, n)`` counts and ``(B|1, H|1, n, m)`` indices as ``(B, H, …)``
    views take them: 0 along a broadcast (size 1) dimension, as ``expand`` would give."""
    ns, is_ = num.stride(), idx.stride()
    one_b, one_h = num.shape[0] == 1, num.shape[1] == 1
    return (0 if one_b else ns[0], 0 if one_h else ns[1], ns[2], 0 if one_b else is_[0],
            0 if one_h else is_[1], is_[2])  # fmt: skip


def _fwd_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num: torch.Tensor,
              kv_idx: torch.Tensor, full_num: torch.Tensor, full_idx: torch.Tensor,
              q_num: torch.Tensor, q_idx: torch.Tensor, full_q_num: torch.Tensor,
              full_q_idx: torch.Tensor, tbm: int, tbn: int, mask_spec: str,
              mask_tensors: list[torch.Tensor], mask_nums: list[float], score_spec: str,
              score_tensors: list[torch.Tensor], score_nums: list[float],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = q.new_empty((b, hq, nq), dtype=torch.float32)
    if o.numel() == 0:
        return o, lse.fill_(-math.inf)
    bufs, mods = _mod_args((mask_spec, mask_tensors, mask_nums),
                           (score_spec, score_tensors, score_nums), grad=False)  # fmt: skip
    tables = (kv_num, kv_idx, full_num, full_idx)
    strides = _table_args(kv_num, kv_idx, b, hq)
    if _run_hopper(q, k, v, o, lse, tables, strides, tbm, tbn, scale, bufs, mods):
        return o, lse
    opts = _options(q, tbm, tbn, bwd=False)
    grid = (triton.cdiv(nq, opts["BLOCK_M"]), b * hq)
    _launch(KF._flex_fwd_kernel, grid, (
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *tables, *strides, hq, hq // hkv, nq, nk, scale, *bufs), mods, opts)  # fmt: skip
    return o, lse


#: (kernel, mods, head dim, dtype) launched with one stage: see :func:`_launch`.
_one_stage: set[tuple[Any, ...]] = set()


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], mods: dict[str, Any],
            opts: dict[str, Any]) -> None:  # fmt: skip
    """Launch a Triton flex kernel. Triton's software pipeliner stages a loop's loads in shared
    memory, a mod's gathers too (a bias table read per score): those can outgrow it. Then
    the kernel runs (this time and for later calls of the mod) with one stage, unpipelined."""
    key = (kernel, *mods.values(), opts["HEAD_DIM"], args[0].dtype)
    if key in _one_stage:
        opts = {**opts, "num_stages": 1}
    try:
        kernel[grid](*args, **mods, **opts)
    except triton.runtime.errors.OutOfResources:
        if opts["num_stages"] == 1:
            raise
        _one_stage.add(key)
        kernel[grid](*args, **mods, **{**opts, "num_stages": 1})


_hopper_failed: set[tuple[Any, ...]] = set()


def _run_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, tables: tuple[torch.Tensor, ...], strides: tuple[int, ...],
                tbm: int, tbn: int, scale: float, bufs: list[Any],
                mods: dict[str, Any]) -> bool:  # fmt: skip
    """Run the forward on the Gluon (Hopper) kernel where it applies: a compiled sm_90 device,
    16-bit inputs TMA can read, a head dim with a measured config whose tiles are the tables'
    blocks. False (after one warning if it failed to build) means: run the Triton kernel."""
    config = hopper_config(q, k.shape[2])
    if config is None or (tbm, tbn) != (config.block_m, config.block_n):
        return False
    key = (q.dtype, q.shape[-1], mods["MASK_MOD"], mods["SCORE_MOD"], mods["HAS_SCORE"])
    if not _descriptor_ok(q, k, v, o):
        return False

    def build() -> bool:
        HP.flex_fwd_hopper(q, k, v, o, lse, tables, strides, scale, config, bufs, mods)
        return True

    return HP.first_build(_hopper_failed, key, "flex", build, stacklevel=3) is not None


def _fwd_fake(q, k, v, *args):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_body(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
              kv_num: torch.Tensor, kv_idx: torch.Tensor, full_num: torch.Tensor,
              full_idx: torch.Tensor, q_num: torch.Tensor, q_idx: torch.Tensor,
              full_q_num: torch.Tensor, full_q_idx: torch.Tensor, tbm: int, tbn: int,
              mask_spec: str, mask_tensors: list[torch.Tensor], mask_nums: list[float],
              score_spec: str, score_tensors: list[torch.Tensor], score_nums: list[float],
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bufs, mods = _mod_args((mask_spec, mask_tensors, mask_nums),
                           (score_spec, score_tensors, score_nums), grad=True)  # fmt: skip
    q_tables = (q_num, q_idx, full_q_num, full_q_idx)
    if _run_hopper_bwd(do, q, k, v, o, lse, dlse, dq, dk, dv, q_tables, tbm, tbn, scale, bufs,
                       mods):  # fmt: skip
        return dq, dk, dv
    opts = _options(q, tbm, tbn, bwd=True)
    delta = bwd_preprocess(o, do, lse, dlse, q, q, scale, prescale_q=False)
    _launch(KF._flex_bwd_dkdv_kernel, (triton.cdiv(nk, opts["BLOCK_N"]), b * hkv), (
        q, k, v, do, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dk.stride(), *dv.stride(), q_num, q_idx, full_q_num, full_q_idx,
        *_table_args(q_num, q_idx, b, hq), hkv, hq // hkv, nq, nk, scale, *bufs), mods,
        opts)  # fmt: skip
    _launch(KF._flex_bwd_dq_kernel, (triton.cdiv(nq, opts["BLOCK_M"]), b * hq), (
        q, k, v, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dq.stride(), kv_num, kv_idx, full_num, full_idx, *_table_args(kv_num, kv_idx, b, hq),
        hq, hq // hkv, nq, nk, scale, *bufs), mods, opts)  # fmt: skip
    return dq, dk, dv


_hopper_bwd_failed: set[tuple[Any, ...]] = set()


def _run_hopper_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                    tables: tuple[torch.Tensor, ...], tbm: int, tbn: int, scale: float,
                    bufs: list[Any], mods: dict[str, Any]) -> bool:  # fmt: skip
    """Run the backward on the fused Gluon kernel where it applies (as the dense backward's,
    :func:`~flashlite.ops.attention.bwd.hopper_bwd_applies`, with tables of its 128 × 128
    tiles): the preprocess writes delta, ``Qs`` into ``dq``'s memory and zeros into dQ's fp32
    accumulator, then one kernel adds every gradient. False (after one warning if it failed to
    build) means: run the Triton kernels (they overwrite ``dq``)."""
    if (tbm, tbn) != (2 * KHB.BLOCK_M, KHB.BLOCK_N):
        return False
    if not hopper_bwd_applies(q, k, v, do, dk, dv) or not _descriptor_ok(dq):
        return False
    key = (q.dtype, q.shape[-1], *mods.values())
    b, hq = q.shape[:2]

    def build() -> bool:
        acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        dense_dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
        _preprocess(o, do, dense_dlse, delta, q, dq, acc, scale)
        strides = _table_args(tables[0], tables[1], b, hq)
        HP.flex_bwd_hopper(dq, k, v, do, lse, delta, dq, dk, dv, acc, tables, strides, scale,
                           bufs, mods)  # fmt: skip
        return True

    return HP.first_build(_hopper_bwd_failed, key, "flex backward", build, stacklevel=3) is not None


#: The fused backward's preprocess plans (:func:`_preprocess`).
_preps: Cache = Cache("flex.preprocess", 64)


def _preprocess(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None,
                delta: torch.Tensor, q: torch.Tensor, qs: torch.Tensor, acc: torch.Tensor,
                scale: float) -> None:  # fmt: skip
    """The fused backward's preprocess (delta; ``Qs`` into ``qs``; zeros into ``acc``), its plan
    kept per what it binds: the strides, the scale and each pointer's alignment."""
    key = (o.dtype, o.device, o.shape, o.stride(), do.stride(), q.stride(), qs.stride(), scale,
           dlse is None, dlse is None or dlse.data_ptr() % 16 == 0,
           *(t.data_ptr() % 16 == 0 for t in (o, do, q, qs)))  # fmt: skip
    run = _preps.get(key)
    if run is None:
        run = _preps.put(key, plan_preprocess(o, do, dlse, delta, q, qs, scale, acc,
                                              prescale_q=True))  # fmt: skip
    run(o, do, dlse, delta, q, qs, acc)


def _bwd_fake(do, q, k, v, *args):  # type: ignore[no-untyped-def]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


FLEX_BWD = Op("flex_attention_bwd", _bwd_body, fake=_bwd_fake, inputs=7, moves=False)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, *tables = inputs[:11]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *tables)
    ctx.rest = inputs[11:]


def _backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def]
    q, k, v, o, lse, *tables = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    # (the kernels read dO through its strides: no copy)
    dq, dk, dv = FLEX_BWD(grad_o, q, k, v, o, lse, grad_lse, *tables, *ctx.rest)
    # (the custom op's autograd wants a list of Nones for a list of tensors, the eager
    # Function one None per argument: needs_input_grad has the matching structure)
    rest = [[None] * len(f) if isinstance(f, (list, tuple)) else None
            for f in ctx.needs_input_grad[3:]]  # fmt: skip
    return dq, dk, dv, *rest


FLEX_FWD = Op("flex_attention_fwd", _fwd_body, fake=_fwd_fake, inputs=3,
              setup_context=_setup_context, backward=_backward, materialize_grads=False,
              moves=False)  # fmt: skip


def compiled_variants() -> int:
    """How many compiled variants of the flex and classifier kernels this process holds (what
    a loop over sequence lengths should not grow; 0 in the interpreter, which compiles
    nothing). With Gluon, the Hopper kernels' variants count too (the plain attention's
    among them)."""
    kernels = [KF._flex_fwd_kernel, KF._flex_bwd_dkdv_kernel, KF._flex_bwd_dq_kernel,
               KB._classify_tiles_kernel]  # fmt: skip
    if KH.available():
        kernels.append(KH._attention_fwd_hopper_kernel)
    if KHB.available():
        kernels.append(KHB._attention_bwd_hopper_kernel)
    caches = (getattr(k, "device_caches", {}) for k in kernels)
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


# --------------------------------------------------------------------------- public
def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Any = None, block_mask: Any = None, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False, *,
                   layout: str = "b h n d") -> Any:  # fmt: skip
    """Attention with your own mask and score function (``torch.nn.attention.flex_attention``'s
    signature), differentiable in query, key and value.

    Args:
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hkv, Nk, D)`` (``layout="b n h d"``: heads
            second to last). fp16, bf16 or fp32; GQA when ``Hkv`` divides ``Hq``.
        score_mod: a :class:`~flashlite.mods.ScoreMod` (or a bare jit score function, forward
            only): rewrites each scaled score ``q·k·scale`` before the softmax.
        block_mask: a :class:`~flashlite.block_mask.BlockMask` from :func:`create_block_mask`,
            or torch's ``BlockMask`` built from a flashlite ``MaskMod``; None: no mask.
        scale: the softmax scale (default ``1/sqrt(D)``).
        enable_gqa: accepted for torch's signature; GQA works either way.
        return_lse: also return the natural-log LSE ``(B, Hq, Nq)`` fp32 (differentiable).
        layout: ``"b h n d"`` (torch's) or ``"b n h d"``.

    Returns:
        The output like ``query`` (and the LSE). A row that sees no key gives 0 (LSE −inf).

    Raises:
        TypeError, ValueError: bad tensors, mods or block masks, each naming the argument.
    """
    scale, q, k, v = check_inputs(query, key, value, layout, scale)
    if not (q.is_cuda or _backend.INTERPRETED):  # (no moving copies here: say so instead)
        raise ValueError(
            "flex_attention runs its kernels where the tensors are: CUDA tensors, or CPU "
            "tensors with Triton's interpreter (TRITON_INTERPRET=1); move query, key and value "
            "(and the block mask, and the mods' buffers) to the GPU"
        )
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    bm = block_mask_for(block_mask, q, k)
    smod = None if score_mod is None else M.as_score_mod(score_mod)
    if smod is not None:
        check_buffers_on(smod, q.device, "score_mod")
    check_buffers_on(bm.mask_mod, q.device, "block_mask's mask_mod")
    b, hq = q.shape[:2]
    tb, th = bm.kv_num_blocks.shape[:2]
    if tb not in (1, b) or th not in (1, hq):
        raise ValueError(f"block_mask was built for B={tb}, H={th}; the call has B={b}, H={hq} "
                         "(build it with these, or None to broadcast)")  # fmt: skip
    o, lse = FLEX_FWD(q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                      bm.full_kv_indices, bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks,
                      bm.full_q_indices, *bm.BLOCK_SIZE, *spec_mod(bm.mask_mod), *spec_mod(smod),
                      scale)  # fmt: skip
    if layout == "b n h d":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o
