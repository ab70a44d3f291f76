"""The decode forward (few query rows against many keys, :mod:`flashlite.kernels.attention.decode`):
GQA heads packed into one tile, the keys split across programs and merged exactly, planned once per
kind of call (:class:`DecodePlan`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, _launch
from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.kernels.attention import decode as KD
from flashlite.masking import masks
from flashlite.ops.attention.backends.common import (
    descriptor_ok,
    dot_flags,
    empty_output,
    prescales_q,
)
from flashlite.ops.attention.backends.split_kv.splits import decode_tiles, default_splits
from flashlite.ops.attention.plan import Plan, Workspace
from flashlite.ops.attention.request import Request, tensor_meta
from flashlite.ops.common import on_compute_device


@on_compute_device
def attention_decode_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_k: torch.Tensor | None,
    mask: masks.Mask,
    scale: float,
    *,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: C.DecodeConfig | None = None,
    use_desc: bool | None = None,
    sinks: torch.Tensor | None = None,
    descales: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward for few query rows against many keys (:mod:`flashlite.kernels.attention.decode`):
    the query heads of a GQA group packed into one tile, the keys split across programs and the
    partials merged exactly (flash-decoding).

    Args:
        q: ``(B, Hq, Nq, D)`` view. k, v: a cache ``(B, Hkv, Ncap, D)`` or, with
            ``block_table`` ``(B, max_pages)`` int32, a paged one ``(num_pages, Hkv, page_size,
            D)`` (both as ``b h n d`` views of the ``b n h d`` storage).
        seqlens_k: int32 ``(B,)`` keys in use per batch (clamped to ``[0, Ncap]``), or None: all.
        mask: causal, sliding window and soft cap (:func:`flashlite.masks.describe`), aligned
            to each batch's length.
        scale: the softmax scale.
        num_splits: key chunks per row block (None: :func:`splits_for` this GPU; 1 on CPU).
        config: pin the tile (else :func:`flashlite.kernels.configs.decode_config`).
        use_desc: force TMA descriptor (True) or pointer (False) K/V loads (contiguous caches).
        sinks: fp32 ``(Hq,)`` sink logits (contiguous), merged once: chunk 0 starts from them.
        descales: e4m3 k and v (and maybe q): their fp32 ``(B, Hkv)`` factors and one stride
            pair, ``(q_descale, k_descale, v_descale, stride_b, stride_h)``; the output is q's
            16-bit dtype (bf16 for e4m3 q).

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` strided like q, the fp32 LSE ``(B, Hq, Nq)``, the splits used.
    """
    fp8 = descales is not None
    o = empty_output(q, torch.bfloat16 if q.dtype == torch.float8_e4m3fn else None)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    key = _decode_key(
        q,
        k,
        v,
        seqlens_k,
        block_table,
        mask,
        scale,
        num_splits,
        config,
        use_desc,
        tensor_meta(sinks),
        tensor_meta(descales[1]) if fp8 else None,  # (one stride pair for the three)
    )
    plan = _decode_plans.made(
        key,
        DecodePlan,
        q,
        k,
        v,
        o,
        seqlens_k,
        block_table,
        mask,
        scale,
        num_splits,
        config,
        use_desc,
        sinks is not None,
        None,
        None,
        fp8,
    )
    return o, lse, plan(q, k, v, seqlens_k, block_table, o, lse, sinks, descales=descales)


def _decode_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    *options: object,
) -> tuple:
    """What a :class:`DecodePlan` depends on: every tensor's :func:`tensor_meta` and every
    option (o is fresh and strided from q: q's entry pins it)."""
    return (
        tensor_meta(q),
        tensor_meta(k),
        tensor_meta(v),
        tensor_meta(seqlens_k),
        tensor_meta(block_table),
        *options,
    )


