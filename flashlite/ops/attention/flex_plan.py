"""What a :func:`~flashlite.ops.attention.flex.flex_attention` call runs, planned once per kind of
call (:class:`FwdPlan`, :class:`BwdPlan`): the kernels (the Hopper ones where they apply, else
Triton's), their options, the block tables' strides, the mods' buffer slots and the bound
launches. A kind is everything a plan pins (:func:`.flex_args.call_key`); a later call of the
kind allocates its outputs and launches, nothing more (the host path's cost, docs/host-path.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

from flashlite import _backend
from flashlite._caches import Cache, register
from flashlite.kernels.attention import flex as KF
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.masking.mod_args import ModArgs, Slots
from flashlite.ops.attention import hopper as HP
from flashlite.ops.attention.bwd_launch import plan_preprocess
from flashlite.ops.attention.flex_args import (
    bind_triton,
    grid_batch,
    grid_blocks,
    head_linear_bias,
    mod_args,
    table_args,
    triton_fwd_tiles,
)
from flashlite.ops.attention.plan import (
    descriptor_ok,
    hopper_bwd_applies,
    hopper_config,
)

#: dQ, dK, dV.
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: Varlen's offsets ``(cu_seqlens_q, cu_seqlens_k)``, or None.
Offsets = tuple[torch.Tensor, torch.Tensor] | None

#: :class:`FwdPlan` and :class:`BwdPlan` per kind of call (:func:`.flex_args.call_key`).
fwd_plans = Cache("flex.fwd", 256)
bwd_plans = Cache("flex.bwd", 256)


def _options(
    q: torch.Tensor, tbm: int, tbn: int, bwd: bool, varlen: bool = False
) -> dict[str, Any]:
    """The Triton kernels' tiles (dividing the table's) and numerics. Varlen at head dims
    above 64: 32-key tiles (and 8 warps backward), which built for sm_90 with at most 56 bytes
    of spills where 64-key tiles spilled 136–216 B forward and 0.9–4 KB backward (Triton 3.9's
    ptxas, D 128); not yet timed."""
    d = q.shape[-1]
    if _backend.INTERPRETED:
        bm, bn, warps, stages = tbm, tbn, 4, 1
    elif bwd:
        bm, bn, warps, stages = min(tbm, 64), min(tbn, 64), 4, 2
        if varlen and d > 64:
            bn, warps = min(tbn, 32), 8
    else:
        bm, bn = triton_fwd_tiles(d, (tbm, tbn), varlen)
        warps, stages = (8 if d > 64 else 4), 3
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "TBM": tbm,
        "TBN": tbn,
        "DOT_FP32": _backend.dot_upcast(q.dtype),
        "DOT_PRECISION": "tf32x3" if q.dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(q.dtype),
        "num_warps": warps,
        "num_stages": stages,
    }


# --------------------------------------------------------------------------- forward
#: Variants whose first Hopper launch failed to build (the Triton kernel runs them).
hopper_failed: set[tuple[Any, ...]] = register("flex.hopper_failed", set())


class FwdPlan:
    """A flex forward for one kind of call: ``(o, lse)`` from q, k, v, the ``kv_*`` tables and
    the mods' tensors. Its first call chooses the kernel and binds its launch."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        mask: ModArgs,
        score: ModArgs,
        tbm: int,
        tbn: int,
        scale: float,
        varlen: bool = False,
    ) -> None:
        b, hq, nq, _ = q.shape
        self.lse_shape = (b, hq, nq)
        self.tbm, self.tbn, self.scale, self.varlen = tbm, tbn, scale, varlen
        bufs, self.mods = mod_args(mask, score, grad=False)
        # the Hopper forward also takes whether the score function declares the head-linear
        # bias (ALiBi), which it applies as a column and a row term; Triton calls it as it is
        self.hopper_mods = {**self.mods, "ALIBI": head_linear_bias(score)}
        self.slots = Slots(bufs)
        self.strides = table_args(tables[0], tables[1])
        #: ``run(q, k, v, o, lse, tables, bufs)``, bound by the first call
        self.run: Callable[..., None] | None = None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        tensors: list[torch.Tensor],
        cu: Offsets = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty_like(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        bufs = self.slots(tensors)
        cu = cu or (tables[0], tables[0])  # (placeholders, never read)
        if self.run is None:
            self.run = self._first(q, k, v, o, lse, tables, bufs, cu)
        else:
            self.run(q, k, v, o, lse, tables, bufs, cu)
        return o, lse

    def _first(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        bufs: list[Any],
        cu: tuple[torch.Tensor, torch.Tensor],
    ) -> Callable[..., None]:
        """Launch this call; the launch later calls repeat. The Gluon (Hopper) kernel where it
        applies: a compiled sm_90 device, 16-bit inputs TMA can read, a head dim with a
        measured config whose tiles are the tables' blocks, not varlen; else (or after one
        warning if it failed to build) the Triton kernel."""
        config = None if self.varlen else hopper_config(q, k.shape[2])
        if (
            config is not None
            and (self.tbm, self.tbn) == (config.block_m, config.block_n)
            and descriptor_ok(q, k, v, o)
        ):
            key = (q.dtype, q.shape[-1], *self.hopper_mods.values())

            def build() -> Callable[..., None]:
                return HP.plan_flex_fwd(
                    q,
                    k,
                    v,
                    o,
                    lse,
                    tables,
                    self.strides,
                    self.scale,
                    config,
                    bufs,
                    self.hopper_mods,
                )

            run = HP.first_build(hopper_failed, key, "flex", build, stacklevel=6)
            if run is not None:

                def hopper(
                    q: torch.Tensor,
                    k: torch.Tensor,
                    v: torch.Tensor,
                    o: torch.Tensor,
                    lse: torch.Tensor,
                    tables: tuple[torch.Tensor, ...],
                    bufs: list[Any],
                    cu: tuple[torch.Tensor, torch.Tensor],
                ) -> None:
                    run(q, k, v, o, lse, tables, bufs)

                return hopper
        hq, nq = q.shape[1], q.shape[2]
        hkv, nk = k.shape[1], k.shape[2]
        opts = _options(q, self.tbm, self.tbn, bwd=False, varlen=self.varlen)
        grid = (
            grid_blocks(nq, tables[0], self.tbm, opts["BLOCK_M"], self.varlen),
            grid_batch(q, cu, self.varlen) * hq,
            1,
        )
        mid = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
        tail = (*self.strides, hq, hq // hkv, nq, nk, self.scale)
        args = (q, k, v, o, lse, *mid, *tables, *tail, *cu, *bufs)
        bound = bind_triton(
            KF._flex_fwd_kernel, grid, args, self.mods, {**opts, "VARLEN": self.varlen}
        )

        def run(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            o: torch.Tensor,
            lse: torch.Tensor,
            tables: tuple[torch.Tensor, ...],
            bufs: list[Any],
            cu: tuple[torch.Tensor, torch.Tensor],
        ) -> None:
            bound(grid, q, k, v, o, lse, *mid, *tables, *tail, *cu, *bufs)

        return run


# --------------------------------------------------------------------------- backward
hopper_bwd_failed: set[tuple[Any, ...]] = register("flex.hopper_bwd_failed", set())


class BwdCall(NamedTuple):
    """One backward call's tensors as its plan's launches take them: the inputs, the gradients
    allocated for it (``dq``, ``dk``, ``dv``), the tables and the mods' buffer slots."""

    do: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    #: the LSE's gradient, dense fp32, or None
    dlse: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    q_tables: tuple[torch.Tensor, ...]
    kv_tables: tuple[torch.Tensor, ...]
    bufs: list[Any]
    #: varlen's offsets (or placeholders, never read)
    cu: tuple[torch.Tensor, torch.Tensor]


class BwdPlan:
    """A flex backward for one kind of call: ``(dq, dk, dv)`` from dO, q, k, v, O, the LSE
    (and its gradient), the ``q_*`` and ``kv_*`` tables and the mods' tensors. Its first call
    chooses the kernels (the fused Hopper one, or the Triton pair) and binds their launches."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_tables: tuple[torch.Tensor, ...],
        kv_tables: tuple[torch.Tensor, ...],
        mask: ModArgs,
        score: ModArgs,
        tbm: int,
        tbn: int,
        scale: float,
        varlen: bool = False,
    ) -> None:
        b, hq, nq, d = q.shape
        self.delta_shape, self.acc_shape = (b, hq, nq), (b, hq, nq, d)
        self.tbm, self.tbn, self.scale, self.varlen = tbm, tbn, scale, varlen
        bufs, self.mods = mod_args(mask, score, grad=True)
        self.slots = Slots(bufs)
        self.q_strides = table_args(q_tables[0], q_tables[1])
        self.kv_strides = table_args(kv_tables[0], kv_tables[1])
        #: ``run(call)`` (:class:`BwdCall`), bound by the first call
        self.run: Callable[[BwdCall], None] | None = None

    def __call__(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        dlse: torch.Tensor | None,
        q_tables: tuple[torch.Tensor, ...],
        kv_tables: tuple[torch.Tensor, ...],
        tensors: list[torch.Tensor],
        cu: Offsets = None,
    ) -> Grads:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # an expanded or strided dlse (autograd may hand one over) is made dense, O(N)
        dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
        bufs = self.slots(tensors)
        cu = cu or (q_tables[0], q_tables[0])  # (placeholders, never read)
        call = BwdCall(do, q, k, v, o, lse, dlse, dq, dk, dv, q_tables, kv_tables, bufs, cu)
        if self.run is None:
            self.run = self._first(call)
        else:
            self.run(call)
        return dq, dk, dv

    def _first(self, c: BwdCall) -> Callable[[BwdCall], None]:
        """Launch this call; the launches later calls repeat. The fused Gluon kernel where it
        applies (as the dense backward's, :func:`~flashlite.ops.attention.bwd.
        hopper_bwd_applies`, with tables of its 128 × 128 tiles, not varlen): the preprocess
        writes delta, ``Qs`` into ``dq``'s memory and zeros into dQ's fp32 accumulator, then
        one kernel adds every gradient. Else (or after one warning if it failed to build) the
        preprocess and the two Triton kernels (they overwrite ``dq``)."""
        fused = (self.tbm, self.tbn) == (2 * KHB.BLOCK_M, KHB.BLOCK_N) and not self.varlen
        if fused and hopper_bwd_applies(c.q, c.k, c.v, c.do, c.dk, c.dv) and descriptor_ok(c.dq):
            run = self._first_fused(c)
            if run is not None:
                return run
        return self._first_triton(c)

    def _first_fused(self, c: BwdCall) -> Callable[[BwdCall], None] | None:
        key = (c.q.dtype, c.q.shape[-1], *self.mods.values())
        acc = torch.empty(self.acc_shape, device=c.q.device, dtype=torch.float32)
        delta = torch.empty(self.delta_shape, device=c.q.device, dtype=torch.float32)
        prep = plan_preprocess(
            c.o, c.do, c.dlse, delta, c.q, c.dq, self.scale, acc, prescale_q=True
        )
        prep(c.o, c.do, c.dlse, delta, c.q, c.dq, acc)

        def build() -> Callable[..., None]:
            return HP.plan_flex_bwd(
                c.dq,
                c.k,
                c.v,
                c.do,
                c.lse,
                delta,
                c.dq,
                c.dk,
                c.dv,
                acc,
                c.q_tables,
                self.q_strides,
                self.scale,
                c.bufs,
                self.mods,
            )

        main = HP.first_build(hopper_bwd_failed, key, "flex backward", build, stacklevel=7)
        if main is None:
            return None
        acc_shape, delta_shape = self.acc_shape, self.delta_shape

        def run(c: BwdCall) -> None:
            acc = torch.empty(acc_shape, device=c.q.device, dtype=torch.float32)
            delta = torch.empty(delta_shape, device=c.q.device, dtype=torch.float32)
            prep(c.o, c.do, c.dlse, delta, c.q, c.dq, acc)
            main(c.dq, c.k, c.v, c.do, c.lse, delta, c.dq, c.dk, c.dv, acc, c.q_tables, c.bufs)

        return run

    def _first_triton(self, c: BwdCall) -> Callable[[BwdCall], None]:
        hq, nq = c.q.shape[1], c.q.shape[2]
        hkv, nk = c.k.shape[1], c.k.shape[2]
        b = grid_batch(c.q, c.cu, self.varlen)
        opts = {
            **_options(c.q, self.tbm, self.tbn, bwd=True, varlen=self.varlen),
            "VARLEN": self.varlen,
        }
        delta_shape = self.delta_shape
        delta = torch.empty(delta_shape, device=c.q.device, dtype=torch.float32)
        prep = plan_preprocess(c.o, c.do, c.dlse, delta, c.q, c.q, self.scale, prescale_q=False)
        prep(c.o, c.do, c.dlse, delta, c.q, c.q)
        sizes = (hq, hq // hkv, nq, nk, self.scale)
        strides = (*c.q.stride(), *c.k.stride(), *c.v.stride(), *c.do.stride())
        dkdv_mid = (*strides, *c.dk.stride(), *c.dv.stride())
        dkdv_tail = (*self.q_strides, hkv, *sizes[1:])
        k_blocks = grid_blocks(nk, c.q_tables[0], self.tbn, opts["BLOCK_N"], self.varlen)
        dkdv_grid = (k_blocks, b * hkv, 1)
        dkdv = bind_triton(
            KF._flex_bwd_dkdv_kernel,
            dkdv_grid,
            (
                c.q,
                c.k,
                c.v,
                c.do,
                c.dk,
                c.dv,
                c.lse,
                delta,
                *dkdv_mid,
                *c.q_tables,
                *dkdv_tail,
                *c.cu,
                *c.bufs,
            ),
            self.mods,
            opts,
        )
        dq_mid = (*strides, *c.dq.stride())
        dq_tail = (*self.kv_strides, *sizes)
        q_blocks = grid_blocks(nq, c.kv_tables[0], self.tbm, opts["BLOCK_M"], self.varlen)
        dq_grid = (q_blocks, b * hq, 1)
        dq_run = bind_triton(
            KF._flex_bwd_dq_kernel,
            dq_grid,
            (
                c.q,
                c.k,
                c.v,
                c.do,
                c.dq,
                c.lse,
                delta,
                *dq_mid,
                *c.kv_tables,
                *dq_tail,
                *c.cu,
                *c.bufs,
            ),
            self.mods,
            opts,
        )

        def run(c: BwdCall) -> None:
            delta = torch.empty(delta_shape, device=c.q.device, dtype=torch.float32)
            prep(c.o, c.do, c.dlse, delta, c.q, c.q)
            dkdv(
                dkdv_grid,
                c.q,
                c.k,
                c.v,
                c.do,
                c.dk,
                c.dv,
                c.lse,
                delta,
                *dkdv_mid,
                *c.q_tables,
                *dkdv_tail,
                *c.cu,
                *c.bufs,
            )
            dq_run(
                dq_grid,
                c.q,
                c.k,
                c.v,
                c.do,
                c.dq,
                c.lse,
                delta,
                *dq_mid,
                *c.kv_tables,
                *dq_tail,
                *c.cu,
                *c.bufs,
            )

        return run
