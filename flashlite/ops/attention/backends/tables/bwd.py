"""The backward over block tables: the preprocess, then flex's fused Hopper backward where it
applies, else the Triton pair, planned once per kind of call (:class:`BwdPlan`); the body of
``flashlite::flex_attention_bwd`` (:func:`flex_bwd_body`) and the built-in window's
(:func:`plan_window_bwd`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flashlite._caches import register
from flashlite.kernels.attention import flex as KF
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.masking.band import band_tables
from flashlite.masking.mod_args import ModArgs, Slots
from flashlite.ops.attention.backends.common import (
    descriptor_ok,
    hopper_bwd_applies,
    plan_preprocess,
)
from flashlite.ops.attention.backends.common_gluon import first_build
from flashlite.ops.attention.backends.tables import args as FA
from flashlite.ops.attention.backends.tables.args import (
    Grads,
    Offsets,
    bind_triton,
    gluon_takes,
    grid_batch,
    grid_blocks,
    mod_args,
    plan_options,
    table_args,
    table_request,
)
from flashlite.ops.attention.backends.tables.gluon import plan_flex_bwd
from flashlite.ops.attention.plan import Plan
from flashlite.ops.attention.request import Request


def flex_bwd_body(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = FA.table_call(request)
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    key = FA.call_key(q, k, v, call, (do, o, lse, dlse))
    key += (
        do.stride(),
        o.stride(),
        lse.stride(),
        dlse is None,
        torch.are_deterministic_algorithms_enabled(),
    )
    key = tuple(key)
    kv_tables, q_tables, cu = call.tables[:4], call.tables[4:], call.cu
    plan = FA.bwd_plans.get(key)
    if plan is None:
        mask, score, tbm, tbn, scale = call.mask, call.score, call.tbm, call.tbn, call.scale
        plan = BwdPlan(q, k, q_tables, kv_tables, mask, score, tbm, tbn, scale, cu is not None)
        FA.bwd_plans.put(key, plan)
    return plan(do, q, k, v, o, lse, dlse, q_tables, kv_tables, call.tensors, cu)


def plan_window_bwd(request: Request, block: tuple[int, int]) -> Plan:
    """The plan of a window backward (a request of a window and nothing else) where the fused
    flex backward applies: flex's backward over the band's tables of ``block`` tiles, launched
    per call (the flex plan underneath is kept per kind)."""

    def launch(
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        dlse: Tensor | None,
        request: Request,
        dsinks: Tensor | None,
    ) -> Grads:
        nq, nk = q.shape[2], k.shape[2]
        band = band_tables(request.mask.kernel(nq, nk), nq, nk, block, q.device)
        return flex_bwd_body(do, q, k, v, o, lse, dlse, table_request(band, request.scale))

    return Plan("tables", launch, block, True)


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
        self.gluon = gluon_takes(mask)
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
        applies (as the dense backward's, :func:`~flashlite.ops.attention.backends.common.
        hopper_bwd_applies`, with tables of its 128 × 128 tiles, not varlen): the preprocess
        writes delta, ``Qs`` into ``dq``'s memory and zeros into dQ's fp32 accumulator, then
        one kernel adds every gradient. Else (or after one warning if it failed to build) the
        preprocess and the two Triton kernels (they overwrite ``dq``)."""
        tiles = (self.tbm, self.tbn) == (2 * KHB.BLOCK_M, KHB.BLOCK_N)
        fused = tiles and not self.varlen and self.gluon
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
            return plan_flex_bwd(
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

        main = first_build(hopper_bwd_failed, key, "flex backward", build, stacklevel=7)
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
            **plan_options(c.q, self.tbm, self.tbn, True, self.varlen, c.v.shape[3]),
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
        dq_mid = (*strides, *c.dq.stride())
        dq_tail = (*self.kv_strides, *sizes)
        q_blocks = grid_blocks(nq, c.kv_tables[0], self.tbm, opts["BLOCK_M"], self.varlen)
        dq_grid = (q_blocks, b * hq, 1)

        def dkdv_args(c: BwdCall, delta: torch.Tensor) -> tuple:
            lead = (c.q, c.k, c.v, c.do, c.dk, c.dv, c.lse, delta)
            return (*lead, *dkdv_mid, *c.q_tables, *dkdv_tail, *c.cu, *c.bufs)

        def dq_args(c: BwdCall, delta: torch.Tensor) -> tuple:
            lead = (c.q, c.k, c.v, c.do, c.dq, c.lse, delta)
            return (*lead, *dq_mid, *c.kv_tables, *dq_tail, *c.cu, *c.bufs)

        kernels = (KF._flex_bwd_dkdv_kernel, KF._flex_bwd_dq_kernel)
        dkdv = bind_triton(kernels[0], dkdv_grid, dkdv_args(c, delta), self.mods, opts)
        dq_run = bind_triton(kernels[1], dq_grid, dq_args(c, delta), self.mods, opts)

        def run(c: BwdCall) -> None:
            delta = torch.empty(delta_shape, device=c.q.device, dtype=torch.float32)
            prep(c.o, c.do, c.dlse, delta, c.q, c.q)
            dkdv(dkdv_grid, *dkdv_args(c, delta))
            dq_run(dq_grid, *dq_args(c, delta))

        return run
