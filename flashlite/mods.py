"""Mask and score functions: a face; the code lives in :mod:`flashlite.masking.mods`."""

from flashlite.masking import (
    MAX_BUFFERS,
    MaskMod,
    ScoreMod,
    apply_mask,
    apply_score,
    as_mask_mod,
    as_score_mod,
    check_limits,
    kernel_buffers,
    mask_mod,
    registered,
    registered_as,
    score_mod,
    torch_indices,
    torch_mask,
    torch_score,
)

__all__ = [
    "MAX_BUFFERS",
    "MaskMod",
    "ScoreMod",
    "mask_mod",
    "score_mod",
    "as_mask_mod",
    "as_score_mod",
    "registered",
    "registered_as",
    "apply_mask",
    "apply_score",
    "check_limits",
    "kernel_buffers",
    "torch_indices",
    "torch_mask",
    "torch_score",
]
