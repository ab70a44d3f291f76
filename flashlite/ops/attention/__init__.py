"""Tiled attention front-end, one module per idea:

==================  ==============================================================================
``api``             the public functions over whole sequences: :func:`attention`,
                    :func:`attention_varlen`
``kvcache``         decoding against a cache: :func:`attention_kvcache`, its checks (with
                    ``cache_checks``) and ``flashlite::attention_kvcache``
``shared_prefix``   cascade decoding over one shared prefix: prefix pass, suffix pass, merge
``mla``             absorbed multi-head latent attention for decoding: :func:`attention_mla_decode`
``fp8``             FP8's arguments: e4m3 inputs, descale factors, the output's dtype
``flex``            your own masks and score functions: :func:`flex_attention` and its ops
                    ``flashlite::flex_attention_*``
``request``         :class:`Request`: one call described once (mask, lengths, sinks, splits,
                    scale); the one plainness test and the one source of plan keys
``checks``          argument checks (types, shapes, layouts, lengths, offsets, the cache's values)
``ops``             the two ops stated once (``flashlite::attention_fwd``/``_bwd``, autograd
                    included) and their bodies, the launchers (:func:`attention_fwd`,
                    :func:`attention_bwd`): a plan asked of the planner and launched
``planner``         which backend runs a call (split-KV, tables, Hopper, Triton) and its plan:
                    the forward's and the backward's decision trees, each branch saying why;
                    plans kept per kind of call
``plan``            :class:`Plan`: backend, tile, grid, splits, workspaces, bound launch (what
                    the launchers run and the traffic tools read)
``backends/``       what runs a call, one folder or file per backend, each importing kernels,
                    the request and plan types and what backends share (``common*``), never
                    the planner or another backend: ``triton`` (every option, every GPU, the
                    interpreter), ``hopper`` (the dense Gluon kernels), ``tables`` (flex's
                    kernels over block tables; the built-in window as its band's tables),
                    ``split_kv`` (decode, the cache step, the merge of partial results)
==================  ==============================================================================

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
from flashlite.ops.attention.api import attention, attention_varlen
from flashlite.ops.attention.backends.common import (
    DESC_MIN_WORK,
    HOPPER_ENV,
    bwd_preprocess,
    empty_output,
    hopper_bwd_applies,
    hopper_config,
)
from flashlite.ops.attention.backends.split_kv.cache import KVCachePlan
from flashlite.ops.attention.backends.split_kv.decode import (
    DecodePlan,
    attention_decode_fwd,
    combine_splits,
)
from flashlite.ops.attention.backends.split_kv.splits import (
    DECODE_MAX_ROWS,
    decode_tiles,
    prefix_splits,
    splits_for,
)
from flashlite.ops.attention.backends.triton.bwd import bwd_dkdv, bwd_dq
from flashlite.ops.attention.backends.triton.config import (
    GPU_TABLES,
    SMALL_CONFIG,
    bwd_config,
    bwd_tiles,
    fixed_config,
)
from flashlite.ops.attention.checks import check_inputs, check_sinks
from flashlite.ops.attention.flex import compiled_variants, flex_attention
from flashlite.ops.attention.kvcache import attention_kvcache
from flashlite.ops.attention.mla import attention_mla_decode
from flashlite.ops.attention.ops import attention_bwd, attention_fwd
from flashlite.ops.attention.plan import LaunchInfo, Plan, Workspace
from flashlite.ops.attention.planner import gpu_config
from flashlite.ops.attention.request import Request
from flashlite.ops.attention.shared_prefix import attention_shared_prefix

__all__ = [
    "DECODE_MAX_ROWS",
    "DESC_MIN_WORK",
    "GPU_TABLES",
    "HOPPER_ENV",
    "SMALL_CONFIG",
    "Workspace",
    "BwdConfig",
    "Config",
    "DecodeConfig",
    "DecodePlan",
    "KVCachePlan",
    "LaunchInfo",
    "Plan",
    "Request",
    "attention",
    "attention_bwd",
    "attention_decode_fwd",
    "attention_fwd",
    "attention_kvcache",
    "attention_mla_decode",
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
