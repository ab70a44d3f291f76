"""What runs the ring outside training: the loopback process groups that the tests, the demo and
the benchmark start (:func:`init_for_tests`, with :data:`DEFAULT_TIMEOUT`), and the count of
the ring's transfers (:func:`count_p2p`) that its model (:func:`comm_model`) is checked
against. Re-exported by :mod:`flashlite.distributed.ring`."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

#: What to pass to ``init_process_group`` so that a peer that dies cannot hang the others.
DEFAULT_TIMEOUT = timedelta(seconds=120)


def comm_model(
    world: int,
    batch: int,
    kv_heads: int,
    n_local: int,
    head_dim: int,
    elem_bytes: int,
    backward: bool = False,
) -> list[dict[str, object]]:
    """Bytes one rank sends (and receives: the ring is symmetric) per transfer, in order: the
    forward sends its key/value shard on at steps ``0 … P−2`` (``2·B·Hkv·n·D·b`` each); the
    backward sends the shard on the same way and, after every step ``0 … P−1``, the fp32
    ``dK, dV`` accumulators (``2·B·Hkv·n·D·4``), the last send bringing them home. Totals per
    rank: forward ``(P−1)·2·B·Hkv·n·D·b``; backward that plus ``P·2·B·Hkv·n·D·4``."""
    kv = 2 * batch * kv_heads * n_local * head_dim * elem_bytes
    dkv = 2 * batch * kv_heads * n_local * head_dim * 4
    if not backward:
        return [{"pass": "forward", "step": s, "what": "kv", "bytes": kv} for s in range(world - 1)]
    out: list[dict[str, object]] = []
    for s in range(world):
        if s < world - 1:
            out.append({"pass": "backward", "step": s, "what": "kv", "bytes": kv})
        out.append({"pass": "backward", "step": s, "what": "dkv", "bytes": dkv})
    return out


@contextlib.contextmanager
def count_p2p() -> Iterator[list[tuple[int, int]]]:
    """Inside the block, every ``torch.distributed.batch_isend_irecv`` call (the ring's
    transfers) logs ``(bytes sent, bytes received)`` to the list it yields: the count that
    :func:`comm_model` is checked against."""
    log: list[tuple[int, int]] = []
    real = dist.batch_isend_irecv

    def counted(ops: list) -> list:
        sent = sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend)
        got = sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.irecv)
        log.append((sent, got))
        return real(ops)

    dist.batch_isend_irecv = counted
    try:
        yield log
    finally:
        dist.batch_isend_irecv = real


def free_port() -> int:
    """A free TCP port on the loopback interface, for :func:`init_for_tests`'s rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_for_tests(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """A process group on the loopback interface with a timeout (the tests, the demo and the
    benchmark, each starting its own processes)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=DEFAULT_TIMEOUT,
    )
