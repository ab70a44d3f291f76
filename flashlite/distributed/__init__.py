"""Attention across ranks: ring attention over ``torch.distributed`` (gloo on CPU, NCCL on
GPUs), exact through the ``(o, lse)`` merge of :mod:`flashlite.stats`."""

from flashlite.distributed.ring import ring_attention
from flashlite.distributed.sequence import gather_sequence, shard_sequence

__all__ = ["gather_sequence", "ring_attention", "shard_sequence"]
