"""A sequence split across the ranks of a process group: :func:`shard_sequence` (zigzag chunks
for balanced causal attention, or contiguous ones), :func:`gather_sequence` (its inverse), and
the checks the ring makes of its shards."""

from __future__ import annotations

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- groups
def group_info(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(rank, size, next, prev)``: this rank in ``group`` and its ring neighbours' global
    ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flashlite.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' for CPU tensors, 'nccl' for CUDA) "
            "first, e.g. under torchrun, or see flashlite.distributed.demo"
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    prv = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    return rank, size, nxt, prv


def check_shards(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank's shard has one length along ``dim`` and one device type (one small
    all-gather)."""
    size = dist.get_world_size(group)
    mine = torch.tensor([x.shape[dim], 0 if x.device.type == "cpu" else 1], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.to(x.device)
    seen = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(seen, mine, group=group)
    lengths = [int(t[0]) for t in seen]
    kinds = {int(t[1]) for t in seen}
    if len(set(lengths)) > 1:
        raise ValueError(f"{what} shards must have one length on every rank; ranks hold {lengths}")
    if len(kinds) > 1:
        raise ValueError(
            f"{what} shards must be on one kind of device on every rank (CPU with "
            "gloo, CUDA with NCCL); the ranks mix them"
        )


# ----------------------------------------------------------------------------- sharding
def shard_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None, zigzag: bool = True
) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim``.

    Args:
        x: the whole sequence (every rank passes the same tensor).
        dim: the sequence dimension (1 for ``b n h d``, 2 for ``b h n d``).
        zigzag: chunks ``r`` and ``2P − 1 − r`` of ``2P`` (balances causal attention), else the
            ``r``-th of ``P`` contiguous pieces.

    Returns:
        A contiguous tensor with ``N / P`` entries along ``dim``.

    Raises:
        ValueError: ``N`` not divisible by ``2P`` (zigzag) or ``P``.
    """
    rank, size, _, _ = group_info(group)
    n = x.shape[dim]
    parts = 2 * size if zigzag else size
    if n % parts:
        raise ValueError(
            f"sequence length {n} must divide by {'2P' if zigzag else 'P'} = "
            f"{parts} for {'zigzag' if zigzag else 'contiguous'} shards"
        )
    chunks = x.chunk(parts, dim)
    if not zigzag:
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim).contiguous()


def gather_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None, zigzag: bool = True
) -> torch.Tensor:
    """The full sequence from every rank's shard (:func:`shard_sequence`'s inverse: an
    all-gather, then the chunks put back in order)."""
    _, size, _, _ = group_info(group)
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x, group=group)
    if not zigzag:
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    order = [halves[r][0] for r in range(size)] + [halves[r][1] for r in reversed(range(size))]
    return torch.cat(order, dim)


# ----------------------------------------------------------------------------- the ring
