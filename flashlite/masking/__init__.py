"""Which keys a query sees, and what a mod adds to a score: one package on floor 0, one module per
idea, this file its one public face (kernels, ops, the traffic model, the reference and the
tests all ask here, so that they keep agreeing).

================  ==================================================================================
``masks``         the built-in masks (causal, window, soft cap): :func:`describe` → :class:`Mask`,
                  the jit range helpers (``key_range``, ``query_range``, ``visible``) and their
                  torch twins
``mods``          your own mask and score functions: :class:`MaskMod` / :class:`ScoreMod` (jit
                  function, torch twin, derivative, buffers, limits), the registry of mods by name
``mod_calls``     how a mod is called: the kernels' call helpers ``apply_mask`` / ``apply_score``
                  and their buffer slots, the twins' callers ``torch_mask`` / ``torch_score``
``mod_args``      a mod as the custom ops carry it (a spec string, tensors, numbers) and back; the
                  checks of a mod's buffers against a call
``block_mask``    :class:`BlockMask`: tile classes (empty, partial, full) as FlexAttention's tables
``classify``      the tile classifier: its kernel, its torch twin, and the launch of one or the
                  other (:func:`classify_tiles`)
``python_masks``  plain Python mask functions: evaluated once per block mask, partial tiles
                  kept as bits that one registered jit mask (``flashlite.bits``) reads
``create``        :func:`create_block_mask`, the tables of no mask (:func:`dense_block_mask`), the
                  checks a call's block mask passes (:func:`block_mask_for`)
``band``          the sliding window as a band of tables with its mask function (what flex's
                  Hopper kernels run for ``window=``)
``softcap``       the soft cap's jit ``tanh`` (scores and logits)
``gallery``       mask and score functions ready to use (``gallery.causal()``, ``gallery.alibi``)
================  ==================================================================================

The older module paths ``flashlite.masks``, ``flashlite.mods``, ``flashlite.block_mask`` and
``flashlite.gallery`` are faces of these modules and give the same objects.
"""

from flashlite.masking import gallery
from flashlite.masking.band import band_classes, band_tables
from flashlite.masking.block_mask import EMPTY, FULL, PARTIAL, BlockMask, cdiv, tables
from flashlite.masking.classify import classify_tiles, torch_classify
from flashlite.masking.create import block_mask_for, create_block_mask, dense_block_mask
from flashlite.masking.masks import (
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
from flashlite.masking.mod_args import (
    ModArgs,
    Slots,
    check_mod,
    declared_fast_path,
    spec_entry,
    spec_mod,
    split_spec,
    unspec_mod,
)
from flashlite.masking.mod_calls import (
    MAX_BUFFERS,
    apply_mask,
    apply_score,
    kernel_buffers,
    torch_indices,
    torch_mask,
    torch_score,
)
from flashlite.masking.mods import (
    FAST_PATHS,
    MaskMod,
    ScoreMod,
    as_mask_mod,
    as_score_mod,
    check_limits,
    mask_mod,
    registered,
    registered_as,
    score_mod,
)
from flashlite.masking.python_masks import (
    BITS_NAME,
    EMPTY_SLOT,
    FULL_SLOT,
    bits_mask,
    evaluate_mask,
    is_python_mask,
    python_block_mask,
)
from flashlite.masking.softcap import tanh

__all__ = [
    "BITS_NAME",
    "EMPTY_SLOT",
    "FULL_SLOT",
    "bits_mask",
    "evaluate_mask",
    "is_python_mask",
    "python_block_mask",
    # masks
    "CAUSAL",
    "NO_MASK",
    "KernelMask",
    "Mask",
    "check_softcap",
    "describe",
    "key_range",
    "query_range",
    "torch_key_range",
    "torch_query_range",
    "torch_visible",
    "visible",
    "visible_t",
    "window_bounds",
    # mods
    "FAST_PATHS",
    "MaskMod",
    "ScoreMod",
    "as_mask_mod",
    "as_score_mod",
    "check_limits",
    "mask_mod",
    "registered",
    "registered_as",
    "score_mod",
    # mod_calls
    "MAX_BUFFERS",
    "apply_mask",
    "apply_score",
    "kernel_buffers",
    "torch_indices",
    "torch_mask",
    "torch_score",
    # mod_args
    "ModArgs",
    "Slots",
    "check_mod",
    "spec_entry",
    "spec_mod",
    "split_spec",
    "unspec_mod",
    "declared_fast_path",
    # block tables
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "cdiv",
    "tables",
    "classify_tiles",
    "torch_classify",
    "block_mask_for",
    "create_block_mask",
    "dense_block_mask",
    "band_classes",
    "band_tables",
    # soft cap, gallery
    "tanh",
    "gallery",
]
