"""Ring attention over ``torch.distributed``: each rank keeps its query shard, the key/value
shards travel around the ring, and every step's partial ``(o, lse)`` is merged exactly with
:func:`flashlite.stats.merge_attention` (the merge is associative, so the order the shards
arrive in does not matter).

Causal attention is balanced with zigzag shards: the sequence is cut into ``2P`` chunks and rank
``r`` holds chunks ``r`` and ``2P − 1 − r``. At the step where rank ``r`` holds the keys of rank
``j``, only these blocks see any key (everything else is skipped, not computed):

* ``j == r``: the local shard against itself, causally (its two chunks are in order);
* ``j < r``:  all local queries against ``j``'s first chunk, unmasked;
* ``j > r``:  the local second chunk against both of ``j``'s chunks, unmasked.

So every non-local step costs the same (``2c × c`` scores for chunks of ``c`` tokens). The
backward sends each key/value shard around again, with fp32 accumulators of its ``dK, dV`` that
arrive back at their owner after the last step. Each transfer is started before the step's
attention and waited for after it, so the two overlap.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashlite import stats
from flashlite.distributed.harness import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from flashlite.distributed.harness import comm_model as comm_model
from flashlite.distributed.harness import count_p2p as count_p2p
from flashlite.distributed.harness import free_port as free_port
from flashlite.distributed.harness import init_for_tests as init_for_tests
from flashlite.distributed.sequence import (
    check_shards,
    gather_sequence,
    group_info,
    shard_sequence,
)
from flashlite.masking import masks
from flashlite.ops._dispatch import Op
from flashlite.ops.attention import (
    Request,
    attention_bwd,
    attention_fwd,
    check_inputs,
    check_sinks,
)
from flashlite.ops.attention.backends.common_bwd import sink_grad
from flashlite.ops.common import check_flags


def _exchange(
    send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup | None
) -> list:
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for req in requests:
        req.wait()


def _blocks(rank: int, src: int, causal: bool, zigzag: bool, n: int) -> tuple | None:
    """Which block of this step is computed: ``(q rows, kv rows, mask)`` as slices of the
    local query shard and of the visiting key/value shard and its :class:`~flashlite.masks.Mask`
    (causal or none), or None when no query sees a key."""
    everything = slice(0, n)
    if not causal:
        return everything, everything, masks.NO_MASK
    if src == rank:
        return everything, everything, masks.CAUSAL
    if not zigzag:  # contiguous shards: earlier ranks' keys are all visible, later ones none
        return (everything, everything, masks.NO_MASK) if src < rank else None
    half = n // 2
    if src < rank:  # both local chunks come after the visitor's first chunk, before its second
        return everything, slice(0, half), masks.NO_MASK
    # our second chunk comes after both of its chunks
    return slice(half, n), everything, masks.NO_MASK


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    causal: bool,
    scale: float,
    zigzag: bool,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of the local queries ``(B, Hq, n, D)`` against every rank's keys. The
    running result starts as the merge's identity (o = 0, lse = −inf), or with ``sinks`` as the
    sink's own state (o = 0, lse = sink): merged once, whichever shards arrive."""
    rank, size, nxt, prv = group_info(group)
    n = q.shape[2]
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if sinks is None:
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    else:
        lse = sinks.view(1, -1, 1).expand(q.shape[:3]).contiguous()
    # one contiguous message per step (point-to-point sends need contiguous tensors, and the
    # "b n h d" shards arrive here as strided "b h n d" views): one O(n) copy per call
    kv = torch.stack([k, v])
    for step in range(size):
        src = (rank - step) % size
        pending = None
        if step < size - 1:  # the next shard travels while this one is attended to
            incoming = torch.empty_like(kv)
            pending = _exchange(kv, incoming, nxt, prv, group)
        block = _blocks(rank, src, causal, zigzag, n)
        if block is not None:
            rows, cols, blk_mask = block
            o_part, lse_part, _ = attention_fwd(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                Request.of_mask(blk_mask, scale),
            )
            o[:, :, rows], lse[:, :, rows] = stats.merge_attention(
                o[:, :, rows], lse[:, :, rows], o_part, lse_part
            )
        if pending is not None:
            _wait(pending)
            kv = incoming
    return o.to(q.dtype), lse


