"""What runs an attention call, under :mod:`~flashlite.ops.attention.planner`: one folder or file
per backend, each importing kernels, the request type and what the backends share, never the
planner or another backend.

* :mod:`.triton` — the Triton kernels: every option, every GPU, the CPU's interpreter;
* :mod:`.hopper` — the dense Gluon kernels on sm_90;
* :mod:`.tables` — flex's kernels over block tables (a built-in window is its band's tables);
* :mod:`.split_kv` — few query rows against many keys: decode, the cache step (append and
  decode), the merge of partial results;
* :mod:`.common`, :mod:`.common_gluon` — what they share: launch facts, TMA and Hopper
  applicability, the backward's preprocess, the Gluon kernels' descriptors and first build.
"""
