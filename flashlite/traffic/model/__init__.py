"""Closed-form bytes: what no implementation can avoid, and what each one issues.

For the naive reference the model is the sum over the ops :func:`flashlite.reference.attention`
runs, each reading its inputs once and writing its output once. For flashlite it is what the
kernel issues: Q once, K and V once per query block (only the tiles with a visible key when
causal), O and LSE once — counting only unmasked lanes of partial tiles, with the block sizes the
kernel really used. The softmax models count the passes each kernel makes over x.
"""

from __future__ import annotations

from flashlite.traffic.model.attention import (
    bwd_info,
    compulsory_attention,
    compulsory_attention_bwd,
    counted_bwd_config,
    dram_attention,
    dram_flashlite_attention,
    dram_flashlite_attention_bwd,
    dram_naive_attention,
    l2_note,
    model_attention,
    model_flashlite_attention,
    model_flashlite_attention_bwd,
    model_naive_attention,
)
from flashlite.traffic.model.block_sparse import (
    dram_flex_attention,
    dram_flex_varlen,
    model_flex_attention,
    model_flex_varlen,
)
from flashlite.traffic.model.common import (
    DEFAULT_L2_BYTES,
    GPUS,
    L2_EFFECTIVE,
    Gpu,
    attention_dims,
    config_name,
    counted_config,
    effective_l2,
    flashlite_config,
    parse_config,
    written_back,
)
from flashlite.traffic.model.cross_entropy import (
    compulsory_cross_entropy,
    model_cross_entropy,
)
from flashlite.traffic.model.decode import (
    decode_rows_per_head,
    decode_splits,
    model_flashlite_decode,
)
from flashlite.traffic.model.mla import (
    compulsory_mla,
    mla_lanes,
    model_flashlite_mla,
    per_head_cache_bytes,
)
from flashlite.traffic.model.shared_prefix import (
    model_flashlite_shared_prefix,
    model_kvcache_prefix_copies,
    shared_prefix_splits,
    shared_prefix_tiles,
)
from flashlite.traffic.model.softmax import (
    compulsory_softmax,
    dram_softmax,
    model_softmax,
    resolve_softmax_algorithm,
)

__all__ = [
    "Gpu",
    "compulsory_mla",
    "mla_lanes",
    "model_flashlite_mla",
    "per_head_cache_bytes",
    "model_flex_attention",
    "dram_flex_attention",
    "model_flex_varlen",
    "dram_flex_varlen",
    "GPUS",
    "DEFAULT_L2_BYTES",
    "attention_dims",
    "config_name",
    "parse_config",
    "counted_config",
    "flashlite_config",
    "L2_EFFECTIVE",
    "effective_l2",
    "written_back",
    "l2_note",
    "compulsory_attention",
    "model_naive_attention",
    "model_flashlite_attention",
    "model_attention",
    "dram_naive_attention",
    "dram_flashlite_attention",
    "dram_flashlite_attention_bwd",
    "dram_attention",
    "compulsory_attention_bwd",
    "counted_bwd_config",
    "model_flashlite_attention_bwd",
    "bwd_info",
    "resolve_softmax_algorithm",
    "compulsory_softmax",
    "model_softmax",
    "dram_softmax",
    "decode_rows_per_head",
    "decode_splits",
    "model_flashlite_decode",
    "shared_prefix_tiles",
    "shared_prefix_splits",
    "model_flashlite_shared_prefix",
    "model_kvcache_prefix_copies",
    "model_cross_entropy",
    "compulsory_cross_entropy",
]
