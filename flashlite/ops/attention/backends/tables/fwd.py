"""The forward over block tables: flex's kernels (the Hopper one where it applies, else Triton's),
planned once per kind of call (:class:`FwdPlan`); the body of ``flashlite::flex_attention_fwd``
(:func:`flex_fwd_body`) and the built-in window's plan over its band's tables
(:func:`plan_window_fwd`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flashlite._caches import register
from flashlite.kernels import configs as C
from flashlite.kernels.attention import flex as KF
from flashlite.kernels.attention import hopper as KH
from flashlite.masking.band import band_tables
from flashlite.masking.mod_args import ModArgs, Slots
from flashlite.ops.attention.backends.common import (
    descriptor_ok,
    empty_output,
    hopper_config,
    hopper_launch_config,
)
from flashlite.ops.attention.backends.common_gluon import first_build
from flashlite.ops.attention.backends.tables import args as FA
from flashlite.ops.attention.backends.tables.args import (
    Offsets,
    bind_triton,
    gluon_takes,
    grid_batch,
    grid_blocks,
    head_linear_bias,
    mod_args,
    plan_options,
    table_args,
    table_request,
)
from flashlite.ops.attention.backends.tables.gluon import plan_flex_fwd
from flashlite.ops.attention.plan import LaunchInfo, Plan
from flashlite.ops.attention.request import Request


def flex_fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    call = FA.table_call(request)  # (its refusal of what flex does not take, empty calls too)
    if q.numel() == 0 or (call.cu is not None and k.shape[2] == 0):
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        return torch.zeros_like(q), lse.fill_(-math.inf)
    return _plan(q, k, v, call)(q, k, v, call.tables[:4], call.tensors, call.cu)


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: FA.TableCall) -> FwdPlan:
    """The call's :class:`FwdPlan`, made at its kind's first call."""
    key = tuple(FA.call_key(q, k, v, call))
    plan = FA.fwd_plans.get(key)
    if plan is None:
        tables = call.tables[:4]
        mask, score, scale, varlen = call.mask, call.score, call.scale, call.cu is not None
        plan = FwdPlan(q, k, tables, mask, score, call.tbm, call.tbn, scale, varlen=varlen)
        FA.fwd_plans.put(key, plan)
    return plan


def plan_window_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request, config: KH.HopperConfig
) -> Plan:
    """The plan of a window forward (a request of a window and nothing else) on non-empty
    ``(B, H, N, D)`` views of these kinds: flex's forward over the band's tables, in tiles of
    the Gluon forward's ``config`` (its grid; the flex plan falls back to Triton's kernel where
    the Gluon one fails to build)."""
    nq, nk = q.shape[2], k.shape[2]
    block = (config.block_m, config.block_n)
    band = band_tables(request.mask.kernel(nq, nk), nq, nk, block, q.device)
    call = FA.table_call(table_request(band, request.scale))
    flex, tables, tensors = _plan(q, k, v, call), call.tables[:4], call.tensors

    def run(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
        flex(q, k, v, tables, tensors, out=(o, lse))

    grid = (C.cdiv(nq, config.block_m), q.shape[0] * q.shape[1], 1)
    info = LaunchInfo(hopper_launch_config(config), q.shape[-1], True)
    return Plan("tables", run, block, True, grid, info=info)


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
        self.gluon = gluon_takes(mask)
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
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            o = (
                torch.empty_like(q)
                if v.shape[3] == q.shape[3]
                else empty_output(q, None, v.shape[3])
            )
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        else:  # (a window's launcher allocated them, strided as its plan's key says)
            o, lse = out
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
        gluon = self.gluon and not self.varlen and v.shape[3] == q.shape[3]
        config = hopper_config(q, k.shape[2]) if gluon else None
        if (
            config is not None
            and (self.tbm, self.tbn) == (config.block_m, config.block_n)
            and descriptor_ok(q, k, v, o)
        ):
            run = self._first_hopper(q, k, v, o, lse, tables, bufs, config)
            if run is not None:
                return run
        return self._first_triton(q, k, v, o, lse, tables, bufs, cu)

    def _first_hopper(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        bufs: list[Any],
        config: KH.HopperConfig,
    ) -> Callable[..., None] | None:
        """The Gluon kernel, built and launched (None, after one warning, where it fails to
        build here)."""
        key = (q.dtype, q.shape[-1], *self.hopper_mods.values())
        scale, mods = self.scale, self.hopper_mods

        def build() -> Callable[..., None]:
            return plan_flex_fwd(q, k, v, o, lse, tables, self.strides, scale, config, bufs, mods)

        run = first_build(hopper_failed, key, "flex", build, stacklevel=7)
        if run is None:
            return None

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

    def _first_triton(
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
        """The Triton kernel, launched, and its bound launch."""
        hq, nq = q.shape[1], q.shape[2]
        hkv, nk = k.shape[1], k.shape[2]
        opts = plan_options(q, self.tbm, self.tbn, False, self.varlen, v.shape[3])
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