def _ring_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    causal: bool,
    scale: float,
    zigzag: bool,
    sinks: torch.Tensor | None = None,
    dsinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the local shards. Each step's block gets its share of the gradient
    from the *global* ``o`` and ``lse`` (the kernels recompute ``P = e^(S − lse)``), so the
    blocks' contributions add up to the exact gradient. With ``sinks``, ``dsinks`` receives the
    local rows' share of their gradient (the global LSE holds the sink)."""
    if sinks is not None:
        delta = (do.float() * o.float()).sum(-1)
        sink_grad(sinks, lse, delta if dlse is None else delta - dlse.float(), dsinks)
    rank, size, nxt, prv = group_info(group)
    n = q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with kv
    dkv_pending, dkv_in, kv_in = None, dkv, kv
    for step in range(size):
        src = (rank - step) % size
        kv_pending = None
        if step < size - 1:  # (the last step's keys are not needed anywhere)
            kv_in = torch.empty_like(kv)
            kv_pending = _exchange(kv, kv_in, nxt, prv, group)
        block = _blocks(rank, src, causal, zigzag, n)
        parts = None
        if block is not None:
            rows, cols, blk_mask = block
            dq_p, dk_p, dv_p = attention_bwd(
                do[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                o[:, :, rows],
                lse[:, :, rows],
                None if dlse is None else dlse[:, :, rows],
                Request.of_mask(blk_mask, scale),
            )
            # in place, fp32 += bf16 without an fp32 copy of the partial (memory is the limit
            # on the longest sequence a ring trains)
            dq[:, :, rows].add_(dq_p)
            del dq_p
            parts = (cols, dk_p, dv_p)
        if dkv_pending is not None:  # the accumulator of src, sent on during this step's work
            _wait(dkv_pending)
            # drop the works too: they may hold the sent buffer, which must be freed before
            # the next receive buffer is made
            dkv, dkv_pending = dkv_in, None
        if parts is not None:
            cols, dk_p, dv_p = parts
            dkv[0][:, :, cols].add_(dk_p)
            dkv[1][:, :, cols].add_(dv_p)
            del parts, dk_p, dv_p
        # the accumulators move on after every step: after the last one they are home
        dkv_in = torch.empty_like(dkv)
        dkv_pending = _exchange(dkv, dkv_in, nxt, prv, group)
        if kv_pending is not None:
            _wait(kv_pending)
            kv = kv_in
    del kv, kv_in  # the last visitor: its memory serves the conversions below
    _wait(dkv_pending)  # type: ignore[arg-type]
    dkv = dkv_in
    # (copies: dK and dV must not share the accumulator's storage)
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


def _group_name(group: dist.ProcessGroup | None) -> str:
    return (group if group is not None else dist.group.WORLD).group_name  # type: ignore[union-attr]


def _resolve(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group  # private, stable

    return _resolve_process_group(group_name)


class RingRequest(NamedTuple):
    """One ring call beyond its shards, as the ring's ops take it by name: the process group
    (by name: an op's arguments are plain values), the scale, causal, the zigzag layout and the
    fp32 ``(Hq,)`` sinks."""

    group_name: str
    scale: float
    causal: bool = False
    zigzag: bool = True
    sinks: torch.Tensor | None = None


def _ring_fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: RingRequest
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring as an op (its collectives inside, opaque to tracing): ``(o, lse)``,
    ``o`` contiguous ``(B, Hq, n, D)``."""
    group = _resolve(request.group_name)
    o, lse = _ring_forward(
        q, k, v, group, request.causal, request.scale, request.zigzag, request.sinks
    )
    return o.contiguous(), lse


def _ring_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: RingRequest
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _ring_bwd_body(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: RingRequest,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward ring as an op: ``(dq, dk, dv)``, contiguous, and the sinks' fp32
    gradient (``(Hq,)``, or ``(0,)`` without sinks)."""
    sinks = request.sinks
    dsinks = lse.new_empty((0,) if sinks is None else sinks.shape)
    group = _resolve(request.group_name)
    grads = _ring_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        dlse,
        group,
        request.causal,
        request.scale,
        request.zigzag,
        sinks,
        dsinks,
    )
    return (*(g.contiguous() for g in grads), dsinks)  # type: ignore[return-value]


def _ring_bwd_fake(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: RingRequest,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = lse.new_empty((0,) if request.sinks is None else request.sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


#: ``flashlite::ring_attention_bwd``: the backward ring, ``(dq, dk, dv)`` contiguous and the
#: sinks' gradient.
RING_BWD = Op(
    "ring_attention_bwd",
    _ring_bwd_body,
    fake=_ring_bwd_fake,
    inputs=7,
    request=RingRequest,
    moves=False,
)


def _setup_context(ctx, inputs, request: RingRequest, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, request.sinks)
    ctx.request = request._replace(sinks=None)  # (the sinks travel as a saved tensor)


def _backward(ctx, do, dlse):  # type: ignore[no-untyped-def]
    q, k, v, o, lse, sinks = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    request = ctx.request if sinks is None else ctx.request._replace(sinks=sinks)
    dq, dk, dv, dsinks = RING_BWD(do, q, k, v, o, lse, dlse, request)
    return (dq, dk, dv), {"sinks": None if sinks is None else dsinks.to(sinks.dtype)}


#: ``flashlite::ring_attention_fwd``: the forward ring (its collectives inside, opaque to
#: tracing), ``(o, lse)``, differentiable in q, k, v, the sinks and through the LSE.
RING_FWD = Op(
    "ring_attention_fwd",
    _ring_fwd_body,
    fake=_ring_fwd_fake,
    inputs=3,
    request=RingRequest,
    grad_fields=("sinks",),
    setup_context=_setup_context,
    backward=_backward,
    materialize_grads=False,
    moves=False,
)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "b n h d",
    return_lse: bool = False,
    zigzag: bool = True,
    validate: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's query shard against the whole sequence, whose key/value
    shards travel around the ranks of ``group`` (forward and backward).

    Args:
        q: ``(B, n, Hq, D)`` this rank's shard (``layout="b h n d"``: ``(B, Hq, n, D)``), as
            :func:`shard_sequence` cuts it; k, v: ``(B, n, Hkv, D)`` likewise (GQA: ``Hq`` a
            multiple of ``Hkv``).
        group: the ranks that share the sequence (default: the world).
        causal: causal over the *global* positions; the shards must be zigzag ones
            (``zigzag=True``) or contiguous ones (``zigzag=False``, unbalanced).
        scale, layout, return_lse: as :func:`flashlite.attention`.
        validate: check that every rank's shards have one length and one device kind (one
            small all-gather per call).
        sinks: ``(Hq,)`` sink logits, as :func:`flashlite.attention`, the same on every rank:
            the ring's running result starts from them, so they are merged once. Their
            gradient on each rank is its own rows' share (as for every weight under sequence
            parallelism: the data-parallel reduction sums the shares).

    Returns:
        This rank's output shard in ``q``'s layout (and the fp32 LSE ``(B, Hq, n)``).

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: shards of different lengths or device kinds across ranks, an odd local
            length for zigzag shards, and everything :func:`flashlite.attention` rejects.
    """
    check_flags(causal=causal, return_lse=return_lse, zigzag=zigzag, validate=validate)
    group_info(group)
    sm_scale, qc, kc, vc = check_inputs(q, k, v, layout, scale)
    if qc.shape[2] != kc.shape[2]:
        raise ValueError(
            f"q and k/v shards must have one length, got {qc.shape[2]} and {kc.shape[2]}"
        )
    if zigzag and causal and qc.shape[2] % 2:
        raise ValueError(f"zigzag shards hold two equal chunks: local length {qc.shape[2]} is odd")
    if validate and not torch.compiler.is_compiling():
        check_shards(qc, 2, group, "q")
    sink = None if sinks is None else check_sinks(sinks, qc, qc.shape[1])
    request = RingRequest(_group_name(group), sm_scale, causal, zigzag, sink)
    o, lse = RING_FWD(qc, kc, vc, request)
    if layout != "b h n d":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


__all__ = ["gather_sequence", "ring_attention", "shard_sequence"]
