"""HBM traffic of one attention or softmax call: modelled, counted, measured.

Three independent ways to get the bytes a call moves between DRAM (HBM) and the chip:

* **model** (:mod:`~flashlite.traffic.model`) — closed-form bytes read and written. For the
  naive reference it is the sum over the ops :func:`flashlite.reference.attention` runs, each
  reading its inputs once and writing its output once. For flashlite it is what the kernel
  issues: Q once, K and V once per query block (only the tiles with a visible key when causal),
  O and LSE once — counting only unmasked lanes of partial tiles, with the block sizes the
  kernel really used.
* **counted** (:mod:`~flashlite.traffic.count`) — run the real code and add up bytes. Triton
  kernels are run in Triton's interpreter with its load/store entry points wrapped by
  :func:`flashlite.traffic.hooks.interpreter_memory_hooks` (:func:`count_kernels`); torch ops are
  seen by a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (:func:`count_torch_ops`);
  both counters live in :mod:`~flashlite.traffic.counters`.
* **measured** (:mod:`~flashlite.traffic.measure`) — DRAM bytes of the kernels of one call on a
  GPU, from Nsight Compute (``dram__bytes_read.sum``, ``dram__bytes_write.sum``, read by
  :mod:`~flashlite.traffic.ncu`) run on a child process (:func:`measure_attention`).

:mod:`~flashlite.traffic.shapes` holds what they share (:class:`AttentionShape`,
:class:`Traffic`), and :mod:`~flashlite.traffic.report` the rows, table and plot of the
``flashlite traffic`` command (:mod:`~flashlite.traffic.report_decode` its decoding rows,
:mod:`~flashlite.traffic.report_sparse` its block-sparse rows).
Counted equals the model exactly for flashlite kernels; measured differs from both (L2 reuse
of K/V across query blocks, caches, ECC, prefetch): ``docs/how-it-works/hbm-traffic.md`` explains.
"""

from flashlite.traffic.count import (
    count_attention,
    count_attention_bwd,
    count_cross_entropy,
    count_decode,
    count_mla,
    count_shared_prefix,
    count_softmax,
)
from flashlite.traffic.count_sparse import count_flex_attention, count_flex_varlen
from flashlite.traffic.counters import (
    KernelCounter,
    OpCounter,
    count_kernels,
    count_torch_ops,
    tensor_bytes,
)
from flashlite.traffic.measure import Measurement, measure_attention, measure_softmax
from flashlite.traffic.model import DEFAULT_L2_BYTES as DEFAULT_L2_BYTES
from flashlite.traffic.model import (
    compulsory_attention,
    compulsory_attention_bwd,
    compulsory_cross_entropy,
    compulsory_softmax,
    config_name,
    decode_splits,
    dram_attention,
    dram_flashlite_attention,
    dram_flashlite_attention_bwd,
    dram_naive_attention,
    dram_softmax,
    flashlite_config,
    l2_note,
    model_attention,
    model_cross_entropy,
    model_flashlite_attention,
    model_flashlite_attention_bwd,
    model_flashlite_decode,
    model_flashlite_mla,
    model_flashlite_shared_prefix,
    model_flex_attention,
    model_flex_varlen,
    model_kvcache_prefix_copies,
    model_naive_attention,
    model_softmax,
    parse_config,
    shared_prefix_splits,
    shared_prefix_tiles,
)
from flashlite.traffic.ncu import KernelMetrics, find_ncu, parse_ncu_csv
from flashlite.traffic.report import (
    SOFTMAX_SHOWN,
    backward_rows,
    cross_entropy_rows,
    format_softmax_table,
    format_table,
    plot_traffic,
    softmax_rows,
    traffic_rows,
)
from flashlite.traffic.report_decode import (
    decode_rows,
    format_mla_table,
    format_shared_prefix_table,
    mla_rows,
    shared_prefix_rows,
)
from flashlite.traffic.report_sparse import MASKS as MASKS
from flashlite.traffic.report_sparse import block_sparse_rows, format_block_sparse_table
from flashlite.traffic.shapes import (
    ATTENTION_METHODS,
    SOFTMAX_ALGORITHMS,
    SOFTMAX_GPU_ALGORITHMS,
    AttentionShape,
    Traffic,
    make_inputs,
)
from flashlite.traffic.shapes import byte_fields as byte_fields

__all__ = [
    "ATTENTION_METHODS",
    "block_sparse_rows",
    "count_flex_attention",
    "count_flex_varlen",
    "format_block_sparse_table",
    "model_flex_attention",
    "model_flex_varlen",
    "SOFTMAX_ALGORITHMS",
    "SOFTMAX_GPU_ALGORITHMS",
    "AttentionShape",
    "Traffic",
    "KernelCounter",
    "OpCounter",
    "compulsory_attention",
    "compulsory_softmax",
    "model_naive_attention",
    "model_flashlite_attention",
    "model_attention",
    "model_softmax",
    "count_kernels",
    "count_torch_ops",
    "count_attention",
    "make_inputs",
    "flashlite_config",
    "config_name",
    "backward_rows",
    "compulsory_attention_bwd",
    "count_attention_bwd",
    "model_flashlite_attention_bwd",
    "count_decode",
    "count_mla",
    "mla_rows",
    "format_mla_table",
    "model_flashlite_mla",
    "count_cross_entropy",
    "compulsory_cross_entropy",
    "model_cross_entropy",
    "cross_entropy_rows",
    "decode_rows",
    "model_flashlite_decode",
    "decode_splits",
    "count_shared_prefix",
    "model_flashlite_shared_prefix",
    "model_kvcache_prefix_copies",
    "shared_prefix_tiles",
    "shared_prefix_splits",
    "shared_prefix_rows",
    "format_shared_prefix_table",
    "SOFTMAX_SHOWN",
    "format_softmax_table",
    "softmax_rows",
    "dram_softmax",
    "measure_softmax",
    "dram_attention",
    "dram_flashlite_attention",
    "dram_flashlite_attention_bwd",
    "dram_naive_attention",
    "parse_config",
    "Measurement",
    "KernelMetrics",
    "count_softmax",
    "parse_ncu_csv",
    "find_ncu",
    "measure_attention",
    "l2_note",
    "tensor_bytes",
    "traffic_rows",
    "format_table",
    "plot_traffic",
]
