"""The built-in masks: a face; the code lives in :mod:`flashlite.masking.masks`."""

from flashlite.masking import (
    CAUSAL,
    NO_MASK,
    KernelMask,
    Mask,
    check_softcap,
    describe,
    key_range,
    query_range,
    torch_key_range,
    torch_query_range,
    torch_visible,
    visible,
    visible_t,
    window_bounds,
)

__all__ = [
    "key_range",
    "query_range",
    "visible",
    "visible_t",
    "torch_key_range",
    "torch_query_range",
    "torch_visible",
    "window_bounds",
    "Mask",
    "KernelMask",
    "NO_MASK",
    "CAUSAL",
    "describe",
    "check_softcap",
]
