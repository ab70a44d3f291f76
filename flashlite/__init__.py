"""flashlite: the online-softmax pair behind FlashAttention, as row softmax and tiled attention."""

from flashlite import (
    _backend,  # noqa: F401  (chooses compiled vs interpreted Triton first)
    reference,
    stats,
)
from flashlite.attention import attention
from flashlite.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = ["__version__", "attention", "log_softmax", "reference", "softmax", "stats"]
