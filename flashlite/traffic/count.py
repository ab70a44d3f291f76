"""Counted bytes of each workload the ``flashlite traffic`` command reports: attention forward
and backward, softmax, decoding, the shared prefix and cross-entropy, each run on CPU tensors
inside the counters of :mod:`flashlite.traffic.counters` (its kernels in Triton's interpreter,
its torch ops through a dispatch mode). Counted equals the flashlite models of
:mod:`flashlite.traffic.model` exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashlite import reference
from flashlite.masking import masks
from flashlite.ops import attention as attention_ops
from flashlite.ops import softmax as softmax_ops
from flashlite.ops.attention import Config, DecodeConfig
from flashlite.ops.attention.backends.split_kv.decode import descale_args
from flashlite.ops.attention.fp8 import factor_views, fp8_fields
from flashlite.traffic.counters import count_kernels, count_torch_ops
from flashlite.traffic.model import (
    bwd_info,
    counted_bwd_config,
    counted_config,
    flashlite_config,
    resolve_softmax_algorithm,
    shared_prefix_tiles,
)
from flashlite.traffic.shapes import ATTENTION_METHODS, AttentionShape, Traffic, make_inputs


def attention_fn(method: str, shape: AttentionShape) -> Callable[..., torch.Tensor]:
    """The callable ``f(q, k, v)`` that runs ``method`` on ``shape``."""
    if method == "naive":
        if shape.fp8:  # (torch has no FP8 attention: widened to bf16 first, factors of 1)
            return lambda q, k, v: reference.attention(
                *(x.to(torch.bfloat16) for x in (q, k, v)), causal=shape.causal
            )
        return lambda q, k, v: reference.attention(q, k, v, causal=shape.causal)
    if method == "flashlite":
        import flashlite

        if shape.fp8:  # (one factor per tensor)
            one = torch.ones(1)

            def fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                scales = {"q_descale": one, "k_descale": one, "v_descale": one}
                with torch.no_grad():
                    return flashlite.attention(
                        q,
                        k,
                        v,
                        causal=shape.causal,
                        **{n: x.to(q.device) for n, x in scales.items()},
                    )

            return fp8
        return lambda q, k, v: flashlite.attention(q, k, v, causal=shape.causal)
    if method in ("sdpa-flash", "sdpa-cudnn"):
        backend = method.removeprefix("sdpa-")
        if shape.fp8:  # (SDPA has no FP8: widened to bf16 first, as naive)
            return lambda q, k, v: reference.sdpa(
                *(x.to(torch.bfloat16) for x in (q, k, v)), causal=shape.causal, backend=backend
            )
        return lambda q, k, v: reference.sdpa(q, k, v, causal=shape.causal, backend=backend)
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def count_attention(
    method: str,
    shape: AttentionShape,
    *,
    use_desc: bool | None = None,
    gpu: str = "h200",
    config: Config | None = None,
) -> Traffic | None:
    """Counted bytes of one call of ``method`` on CPU tensors of ``shape``.

    ``naive`` counts torch ops. ``flashlite`` counts the kernel's loads and stores in the
    interpreter, run with the tile config the ``gpu`` table uses for the shape (or ``config``;
    :func:`~flashlite.traffic.model.flashlite_config`), through the front-end's launcher, plus
    any torch op that moves data (``parts["torch ops"]``); ``info`` names the config. Loads go
    through pointers unless ``use_desc`` (descriptor loads count the same in-bounds bytes).
    Returns None for the sdpa-* methods (GPU kernels).
    """
    if method not in ("naive", "flashlite"):
        if method in ATTENTION_METHODS:
            return None
        raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")
    q, k, v = make_inputs(shape, "cpu")
    if method == "naive":
        with count_torch_ops() as ops:
            attention_fn(method, shape)(q, k, v)
        return ops.traffic
    cfg, _ = counted_config(shape, gpu=gpu, config=config)
    request = attention_ops.Request.of_mask(shape.mask, shape.head_dim**-0.5)
    if shape.head_dim_v is not None and shape.head_dim_v != shape.head_dim:
        request = request._replace(head_dim_v=shape.head_dim_v)
    if shape.fp8:  # one factor per tensor (of 1), read by every program
        one = torch.ones(1)
        request = request._replace(**fp8_fields(q, k, v, one, one, one, None))
    with count_kernels() as kern, count_torch_ops() as ops:
        kern.watch(q=q, k=k, v=v)
        attention_ops.attention_fwd(q, k, v, request, config=cfg, use_desc=bool(use_desc))
    t = kern.traffic
    if ops.traffic.total:
        t.add("torch ops", ops.traffic.read, ops.traffic.write)
    t.info = flashlite_config(shape, "cpu", gpu=gpu, config=config)
    return t


BACKWARD_METHODS = ("naive", "flashlite")


def attention_bwd_fn(
    method: str, shape: AttentionShape, device: str = "cpu", *, with_lse_grad: bool = False
) -> Callable[[], Any]:
    """A call that runs one backward of ``method`` on ``shape``, its forward already done: what
    the count (CPU) and the ncu measurement (GPU) both take.

    flashlite: the three Triton backward kernels the model describes
    (``ops.attention.attention_bwd`` with the H200's config,
    :func:`flashlite.traffic.model.counted_bwd_config`, on CPU and GPU alike: a pinned config
    also keeps a Hopper GPU off the fused Gluon backward, whose traffic the model does not
    cover).
    naive: autograd's backward through :func:`flashlite.reference.attention` (graph retained, so
    the call can repeat), run on the calling thread. dO (and dlse) are the same seeded values
    for both.
    """
    if method not in BACKWARD_METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(BACKWARD_METHODS)}")
    q, k, v = make_inputs(shape, device)
    scale = shape.head_dim**-0.5
    gen = torch.Generator().manual_seed(1)
    o_shape = (shape.batch, shape.heads, shape.seq_q, shape.head_dim)
    do = torch.randn(o_shape, generator=gen).to(device=device, dtype=q.dtype)
    dlse = torch.randn(o_shape[:3], generator=gen).to(device) if with_lse_grad else None
    if method == "flashlite":
        request = attention_ops.Request.of_mask(shape.mask, scale)
        o, lse, _ = attention_ops.attention_fwd(q, k, v, request)
        cfg = counted_bwd_config(shape)
        return lambda: attention_ops.attention_bwd(do, q, k, v, o, lse, dlse, request, config=cfg)
    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    out, ref_lse = reference.attention(*leaves, shape.causal, scale, return_lse=True)
    outs, grads = ([out, ref_lse], [do, dlse]) if dlse is not None else ([out], [do])

    def naive_backward() -> Any:
        # on the calling thread: autograd otherwise runs CUDA work on its device thread, outside
        # the NVTX range (per thread) that selects the kernels ncu measures
        with torch.autograd.set_multithreading_enabled(False):
            return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    return naive_backward


def count_attention_bwd(
    shape: AttentionShape, *, with_lse_grad: bool = False
) -> tuple[Traffic, Traffic]:
    """Counted bytes of one backward on CPU tensors of ``shape``: ``(flashlite, naive)``, each
    the call :func:`attention_bwd_fn` builds (the forwards are not counted): flashlite's three
    kernels in the interpreter with the GPU's config, every torch op of naive autograd's."""
    flash_call = attention_bwd_fn("flashlite", shape, with_lse_grad=with_lse_grad)
    with count_kernels() as kern:
        flash_call()
    flash = kern.traffic
    flash.info = bwd_info(counted_bwd_config(shape))
    naive_call = attention_bwd_fn("naive", shape, with_lse_grad=with_lse_grad)
    with count_torch_ops() as ops:
        naive_call()
    return flash, ops.traffic


def count_softmax(
    rows: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    algorithm: str = "auto",
    *,
    log: bool = False,
) -> Traffic:
    """Counted bytes of the softmax forward kernels for a contiguous ``(rows, n)`` input (CPU).

    ``three_pass`` / ``online`` / ``auto`` go through :func:`flashlite.softmax`; ``single_read``
    and ``split`` are launched through the front-end's host launcher, since the public API picks
    between them only by row length.
    """
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    resolved = resolve_softmax_algorithm(algorithm, n, x.element_size())
    with count_kernels() as kern:
        if algorithm in ("auto", "three_pass", "online"):
            fn = softmax_ops.log_softmax if log else softmax_ops.softmax
            fn(x, -1, algorithm=algorithm)
        else:
            softmax_ops.softmax_fwd(x, torch.empty_like(x), log, resolved)
    return kern.traffic


def count_decode(
    shape: AttentionShape, config: DecodeConfig, splits: int
) -> tuple[Traffic, Traffic]:
    """Counted bytes of decoding ``shape`` (Nq new queries against full caches of Nk keys):
    ``(flashlite, naive)``. flashlite runs :func:`~flashlite.ops.attention.attention_decode_fwd`
    in the interpreter with ``config`` and ``splits`` (what the GPU would pick); naive is the
    materialising reference, counted as torch ops."""
    q, k, v = make_inputs(shape, "cpu")
    lengths = torch.full((shape.batch,), shape.nk, dtype=torch.int32)
    descales = None
    if shape.fp8:  # an e4m3 cache read by bf16 queries, one factor per tensor
        q = q.to(torch.bfloat16)
        ones = dict.fromkeys(("q_descale", "k_descale", "v_descale"))  # (all 1)
        descales = descale_args(*factor_views(ones, shape.batch, shape.hkv, q))
    with count_kernels() as kern, count_torch_ops() as ops:
        attention_ops.attention_decode_fwd(
            q, k, v, lengths, masks.CAUSAL, shape.head_dim**-0.5, num_splits=splits,
            config=config, descales=descales,
        )  # fmt: skip
    flash = kern.traffic
    if ops.traffic.total:
        flash.add("torch ops", ops.traffic.read, ops.traffic.write)
    with count_torch_ops() as naive:
        if shape.fp8:  # (the cache widened to bf16 first)
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        reference.attention(q, k, v, causal=True)
    return flash, naive.traffic


def count_shared_prefix(
    shape: AttentionShape, n_prefix: int, splits: int
) -> tuple[Traffic, Traffic]:
    """Counted bytes of one shared-prefix decoding step on CPU tensors: ``(shared, copies)``.

    ``shape`` gives B, Hq, Hkv, Nq, D, the dtype and the mask; ``L = shape.nk`` keys fill each
    request's contiguous suffix cache. shared runs :func:`flashlite.attention_shared_prefix` over
    a prefix of ``n_prefix`` keys; copies runs :func:`flashlite.attention_kvcache` over caches of
    ``n_prefix + L`` keys holding a copy of the prefix (made before counting). Both with
    ``num_splits=splits`` (the CPU would pick 1), no new keys, no window, ``validate=False``;
    kernels counted in the interpreter, torch ops (shared's copy of q) as ``"torch ops"``.
    ``parts["@prefix_k"]`` and the like: the bytes that touched each input (shared only).

    The op takes no tile config: both count with the interpreter's decode tiles, which ``info``
    names (:func:`~flashlite.traffic.model.shared_prefix_tiles` with ``interpreted=True``); the
    model agrees evaluated with those tiles and ``splits``, not with the GPU's.
    """
    import flashlite

    B, Hq, Hkv = shape.batch, shape.heads, shape.hkv
    Nq, L, D = shape.seq_q, shape.nk, shape.head_dim
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(shape.dtype)

    q = rand(B, Nq, Hq, D)
    prefix_k, prefix_v = rand(n_prefix, Hkv, D), rand(n_prefix, Hkv, D)
    k_cache, v_cache = rand(B, L, Hkv, D), rand(B, L, Hkv, D)
    lengths = torch.full((B,), L, dtype=torch.int32)
    options: dict[str, Any] = {"causal": shape.causal, "num_splits": splits, "validate": False}
    suffix_tiles, prefix_tiles = shared_prefix_tiles(shape, interpreted=True)
    info = {
        "suffix_tiles": tuple(suffix_tiles[:2]),
        "prefix_tiles": tuple(prefix_tiles[:2]),
        "splits": splits,
    }
    with count_kernels() as kern, count_torch_ops() as ops:
        kern.watch(prefix_k=prefix_k, prefix_v=prefix_v, k_cache=k_cache, v_cache=v_cache)
        flashlite.attention_shared_prefix(
            q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens=lengths, **options
        )
    shared = kern.traffic
    if ops.traffic.total:
        shared.add("torch ops", ops.traffic.read, ops.traffic.write)
    shared.info = info
    k_whole, v_whole = (
        torch.cat([p.expand(B, -1, -1, -1), c], 1)
        for p, c in ((prefix_k, k_cache), (prefix_v, v_cache))
    )
    whole_lengths = lengths + n_prefix
    with count_kernels() as kern, count_torch_ops() as ops:
        flashlite.attention_kvcache(q, k_whole, v_whole, cache_seqlens=whole_lengths, **options)
    copies = kern.traffic
    if ops.traffic.total:
        copies.add("torch ops", ops.traffic.read, ops.traffic.write)
    copies.info = {"tiles": info["suffix_tiles"], "splits": splits}
    return shared, copies


def count_cross_entropy(
    rows: int, n: int, dtype: torch.dtype, *, weight: bool = False
) -> tuple[Traffic, Traffic]:
    """Counted bytes of one forward + backward of cross-entropy on ``(rows, n)`` logits (CPU):
    ``(flashlite, torch)``. flashlite's kernels are counted in the interpreter (the host's O(rows)
    reductions are left out, as the model leaves them); torch's ``cross_entropy`` (class dim 1)
    is counted op by op, forward and backward."""
    import torch.nn.functional as F

    import flashlite

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen).to(dtype)
    target = torch.randint(0, n, (rows,), generator=gen)
    w = torch.rand(n, generator=gen) + 0.5 if weight else None
    leaf = x.clone().requires_grad_()
    with count_kernels() as kern:
        flashlite.cross_entropy(
            leaf, target, w, label_smoothing=0.1 if weight else 0.0, validate=False
        ).backward()
    leaf = x.clone().requires_grad_()
    with count_torch_ops() as ops:
        F.cross_entropy(leaf, target, w.to(dtype) if w is not None else None).backward()
    return kern.traffic, ops.traffic


def count_mla(
    shape: AttentionShape, head_dim_v: int, tiles: tuple[int, int, int], splits: int
) -> Traffic:
    """Counted bytes of one absorbed MLA step (:func:`~flashlite.attention_mla_decode`'s kernel,
    and the combine when split) against full contiguous latent caches of ``Nk`` tokens, in the
    interpreter with the GPU's ``tiles`` ``(BLOCK_H, BLOCK_N, num_warps)`` and ``splits``: what
    :func:`~flashlite.traffic.model.model_flashlite_mla` models."""
    from flashlite.ops.attention.backends.split_kv.mla import MLADecodePlan

    gen = torch.Generator().manual_seed(0)
    b, hq, nq, d = shape.batch, shape.heads, shape.seq_q, shape.head_dim
    q = torch.randn(b, hq, nq, d, generator=gen).to(shape.dtype)
    kv = torch.randn(b, 1, shape.nk, d, generator=gen).to(shape.dtype)
    o = q.new_empty(b, hq, nq, head_dim_v)
    lse = torch.empty(b, hq, nq)
    lengths = torch.full((b,), shape.nk, dtype=torch.int32)
    plan = MLADecodePlan(q, kv, o, None, d**-0.5, True, splits, tiles)
    with count_kernels() as kern, count_torch_ops() as ops:
        plan(q, kv, kv, lengths, None, o, lse)
    t = kern.traffic
    if ops.traffic.total:
        t.add("torch ops", ops.traffic.read, ops.traffic.write)
    return t
