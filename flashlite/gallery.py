"""Ready-made mods: a face; the code lives in :mod:`flashlite.masking.gallery`."""

from flashlite.masking.gallery import (
    ALIBI_NAME,
    alibi,
    alibi_slopes,
    causal,
    causal_lower_right,
    document,
    document_causal,
    document_ids,
    prefix_lm,
    random_documents,
    relative_bias,
    sliding_window,
    tanh_softcap,
)

__all__ = [
    "ALIBI_NAME",
    "causal",
    "causal_lower_right",
    "sliding_window",
    "prefix_lm",
    "document",
    "document_causal",
    "random_documents",
    "document_ids",
    "alibi",
    "alibi_slopes",
    "tanh_softcap",
    "relative_bias",
]
