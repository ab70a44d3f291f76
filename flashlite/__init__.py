"""flashlite: the online-softmax pair behind FlashAttention, as row softmax, fused cross-entropy and
tiled attention."""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from flashlite import (
    _backend,  # noqa: F401  (chooses compiled vs interpreted Triton first)
    gallery,
    masking,
    masks,
    mods,
    reference,
    stats,
)
from flashlite.masking import BlockMask, create_block_mask
from flashlite.ops.attention import (
    attention,
    attention_kvcache,
    attention_mla_decode,
    attention_shared_prefix,
    attention_varlen,
    flex_attention,
)
from flashlite.ops.cross_entropy import cross_entropy, linear_cross_entropy
from flashlite.ops.softmax import log_softmax, softmax

try:
    __version__ = version("flashlite-attn")  # the distribution's name
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "BlockMask",
    "attention",
    "attention_kvcache",
    "attention_mla_decode",
    "attention_shared_prefix",
    "attention_varlen",
    "create_block_mask",
    "cross_entropy",
    "distributed",
    "flex_attention",
    "gallery",
    "linear_cross_entropy",
    "log_softmax",
    "masking",
    "masks",
    "mods",
    "nn",
    "reference",
    "softmax",
    "stats",
]

#: Subpackages loaded on first use (``flashlite.distributed.ring_attention``, ``flashlite.nn``):
#: ``import flashlite`` stays what the kernels need (torch.distributed and the module classes are
#: not imported for a softmax).
_LAZY = ("distributed", "nn")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"flashlite.{name}")  # (sets the attribute: once)
    raise AttributeError(f"module 'flashlite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