def plan_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, request: Request
) -> Plan:
    """The split-KV plan of a forward with ``num_splits`` (not packed) on ``(B, H, N, D)``
    views of these kinds (``o``: a call's fresh output): the decode kernel over the key chunks,
    then the merge of their partials (:class:`DecodePlan`)."""
    r = request
    sinks = r.sinks is not None
    dp = DecodePlan(
        q, k, v, o, r.seqlens_k, None, r.mask, r.scale, r.num_splits, None, None, sinks, fp8=r.fp8
    )

    def run(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, r: Request) -> None:
        dp(q, k, v, r.seqlens_k, None, o, lse, r.sinks, descales=descales(r))

    if dp.empty:
        return Plan("split_kv", run)
    parts = ()
    if dp.parts.size is not None:  # the partial outputs and LSEs, one fp32 buffer
        parts = (Workspace("partials", (dp.parts.size,), torch.float32),)
    return Plan("split_kv", run, dp.config, dp.use_desc, dp.grid, dp.splits, parts)


#: The Triton dtype an FP8 cache is widened to, per 16-bit torch dtype.
_WIDE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def descale_args(q_descale: Tensor, k_descale: Tensor, v_descale: Tensor) -> tuple:
    """Three ``(B, Hkv)`` descale views of one stride pair as the decode kernel takes them: the
    tensors, then that pair."""
    return (q_descale, k_descale, v_descale, *k_descale.stride())


def descales(request: Request) -> tuple | None:
    """An FP8 request's descale factors as the decode kernel takes them
    (:func:`descale_args`); None for another request."""
    if request.k_descale is None:
        return None
    return descale_args(request.q_descale, request.k_descale, request.v_descale)  # type: ignore[arg-type]


