"""What the planner decides for one kind of attention call, as data: :class:`Plan`.

The planner (:mod:`~flashlite.ops.attention.planner`) makes a plan; a backend fills in its tiles,
grid, scratch and bound launch; the launchers (:func:`~flashlite.ops.attention.ops.attention_fwd`,
:func:`~flashlite.ops.attention.ops.attention_bwd`) call ``plan.launch`` and the traffic tools read
the rest (:class:`LaunchInfo`). A plan made for one kind of call (shapes, strides, dtype, device,
alignment, the request's key) is kept and reused by every later call of that kind. This module
imports nothing of the front-end: every backend may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from flashlite.kernels import configs as C


@dataclass(frozen=True)
class LaunchInfo:
    """What one kernel launch used (read by the traffic tools and the benchmark)."""

    config: C.Config
    block_d: int
    use_desc: bool


class Workspace(NamedTuple):
    """Scratch memory a launch allocates per call besides its outputs (split partials, the
    backward's delta, a dQ accumulator)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(eq=False, slots=True)
class Plan:
    """One kind of call, planned.

    Attributes:
        backend: what runs it: ``"triton"``, ``"hopper"`` (the dense Gluon kernels),
            ``"tables"`` (flex's kernels over a band's block tables), ``"split_kv"`` (the decode
            kernel and its merge) or ``"empty"`` (nothing to compute).
        launch: the bound launch. A forward's is ``launch(q, k, v, o, lse, request)`` into the
            fresh ``o`` and ``lse``; a backward's ``launch(do, q, k, v, o, lse, dlse, request,
            dsinks)`` returns ``(dq, dk, dv)``.
        config: the tile: a :class:`~flashlite.kernels.configs.Config`, a Gluon
            ``HopperConfig``, a :class:`~flashlite.kernels.configs.BwdConfig`, a decode tile,
            or the tables' ``(block_m, block_n)``; None where the autotuner picks at the first
            launch (it is filled in then).
        use_desc: the kernel loads through TMA descriptors.
        grid: the main kernel's grid; None where each launch works it out (the autotuner's
            tile, a backward planned per call) or nothing launches.
        splits: key chunks per row block (split-KV), else 1.
        workspaces: scratch each launch allocates (:class:`Workspace`).
        info: what the launch reports (:class:`LaunchInfo`: the traffic tools and the
            benchmarks read it), None when nothing runs.
        fallback: a Gluon plan's Triton plan, made (and become, after one warning) only if
            the Gluon kernel fails to build with this Triton.
    """

    backend: str
    launch: Callable[..., Any]
    config: Any = None
    use_desc: bool = False
    grid: tuple[int, ...] | None = None
    splits: int = 1
    workspaces: tuple[Workspace, ...] = ()
    info: LaunchInfo | None = None
    fallback: Callable[[], Plan] | None = None

    def become(self, other: Plan) -> None:
        """Take ``other``'s decision in place (a Gluon plan whose kernel did not build: its
        keepers then hold what really runs)."""
        for name in Plan.__slots__:
            setattr(self, name, getattr(other, name))
