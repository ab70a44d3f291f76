"""Tiled attention front-end, one module per idea:

==============  ==================================================================================
``api``         the public functions: :func:`attention`, :func:`attention_varlen`,
                :func:`attention_kvcache`
``request``     :class:`Request`: one call described once (mask, lengths, sinks, splits,
                scale); the one plainness test and the one source of plan keys
``checks``      argument checks (types, shapes, layouts, lengths, offsets, the cache's values)
``planner``     which backend runs a call (split-KV, tables, Hopper, Triton): the forward's and
                the backward's decision trees, each branch saying why
``plan``        tile configs, descriptor or pointer loads, the Gluon kernels' applicability,
                split-KV chunks
``fwd``         the forward launcher (carries out the planner's choice; plans of plain calls
                kept per kind of tensors), the forward op's body and fake
``bwd``         the backward launcher (:class:`BwdPlan` for plain calls), the op's body and fake
``flex_args``   flex's plan keys and kernel arguments; ``flex_plan`` its plans
``bwd_launch``  the backward's launchers: the preprocess and the Triton pair (dK/dV, dQ)
``ops``         the two ops stated once (``flashlite::attention_fwd``/``_bwd``, autograd included)
``decode``      the decode kernel's plan and launch (GQA packing, split-KV, the exact merge)
``kvcache``     the KV-cache step: value checks, append, decode; ``flashlite::attention_kvcache``
``cache_checks``  :func:`attention_kvcache`'s argument checks (tensors, mask and score functions)
``shared_prefix``  cascade decoding over one shared prefix: prefix pass, suffix pass, merge
``flex``        your own masks and score functions: :func:`flex_attention` and its ops
                ``flashlite::flex_attention_*`` (Triton, or the Hopper kernels, over tables)
``window``      the built-in sliding window on flex's Hopper kernels, over its band's tables
==============  ==================================================================================

The kernels live in :mod:`flashlite.kernels.attention` and their tile tables in
:mod:`flashlite.kernels.configs`; which keys a query sees (masks, mods, block tables and
:func:`create_block_mask`, the window's band) in :mod:`flashlite.masking`. Every layout is read
through strides (no copies). The ops are ``torch.library`` custom ops with fake implementations,
so ``torch.compile(fullgraph=True)`` traces through :func:`attention` without a graph break. They
are ``custom_op`` rather than ``triton_op``: the same op runs CPU tensors in Triton's interpreter
or moves them to the GPU, picks descriptors and configs on the host per call, and Inductor could
only inline the CUDA case.
"""

# the tile vocabulary of the plans (what flashlite.traffic reads here, never in kernels/)
from flashlite.kernels.configs import (
    BwdConfig,
    Config,
    DecodeConfig,
    block_d,
    keep_config,
    smem_bytes,
)
from flashlite.masking.create import create_block_mask, dense_block_mask
from flashlite.ops.attention.api import attention, attention_kvcache, attention_varlen
from flashlite.ops.attention.bwd import attention_bwd
from flashlite.ops.attention.bwd_launch import bwd_dkdv, bwd_dq, bwd_preprocess
from flashlite.ops.attention.checks import check_inputs, check_sinks
from flashlite.ops.attention.decode import DecodePlan, attention_decode_fwd, combine_splits
from flashlite.ops.attention.flex import compiled_variants, flex_attention
from flashlite.ops.attention.fwd import attention_fwd
from flashlite.ops.attention.kvcache import KVCachePlan
from flashlite.ops.attention.plan import (
    DECODE_MAX_ROWS,
    DESC_MIN_WORK,
    GPU_TABLES,
    HOPPER_ENV,
    SMALL_CONFIG,
    LaunchInfo,
    bwd_config,
    bwd_tiles,
    decode_tiles,
    empty_output,
    fixed_config,
    gpu_config,
    hopper_bwd_applies,
    hopper_config,
    prefix_splits,
    splits_for,
)
from flashlite.ops.attention.request import Request
from flashlite.ops.attention.shared_prefix import attention_shared_prefix

__all__ = [
    "DECODE_MAX_ROWS",
    "DESC_MIN_WORK",
    "GPU_TABLES",
    "HOPPER_ENV",
    "SMALL_CONFIG",
    "BwdConfig",
    "Config",
    "DecodeConfig",
    "DecodePlan",
    "KVCachePlan",
    "LaunchInfo",
    "Request",
    "attention",
    "attention_bwd",
    "attention_decode_fwd",
    "attention_fwd",
    "attention_kvcache",
    "attention_shared_prefix",
    "attention_varlen",
    "block_d",
    "bwd_config",
    "bwd_tiles",
    "bwd_dkdv",
    "bwd_dq",
    "bwd_preprocess",
    "check_inputs",
    "check_sinks",
    "combine_splits",
    "compiled_variants",
    "create_block_mask",
    "dense_block_mask",
    "decode_tiles",
    "empty_output",
    "fixed_config",
    "flex_attention",
    "gpu_config",
    "hopper_bwd_applies",
    "hopper_config",
    "keep_config",
    "smem_bytes",
    "prefix_splits",
    "splits_for",
]
