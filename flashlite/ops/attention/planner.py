"""Which backend runs an attention call: the forward's and the backward's decision trees, each
read top to bottom, each branch saying why.

A :class:`~flashlite.ops.attention.request.Request` and the tensors' facts (shapes, device,
strides, alignment) go in; a :class:`Choice` comes out, which the launchers
(:func:`~flashlite.ops.attention.fwd.attention_fwd`,
:func:`~flashlite.ops.attention.bwd.attention_bwd`) carry out. The backends:

==============  ==============================================================================
``split_kv``    the decode kernel: few query rows (GQA heads packed), the keys split across
                programs, the partial results merged exactly (:mod:`.backends.split_kv`)
``tables``      flex's Gluon kernels over a block table; the built-in window as its band's
                table (:mod:`.backends.tables`)
``hopper``      the dense Gluon kernels (sm_90; :mod:`.backends.hopper`); a variant that
                fails to build here falls back to ``triton`` after one warning
``triton``      the Triton kernels: every option, every GPU and the CPU's interpreter
                (:mod:`.backends.triton`)
``plain``       (backward) the plain backward, planned at its first call: the fused Gluon
                kernel where it builds, else the Triton pair
``empty``       nothing to compute (no rows, or no keys: rows see only their sinks)
==============  ==============================================================================

Each backend takes only the requests it is written for (:meth:`Request.only`), so a new option
falls to the Triton kernels until a faster one supports it, and is never dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashlite.kernels import configs as C
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.attention.backends.common import (
    DESC_MIN_WORK,
    descriptor_ok,
    hopper_bwd_applies,
    hopper_config,
    hopper_entry,
    hopper_launch_config,
    small_problem,
)
from flashlite.ops.attention.backends.triton.config import GPU_TABLES, table_config
from flashlite.ops.attention.request import Request

#: The fields the split-KV path takes (not packed sequences: those run the forward kernel).
DECODE_FIELDS = (
    "scale",
    "causal",
    "window_left",
    "window_right",
    "softcap",
    "seqlens_k",
    "num_splits",
    "sinks",
)


class Choice(NamedTuple):
    """What runs a call: the backend, whether the kernel loads through TMA descriptors, and the
    Gluon kernels' tile (a forward's :class:`~flashlite.kernels.attention.hopper.HopperConfig`,
    the backward's table block ``(block_m, block_n)``)."""

    backend: str
    use_desc: bool = False
    tile: KH.HopperConfig | tuple[int, int] | None = None


