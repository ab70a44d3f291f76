"""Absorbed multi-head latent attention for decoding (DeepSeek-V2/V3): :func:`attention_mla_decode`
and its op ``flashlite::attention_mla_decode``, which appends new latents in place and runs the
MLA kernel (:mod:`flashlite.kernels.attention.mla`) through the cache step's plan."""

from __future__ import annotations

import torch

from flashlite import _backend
from flashlite.masking import masks
from flashlite.ops._dispatch import Op, forward_only
from flashlite.ops.attention.backends.split_kv.cache import TENSORS, kvcache_plan
from flashlite.ops.attention.cache_checks import check_index
from flashlite.ops.attention.checks import check_page_size, check_splits
from flashlite.ops.attention.kvcache import VALIDATE_MODES
from flashlite.ops.attention.request import Request
from flashlite.ops.common import check_flags, moved_call_device

#: The request fields the MLA step takes.
MLA_FIELDS = (
    "causal",
    "scale",
    "num_splits",
    "cache_seqlens",
    "block_table",
    "validate",
    "head_dim_v",
)


@forward_only
def attention_mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    scale: float,
    head_dim_v: int = 512,
    latent_new: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    num_splits: int | None = None,
    return_lse: bool = False,
    validate: bool | str = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decoding with absorbed multi-head latent attention (DeepSeek-V2/V3, FlashMLA's call):
    every query head attends to one shared latent cache whose first ``head_dim_v`` columns are
    also the values, read from the same bytes. Layout ``b n h d``. Forward only.

    Args:
        q: ``(B, Nq, Hq, D)``, the queries with the key up-projection absorbed: ``D =
            head_dim_v + rotary`` (DeepSeek: 512 + 64 = 576), ``Hq`` up to 128; ``Nq >= 1``
            (speculative decoding: several new tokens).
        latent_cache: ``(B, Ncap, 1, D)``, or with ``block_table`` a paged cache ``(num_pages,
            page_size, 1, D)`` (page size a multiple of 16, 64 included): one row per token,
            ``[c ; k_pe]``.
        cache_seqlens: int32 ``(B,)``: tokens already in the cache per batch.
        scale: the softmax scale, required (DeepSeek's is not ``1/sqrt(D)``).
        head_dim_v: the value columns, the cache's first ones (512); it and the rest
            (``D − head_dim_v``) must be powers of two from 16.
        latent_new: ``(B, Nnew, 1, D)``, written into the cache in place at
            ``cache_seqlens[b]`` before attending.
        block_table: int32 ``(B, max_pages)`` (vLLM's convention).
        causal: query i of Nq sees keys up to ``cache_seqlens[b] + Nnew − Nq + i``.
        num_splits: key chunks per block of query rows (None: chosen to fill the GPU; 1 on CPU).
        return_lse: also return the fp32 LSE ``(B, Hq, Nq)``.
        validate: as :func:`attention_kvcache`'s (the lengths and pages, on the device by
            default: no host sync).

    Returns:
        ``out`` ``(B, Nq, Hq, head_dim_v)`` (and the LSE).

    Raises:
        TypeError: non-tensors, dtypes (16/32-bit, one for q and the cache; int32 lengths and
            pages), a scale that is not a number, flags that are not bools.
        ValueError: ranks, a cache of more than one head, head dims that differ, a latent cache
            narrower than ``head_dim_v``, a ``head_dim_v`` or rotary part that is not a power of
            two from 16, lengths or pages of the wrong shape or device; with ``validate``, bad
            lengths or pages (raised when :func:`attention_kvcache` says).
    """
    tensors = _checked(q, latent_cache, cache_seqlens, latent_new, block_table, head_dim_v)
    check_flags(causal=causal, return_lse=return_lse)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise TypeError(f"scale must be a positive number (required), got {scale!r}")
    if not (isinstance(validate, bool) or validate == "sync"):
        raise TypeError(f"validate must be True, False or 'sync', got {validate!r}")
    if moved_call_device(q.device) is not None:
        raise NotImplementedError(
            "attention_mla_decode: CPU tensors in a process whose kernels run on a GPU; move q "
            "and the cache to the GPU (the append writes the cache in place)"
        )
    request = Request.make(
        causal,
        float(scale),
        num_splits=check_splits(num_splits),
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        validate=VALIDATE_MODES[validate],
        head_dim_v=head_dim_v,
    )
    o, lse = MLA(*tensors, request)
    return (o, lse) if return_lse else o


def _checked(
    q: object,
    latent: object,
    cache_seqlens: object,
    latent_new: object,
    block_table: object,
    head_dim_v: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The argument checks that read no values: ``(q, latent_cache, latent_new)``."""
    named = {"q": q, "latent_cache": latent, "cache_seqlens": cache_seqlens}
    for name, t in (*named.items(), ("latent_new", latent_new), ("block_table", block_table)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(latent, torch.Tensor)
    for name, t in (("q", q), ("latent_cache", latent), ("latent_new", latent_new)):
        if t is None:
            continue
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (b n h d), got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"{name} has dtype {t.dtype}; q and the latent cache share one of "
                "torch.float16, torch.bfloat16, torch.float32"
            )
        if not _backend.same_device(t, q):
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        _backend.check_device(t, name)
    b, _nq, _hq, d = q.shape
    if latent.shape[2] != 1 or latent.shape[3] != d:
        raise ValueError(
            f"latent_cache must be (B, Ncap, 1, D) (or paged (num_pages, page_size, 1, D)) with "
            f"q's D={d}: one latent head, got {tuple(latent.shape)}"
        )
    if type(head_dim_v) is not int:
        raise TypeError(f"head_dim_v must be an int, got {type(head_dim_v).__name__}")
    if head_dim_v >= d:
        raise ValueError(
            f"the latent cache ({d} columns) must be wider than head_dim_v={head_dim_v}: its "
            "first head_dim_v columns are the values, the rest the rotary key"
        )
    for what, n in (("head_dim_v", head_dim_v), ("the rotary part D − head_dim_v", d - head_dim_v)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{what} must be a power of two from 16, got {n}")
    check_index("cache_seqlens", cache_seqlens, q, 1)  # type: ignore[arg-type]
    if block_table is not None:
        check_index("block_table", block_table, q, 2)  # type: ignore[arg-type]
        check_page_size(latent.shape[1])
    elif latent.shape[0] != b:
        raise ValueError(f"latent_cache's batch {latent.shape[0]} is not q's {b}")
    if latent_new is not None:
        assert isinstance(latent_new, torch.Tensor)
        if latent_new.shape[0] != b or latent_new.shape[2:] != (1, d):
            raise ValueError(f"latent_new must be (B={b}, Nnew, 1, D={d}), got "
                             f"{tuple(latent_new.shape)}")  # fmt: skip
    return q, latent, latent_new  # type: ignore[return-value]


def _mla_body(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_new: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step: the append (and the device checks), then the MLA kernel, through the cache
    step's plan with the latent cache as both keys and values."""
    request.refuse("flashlite::attention_mla_decode", MLA_FIELDS)
    args = (
        q,
        latent_cache,
        latent_cache,
        request.cache_seqlens,
        latent_new,
        latent_new,
        request.block_table,
        masks.describe(request.causal),
        request.scale,
        request.num_splits,
        request.validate or "device",
    )
    plan = kvcache_plan(args, latent=request.head_dim_v)
    return plan(*args[:TENSORS])


def _mla_fake(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_new: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, nq, hq, _ = q.shape
    out = q.new_empty((b, nq, hq, request.head_dim_v or q.shape[3]))
    return out, q.new_empty((b, hq, nq), dtype=torch.float32)


#: ``flashlite::attention_mla_decode``: the step as an op that declares the cache written (the
#: append), so ``torch.compile`` traces a decode step through it. Forward only.
MLA = Op(
    "attention_mla_decode",
    _mla_body,
    fake=_mla_fake,
    inputs=3,
    request=Request,
    takes=MLA_FIELDS,
    mutates_args=("latent_cache",),
    moves=False,
)