class DecodePlan:
    """Everything :func:`attention_decode_fwd` works out from shapes, strides and options — the
    tile, the key chunks, the grids, the kernels' scalar arguments and their compiled launches
    — made once per kind of call and reused: a decode loop calls one shape thousands of times,
    and at B=8 the host's per-call work was twice the GPU's (``benchmarks/NOTES.md``).

    The caller's key pins what the plan read (:func:`tensor_meta` of every tensor, every option).
    ``o`` and ``lse`` must be fresh allocations strided like the ones it was made with.
    ``mask_fn``, ``score_fn``: a mask function's and a score function's ``@triton.jit``
    function and how many buffers it takes (:mod:`flashlite.mods`); with either, each call
    passes the eight buffer slots (the mask's four, then the score function's). ``fp8``: an
    e4m3 cache (and maybe Q), whose descale factors each call passes.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        seqlens_k: torch.Tensor | None,
        block_table: torch.Tensor | None,
        mask: masks.Mask,
        scale: float,
        num_splits: int | None,
        config: C.DecodeConfig | None,
        use_desc: bool | None,
        sinks: bool = False,
        mask_fn: tuple[Any, int] | None = None,
        score_fn: tuple[Any, int] | None = None,
        fp8: bool = False,
    ) -> None:
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        page_size = k.shape[2] if block_table is not None else 0
        nk = block_table.shape[1] * page_size if block_table is not None else k.shape[2]
        self.empty = b * hq * nq == 0 or nk == 0
        self.splits = 1
        if self.empty:
            return
        group = hq // hkv
        if config is None:
            config = decode_tiles(
                nq * group, b * hkv, d, q.element_size(), _backend.kernels_interpreted()
            )
        if num_splits is None:  # (paged tiles load one after the other: two programs per SM)
            num_splits = default_splits(
                q.device, b * hkv, nq * group, nk, config.block_m, 2 if page_size else 1
            )
        bn = config.block_n
        split_len, splits = key_chunks(nk, bn, num_splits)
        self.config, self.splits = config, splits
        if use_desc is None:
            use_desc = config.use_desc
        self.use_desc = use_desc and block_table is None and descriptor_ok(k, v)
        self.desc_block = [1, 1, bn, C.block_d(d)]
        km = mask.kernel(nq, nk)
        self.options = _options(q, group, config, km, page_size, self.use_desc, mask_fn, score_fn)
        if fp8:  # the tiles widened to q's 16-bit dtype (bf16 for e4m3 q) in the kernel
            wide = q.dtype if q.dtype == torch.float16 else torch.bfloat16
            self.options.update(FP8=_WIDE[wide], PRESCALE_Q=True, **dot_flags(wide))
        self.options.update(HAS_SEQLENS=seqlens_k is not None, HAS_SINKS=sinks)
        self.grid = (C.cdiv(nq * group, config.block_m), b * hkv, splits)
        self.parts = Partials(splits, b, hq, nq, d, o)
        self.head = (
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *self.parts.out_strides,
            hkv,
            nq,
            nk,
            scale,
            km.left,
            km.right,
            km.softcap,
        )
        # the mods' eight buffer slots: zeros here without one, else each call's
        no_mods = mask_fn is None and score_fn is None
        self.tail = (
            block_table.stride(0) if block_table is not None else 0,
            k.shape[0],
            split_len,
            *((0,) * 8 if no_mods else ()),
        )
        self._decode = None  # bound at the first run (its tensors specialise)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens_k: torch.Tensor | None,
        block_table: torch.Tensor | None,
        o: torch.Tensor,
        lse: torch.Tensor,
        sinks: torch.Tensor | None = None,
        mod_buffers: Sequence[Any] | None = None,
        descales: tuple | None = None,
    ) -> int:
        """Run on tensors of the planned kind (any view of the same memory: only their data
        pointers are read; ``sinks`` given iff planned with them, ``mod_buffers``, the mods'
        eight slots, iff planned with a mod, ``descales`` (:func:`descales`) iff planned for
        FP8); returns the chunks used."""
        if self.empty:
            o.zero_()
            if sinks is not None and o.numel():  # no key: each row's LSE is its sink's
                lse.copy_(sinks.view(1, -1, 1).expand(lse.shape))
            else:
                lse.fill_(-math.inf)
            return 1
        parts = self.parts
        o_out, lse_out = (o, lse) if parts.size is None else parts.buffers(o.device)
        if self.use_desc:  # (descriptors hold the data pointer: built per call)
            k = TensorDescriptor(k, list(k.shape), list(k.stride()), self.desc_block)
            v = TensorDescriptor(v, list(v.shape), list(v.stride()), self.desc_block)
        args = (
            q,
            k,
            v,
            o_out,
            lse_out,
            *self.head,
            lse if seqlens_k is None else seqlens_k,
            lse if block_table is None else block_table,
            lse if sinks is None else sinks,
            *(descales or (lse, lse, lse, 0, 0)),
            *self.tail,
            *(mod_buffers or ()),
        )
        if self._decode is None:
            self._decode = _launch.launcher(KD._attention_decode_kernel).bind(args, self.options)
        self._decode(self.grid, *args)
        if parts.size is not None:
            parts.merge(o_out, lse_out, o, lse)
        return self.splits


class Partials:
    """A split-KV plan's partial results (the decode and MLA kernels'): one fp32 buffer of
    ``size`` elements for the chunks' outputs, ``(S·B, Hq, Nq, D)``, then their LSEs, ``(S·B·Hq,
    Nq)``, from a 16-byte aligned offset; and the combine launch that merges them into the
    call's ``o`` and ``lse`` (bound at the first run). ``size`` is None without a split: the
    kernel writes ``o`` and ``lse`` itself (``out_strides``: the kernel's output strides)."""

    def __init__(self, splits: int, b: int, hq: int, nq: int, d: int, o: torch.Tensor) -> None:
        self.split_at = -(-(splits * b * hq * nq * d) // 4) * 4
        self.size = self.split_at + splits * b * hq * nq if splits > 1 else None
        stride = (hq * nq * d, nq * d, d, 1)
        self.out_strides = stride if self.size is not None else tuple(o.stride())
        self.head = (b * hq * nq * d, *stride, *o.stride(), hq, nq, splits)
        self.options = _combine_options(d, splits, o.dtype)
        self.grid = (nq, b * hq, 1)
        self._combine: Any = None

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's partial outputs and LSEs, one allocation (the kernels read only their
        pointers: the strides are the plan's)."""
        o_out = torch.empty(self.size, dtype=torch.float32, device=device)  # type: ignore[arg-type]
        return o_out, o_out[self.split_at :]

    def merge(
        self, o_out: torch.Tensor, lse_out: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
    ) -> None:
        """The combine kernel: the partials into ``o`` and ``lse``."""
        args = (o_out, lse_out, o, lse, *self.head)
        if self._combine is None:
            kernel = _launch.launcher(KD._split_kv_combine_kernel)
            self._combine = kernel.bind(args, self.options)
        self._combine(self.grid, *args)


def _options(
    q: torch.Tensor,
    group: int,
    config: C.DecodeConfig,
    km: masks.KernelMask,
    page_size: int,
    use_desc: bool,
    mask_fn: tuple[Any, int] | None,
    score_fn: tuple[Any, int] | None,
) -> dict[str, Any]:
    """The decode kernel's constexprs and launch options (lengths and sinks: the caller's)."""
    d = q.shape[-1]
    options = {
        "GROUP": group,
        "HEAD_DIM": d,
        "BLOCK_D": C.block_d(d),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        **km.constexprs(),
        "PAGE_SIZE": page_size,
        "USE_DESC": use_desc,
        "PRESCALE_Q": prescales_q(q),
        **dot_flags(q.dtype),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    if mask_fn is not None:
        options.update(MASK_MOD=mask_fn[0], N_MASK_BUF=mask_fn[1])
    if score_fn is not None:
        options.update(SCORE_MOD=score_fn[0], N_SCORE_BUF=score_fn[1])
    return options


def _combine_options(d: int, splits: int, dtype: torch.dtype) -> dict[str, Any]:
    """The split combine kernel's constexprs and launch options."""
    return {
        "HEAD_DIM": d,
        "BLOCK_D": C.block_d(d),
        "SPLITS_PAD": max(2, 1 << (splits - 1).bit_length()),
        "ROUND_BF16": _backend.round_bf16(dtype),
        "num_warps": 4,
        "num_stages": 1,
    }


def key_chunks(n_keys: int, block_n: int, num_splits: int) -> tuple[int, int]:
    """``(keys per chunk, chunks)`` when ``n_keys`` keys are split ``num_splits`` ways in whole
    tiles of ``block_n`` (at most ``num_splits`` chunks): the decode kernel's split and the
    traffic model's."""
    split_len = block_n * C.cdiv(C.cdiv(n_keys, block_n), num_splits)
    return split_len, C.cdiv(n_keys, split_len)


def combine_splits(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge split-KV partials into ``o`` and ``lse`` (:mod:`flashlite.kernels.attention.decode`;
    the torch twin is :func:`flashlite.stats.merge_attention` folded over the splits).

    Args:
        o_parts: fp32 ``(S, B, H, Nq, D)``; lse_parts: contiguous fp32 ``(S, B, H, Nq)``.
        o: ``(B, H, Nq, D)`` output (any strides); lse: contiguous fp32 ``(B, H, Nq)``.
    """
    splits, b, h, nq, d = o_parts.shape
    combine = _launch.launcher(KD._split_kv_combine_kernel)
    combine[(nq, b * h)](
        o_parts,
        lse_parts,
        o,
        lse,
        *o_parts.stride(),
        *o.stride(),
        h,
        nq,
        splits,
        HEAD_DIM=d,
        BLOCK_D=C.block_d(d),
        SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()),
        ROUND_BF16=_backend.round_bf16(o.dtype),
        num_warps=4,
        num_stages=1,
    )


#: :class:`DecodePlan` per kind of :func:`attention_decode_fwd` call.
_decode_plans = Cache("attention.decode", 1024)