class Facts(NamedTuple):
    """What the forward's tree reads of a call: of its tensors (:meth:`of`, the launcher's) or
    of a GPU it models (:meth:`on_gpu`, the traffic tools'), so both read one decision."""

    #: no query row, or no key (rows then see only their sinks)
    empty: bool
    #: enough work for TMA descriptors to pay: ``B·Hq·Nq·Nk·D`` of at least ``DESC_MIN_WORK``
    tma_pays: bool
    #: tensors TMA can read: on a CUDA device, unit stride along D, 16-byte aligned
    tma_reads: bool
    #: the dense Gluon forward's tile where it builds for this problem (sm_90), else None
    gluon: KH.HopperConfig | None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Facts:
        """The facts of ``(B, H, N, D)`` views on this machine."""
        return cls(
            _nothing(q, k),
            not small_problem(q, k),
            descriptor_ok(q, k, v),
            hopper_config(q, k.shape[2]),
        )

    @classmethod
    def on_gpu(cls, gpu: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> Facts:
        """The facts of a problem ``(B, Hq, Nq, Nk, D)`` of dense, aligned tensors on ``gpu``
        (:data:`GPU_TABLES`: ``"h200"`` runs the Gluon kernels where they apply)."""
        b, hq, nq, nk, d = shape
        work = b * hq * nq * nk * d
        gluon = hopper_entry(dtype, d, nk) if gpu == "h200" else None
        return cls(work == 0, work >= DESC_MIN_WORK, True, gluon)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    request: Request,
    *,
    config: object = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> Choice:
    """The forward's backend for ``(B, H, N, D)`` views (``config``, ``use_desc``,
    ``prescale_q``: the caller's pins, which the fast paths leave to the Triton kernel)."""
    if request.num_splits and request.varlen is None:
        # few query rows against many keys: one tile of a GQA group's heads, the keys split
        request.refuse("split-KV decoding", DECODE_FIELDS)
        return Choice("split_kv")
    pins = (config, use_desc, prescale_q)
    return dense(Facts.of(q, k, v), request, *pins)


def dense(
    facts: Facts,
    request: Request,
    config: object = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> Choice:
    """The forward's tree past split-KV, from the call's :class:`Facts` alone."""
    pinned = config is not None or use_desc is not None or prescale_q is not None
    if not pinned and not request.plain and request.only("window_left", "window_right"):
        # a window and nothing else: on Hopper, flex's Gluon kernel over the band's tables
        tile = window_fwd_config(facts)
        if tile is not None:
            return Choice("tables", True, tile)
    if facts.empty:
        return Choice("empty")
    if use_desc is None:
        # descriptors cost host time per call: they pay from about a billion multiply-adds
        use_desc = facts.tma_pays and facts.tma_reads
    unpinned = config is None and prescale_q is not False
    if request.only("sinks") and use_desc and unpinned and facts.gluon is not None:
        # plain (or causal, sinks allowed) on sm_90: the dense Gluon kernel, where it builds
        return Choice("hopper", True, facts.gluon)
    return Choice("triton", use_desc)


def gpu_config(
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    causal: bool,
    gpu: str = "h200",
) -> tuple[C.Config, bool]:
    """The tile config a GPU runs for a plain (or causal) forward, known without one: what the
    traffic tools count and model (the interpreter runs any tile), read from :func:`dense`'s
    choice on :meth:`Facts.on_gpu`.

    Args:
        shape: ``(B, Hq, Nq, Nk, D)``.
        dtype: the inputs' dtype.
        causal: the mask.
        gpu: ``"h200"`` or ``"generic"`` (:data:`GPU_TABLES`).

    Returns:
        The config (the pinned one when ``$FLASHLITE_ATTENTION_CONFIG`` is set) and whether that
        GPU loads through tensor descriptors. Where the H200 runs the Gluon kernel, its tiles as
        a ``warp_specialize`` config: the Triton kernel with those tiles issues the same bytes
        (Q and O once, K and V once per 128-row block), so the interpreter counts them.
    """
    if gpu not in GPU_TABLES:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(map(repr, GPU_TABLES))}")
    choice = dense(Facts.on_gpu(gpu, shape, dtype), Request(1.0, causal))  # (scale: no choice)
    if choice.backend == "hopper":
        return hopper_launch_config(choice.tile), True  # type: ignore[arg-type]
    return table_config(shape[4], causal, dtype, choice.use_desc, gpu == "h200"), choice.use_desc


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    request: Request,
    *,
    pinned: bool = False,
) -> Choice:
    """The backward's backend (``pinned``: the caller's tile config, which only the Triton pair
    takes): ``plain`` is the planned plain backward, whose first call picks the fused Gluon
    kernel or the Triton pair (:class:`~flashlite.ops.attention.bwd.BwdPlan`)."""
    if _nothing(q, k):
        return Choice("empty")
    if pinned:
        return Choice("triton")
    if request.only("sinks"):
        # plain (sinks' gradient beside it): planned once per kind of tensors
        return Choice("plain")
    if request.only("window_left", "window_right"):
        # a window and nothing else: the fused flex backward over its band, where it applies
        block = window_bwd_block(q, k, v, do)
        if block is not None:
            return Choice("tables", True, block)
    return Choice("triton")


def _nothing(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query row, or no key (rows then see only their sinks)."""
    return q.shape[0] * q.shape[1] * q.shape[2] == 0 or k.shape[2] == 0


def window_fwd_config(facts: Facts) -> KH.HopperConfig | None:
    """The Gluon forward's config where a window forward runs the flex Hopper kernel over its
    band's tables, else None: the dense forward's rule (enough work for TMA to pay, tensors TMA
    can read, the Gluon kernel built for the problem)."""
    return facts.gluon if facts.tma_pays and facts.tma_reads else None


def window_bwd_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor
) -> tuple[int, int] | None:
    """The tables' tile where a window backward of these views runs the fused flex backward
    (:func:`~flashlite.ops.attention.backends.common.hopper_bwd_applies`; its gradients are
    allocated like ``q``, ``k`` and ``v``), else None."""
    return (2 * KHB.BLOCK_M, KHB.BLOCK_N) if hopper_bwd_applies(q, k, v, do, k, v) else None
