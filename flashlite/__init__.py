"""flashlite: the online-softmax pair behind FlashAttention, as row softmax, fused cross-entropy and
tiled attention."""

from importlib.metadata import PackageNotFoundError, version

from flashlite import (
    _backend,  # noqa: F401  (chooses compiled vs interpreted Triton first)
    distributed,
    masks,
    nn,
    reference,
    stats,
)
from flashlite.ops.attention import attention, attention_kvcache, attention_varlen
from flashlite.ops.cross_entropy import cross_entropy, linear_cross_entropy
from flashlite.ops.softmax import log_softmax, softmax

try:
    __version__ = version("flashlite")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "attention",
    "attention_kvcache",
    "attention_varlen",
    "cross_entropy",
    "distributed",
    "linear_cross_entropy",
    "log_softmax",
    "masks",
    "nn",
    "reference",
    "softmax",
    "stats",
]
