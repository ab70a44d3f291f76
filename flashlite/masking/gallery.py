"""A gallery of mask and score functions (attention-gym's favourites), each a ``@triton.jit``
function with its torch twin and, for scores, its derivative. Each maker returns a
:class:`~flashlite.mods.MaskMod` or :class:`~flashlite.mods.ScoreMod` ready for
:func:`flashlite.create_block_mask` and :func:`flashlite.flex_attention` (and for torch's own
``create_block_mask`` and ``flex_attention``: calling one runs its twin).

Positions are top-left aligned as in FlexAttention (``q_idx >= kv_idx`` is causal); flashlite's
built-in ``causal=True`` is bottom-right aligned (flash-attn's: query ``i`` sees keys
``j <= i + Nk − Nq``), the same when ``Nq == Nk``. :func:`causal_lower_right` is the built-in's
alignment as a mask function, for any ``Nq`` and ``Nk``.

==============================  ==============================================================
maker                           keeps / adds
==============================  ==============================================================
``causal()``                    ``q_idx >= kv_idx`` (top-left, FlexAttention's)
``causal_lower_right(nq, nk)``  ``kv_idx <= q_idx + nk − nq`` (bottom-right, ``causal=True``)
``sliding_window(w)``           causal, and ``q_idx − kv_idx <= w`` (``window=(w, 0)`` built in)
``prefix_lm(n)``                keys below ``n`` for everyone, causal after
``document(ids)``               ``ids[b, q_idx] == ids[b, kv_idx]`` (packed sequences)
``document_causal``             document and causal (ids from varlen offsets: ``document_ids``)
``alibi(slopes)``               ``score + slopes[h]·(kv_idx − q_idx)``
``tanh_softcap(c)``             ``c·tanh(score / c)``
``relative_bias(t)``            ``score + t[h, clamp(kv_idx − q_idx, ±R) + R]``, ``t`` ``(H, 2R+1)``
==============================  ==============================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flashlite.masking.mods import MaskMod, ScoreMod, mask_mod, score_mod
from flashlite.masking.softcap import tanh

__all__ = [
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


# --------------------------------------------------------------------------- masks
# (what each mod loads per tile, for the traffic model: its buffers' loads, as issued)
def _nothing(bm: int, bn: int) -> int:
    return 0


def _id_reads(ids: torch.Tensor) -> Callable[[int, int], int]:
    # one id per query row and one per key column of the tile
    return lambda bm, bn: (bm + bn) * ids.element_size()


@triton.jit
def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@triton.jit
def _causal_lower_right(b, h, q_idx, kv_idx, offset):
    return kv_idx <= q_idx + offset


@triton.jit
def _sliding_window(b, h, q_idx, kv_idx, window):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)


@triton.jit
def _prefix_lm(b, h, q_idx, kv_idx, prefix):
    return (kv_idx < prefix) | (q_idx >= kv_idx)


@triton.jit
def _document(b, h, q_idx, kv_idx, ids, stride_b):
    row = ids + b * stride_b
    return tl.load(row + q_idx) == tl.load(row + kv_idx)


def _document_t(b, h, q_idx, kv_idx, ids, stride_b):  # type: ignore[no-untyped-def]
    flat = ids.reshape(-1)
    return flat[b * stride_b + q_idx] == flat[b * stride_b + kv_idx]


@triton.jit
def _document_causal(b, h, q_idx, kv_idx, ids, stride_b):
    return _document(b, h, q_idx, kv_idx, ids, stride_b) & (q_idx >= kv_idx)


def _document_causal_t(b, h, q_idx, kv_idx, ids, stride_b):  # type: ignore[no-untyped-def]
    return _document_t(b, h, q_idx, kv_idx, ids, stride_b) & (q_idx >= kv_idx)


def causal() -> MaskMod:
    """Causal, top-left aligned (FlexAttention's): query ``i`` sees keys ``j <= i``, whatever
    ``Nq`` and ``Nk``. Equal to ``attention(causal=True)`` (bottom-right aligned) only when
    ``Nq == Nk``; for fewer queries than keys use :func:`causal_lower_right`."""
    return mask_mod(_causal, name="flashlite.gallery.causal", tile_reads=_nothing)


def causal_lower_right(n_q: int, n_k: int) -> MaskMod:
    """Causal, bottom-right aligned (flash-attn's, and ``attention(causal=True)``'s): of
    ``n_q`` queries against ``n_k`` keys, query ``i`` sees keys ``j <= i + n_k − n_q`` (the
    last query sees every key; with ``n_q > n_k`` the first ``n_q − n_k`` see none). A mask
    function is not told the sequence lengths, so the maker takes them: build it for the
    call's ``(Nq, Nk)``. Equal to :func:`causal` when ``n_q == n_k``."""
    for name, n in (("n_q", n_q), ("n_k", n_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    return mask_mod(
        _causal_lower_right,
        n_k - n_q,
        name="flashlite.gallery.causal_lower_right",
        tile_reads=_nothing,
    )


def sliding_window(window: int) -> MaskMod:
    """Causal within ``window`` keys back: ``i − window <= j <= i`` (built-in
    ``window=(window, 0)``)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    return mask_mod(
        _sliding_window, window, name="flashlite.gallery.sliding_window", tile_reads=_nothing
    )


def prefix_lm(prefix: int) -> MaskMod:
    """Prefix-LM: every query sees the first ``prefix`` keys (bidirectional), then causal."""
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"prefix must be an int >= 0, got {prefix!r}")
    return mask_mod(_prefix_lm, prefix, name="flashlite.gallery.prefix_lm", tile_reads=_nothing)


def _doc_ids(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(
            f"ids must be an integer tensor (B, N) or (N,), got "
            f"{getattr(ids, 'dtype', type(ids).__name__)}"
        )
    if ids.dim() not in (1, 2):
        raise ValueError(f"ids must be (B, N) or (N,), got shape {tuple(ids.shape)}")
    ids = ids.contiguous()
    return ids, (ids.shape[1] if ids.dim() == 2 else 0)


def _id_limits(ids: torch.Tensor) -> tuple[int | None, None, int]:
    # (the mask reads ids[b, position]: a call with more batches or positions would read past)
    return (ids.shape[0] if ids.dim() == 2 else None, None, ids.shape[-1])


def random_documents(batch: int, n: int, docs: int, seed: int = 0) -> torch.Tensor:
    """Document ids ``(batch, n)`` int32 for ``docs`` documents of random lengths per sequence
    (every document at least one token): packed sequences for :func:`document`."""
    if not 1 <= docs <= n:
        raise ValueError(f"docs must be in [1, n={n}], got {docs}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, n, dtype=torch.int32)
    for b in range(batch):
        # docs − 1 distinct cut points in [1, n): each document gets at least one token
        cuts = torch.randperm(n - 1, generator=gen)[: docs - 1] + 1
        starts = torch.zeros(n, dtype=torch.int32)
        starts[cuts] = 1
        ids[b] = torch.cumsum(starts, 0, dtype=torch.int32)
    return ids


def document_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document ids ``(total,)`` int32 of packed sequences in flash-attn's varlen convention:
    token t belongs to sequence b iff ``cu_seqlens[b] <= t < cu_seqlens[b + 1]``. With
    :func:`document_causal` over the packed sequence as one batch, ``flex_attention`` gives
    what ``attention_varlen(causal=True)`` gives for equal query and key lengths.

    Args:
        cu_seqlens: int ``(batch + 1,)`` offsets (starting at 0, non-decreasing).
        total: the packed length; None reads ``cu_seqlens[-1]`` (a host sync on a GPU: pass
            it, e.g. ``q.shape[0]``, to stay asynchronous).

    Returns:
        int32 ids on ``cu_seqlens``' device (tokens past the last offset get ``batch``).
    """
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.is_floating_point()
        or cu_seqlens.dtype == torch.bool
        or cu_seqlens.dim() != 1
        or len(cu_seqlens) < 1
    ):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor (batch + 1,), got "
            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
            f"{tuple(getattr(cu_seqlens, 'shape', ()))}"
        )
    if total is None:
        total = int(cu_seqlens[-1])
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an int >= 0, got {total!r}")
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # (the sequence of token t: how many sequences end at or before it)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True).to(torch.int32)


def document(ids: torch.Tensor) -> MaskMod:
    """Packed sequences: a query sees the keys of its own document. ``ids`` ``(B, N)`` (or
    ``(N,)`` for every batch): the document of each token, for self-attention (``Nq = Nk = N``)."""
    ids, stride = _doc_ids(ids)
    return mask_mod(
        _document,
        ids,
        stride,
        torch_fn=_document_t,
        name="flashlite.gallery.document",
        tile_reads=_id_reads(ids),
        limits=_id_limits(ids),
    )


def document_causal(ids: torch.Tensor) -> MaskMod:
    """:func:`document` and causal: packed causal language modelling."""
    ids, stride = _doc_ids(ids)
    name = "flashlite.gallery.document_causal"
    return mask_mod(
        _document_causal,
        ids,
        stride,
        torch_fn=_document_causal_t,
        name=name,
        tile_reads=_id_reads(ids),
        limits=_id_limits(ids),
    )


# --------------------------------------------------------------------------- scores
@triton.jit
def _as_float(i):
    """``i.to(float32)`` for ``|i| < 2^22`` in two full-rate instructions: ``i`` added to the
    bits of ``1.5·2^23`` is that float plus ``i`` exactly (one unit in the last place is 1
    there). The conversion instruction issues at a quarter of the FMA rate, on the unit
    ``exp2`` needs: a tile's worth of them slows the forward by a fifth."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _alibi(score, b, h, q_idx, kv_idx, slopes):
    # converted before subtracting: a column and a row of conversions, not one per score;
    # exact below 2^22
    return score + tl.load(slopes + h) * (_as_float(kv_idx) - _as_float(q_idx))


@triton.jit
def _alibi_grad(score, b, h, q_idx, kv_idx, slopes):
    # the derivative of score + bias: a constant (the kernels' product with it folds away)
    return 1.0


def _alibi_t(score, b, h, q_idx, kv_idx, slopes):  # type: ignore[no-untyped-def]
    return score + slopes[h] * (kv_idx - q_idx).to(score.dtype)


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes for ``heads`` heads: ``2^(−8(i+1)/H)`` for a power of two, and the
    paper's interleaving otherwise (fp32 ``(H,)``)."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(heads)))
    slopes = powers(p) + (powers(2 * p)[0::2][: heads - p] if heads > p else [])
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: ``score + slopes[h]·(kv_idx − q_idx)`` (``slopes`` fp32 ``(H,)``, e.g.
    :func:`alibi_slopes`); a linear penalty on distance, paired with a causal mask."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise ValueError(
            f"slopes must be a 1-D tensor (H,), got {getattr(slopes, 'shape', slopes)}"
        )
    slopes = slopes.float().contiguous()
    return score_mod(
        _alibi,
        slopes,
        grad=_alibi_grad,
        torch_fn=_alibi_t,
        name=ALIBI_NAME,
        tile_reads=lambda bm, bn: 4,
        limits=(None, len(slopes), None),
        fast_path="head_linear_bias",
    )


#: The name :func:`alibi` registers its score function under (the Hopper forward recognises it
#: and applies the bias as a column and a row term: one add a score).
ALIBI_NAME = "flashlite.gallery.alibi"


@triton.jit
def _capped(score, cap, FAST: tl.constexpr):
    """``(cap·tanh(score / cap), its derivative)``; ``FAST``: the hardware tanh."""
    t = tanh(score / cap, FAST)
    return cap * t, 1.0 - t * t


@triton.jit
def _softcap(score, b, h, q_idx, kv_idx, cap):
    return _capped(score, cap, False)[0]


@triton.jit
def _softcap_grad(score, b, h, q_idx, kv_idx, cap):
    return _capped(score, cap, False)[1]


@triton.jit
def _softcap_approx(score, b, h, q_idx, kv_idx, cap):
    return _capped(score, cap, True)[0]


@triton.jit
def _softcap_approx_grad(score, b, h, q_idx, kv_idx, cap):
    return _capped(score, cap, True)[1]


def _softcap_t(score, b, h, q_idx, kv_idx, cap):  # type: ignore[no-untyped-def]
    return cap * torch.tanh(score / cap)


def tanh_softcap(cap: float, approx: bool = False) -> ScoreMod:
    """Gemma 2's soft cap ``cap·tanh(score / cap)`` (built in as ``softcap=cap``). ``approx``:
    the GPU's hardware ``tanh`` (what the built-in uses for 16-bit inputs, whose own rounding
    is coarser; 2–3× cheaper); otherwise exact to fp32."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise ValueError(f"cap must be a finite positive number, got {cap!r}")
    if approx:
        return score_mod(
            _softcap_approx,
            float(cap),
            grad=_softcap_approx_grad,
            torch_fn=_softcap_t,
            name="flashlite.gallery.tanh_softcap_approx",
            tile_reads=_nothing,
        )
    return score_mod(
        _softcap,
        float(cap),
        grad=_softcap_grad,
        torch_fn=_softcap_t,
        name="flashlite.gallery.tanh_softcap",
        tile_reads=_nothing,
    )


@triton.jit
def _relative(score, b, h, q_idx, kv_idx, table, reach, stride_h):
    # one gather a score: a per-tile branch to one entry for tiles past the reach measured
    # slower on the H200 (the row bounds need a reduction across warps)
    rel = tl.minimum(tl.maximum(kv_idx - q_idx, -reach), reach) + reach
    return score + tl.load(table + h * stride_h + rel)


@triton.jit
def _relative_grad(score, b, h, q_idx, kv_idx, table, reach, stride_h):
    return 1.0  # (as ALiBi's)


def _relative_t(score, b, h, q_idx, kv_idx, table, reach, stride_h):  # type: ignore[no-untyped-def]
    rel = (kv_idx - q_idx).clamp(-reach, reach) + reach
    return score + table.reshape(-1)[h * stride_h + rel].to(score.dtype)


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A learned relative-position bias (T5-style, unbucketed): ``score + table[h, r]`` with
    ``r = clamp(kv_idx − q_idx, −R, R) + R`` for ``table`` fp32 ``(H, 2R + 1)``. The table gets
    no gradient here."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] % 2 != 1:
        raise ValueError(
            "table must be a 2-D tensor (H, 2R + 1) with an odd second size, got "
            f"{getattr(table, 'shape', table)}"
        )
    table = table.float().contiguous()
    reach = (table.shape[1] - 1) // 2
    return score_mod(
        _relative,
        table,
        reach,
        table.shape[1],
        grad=_relative_grad,
        torch_fn=_relative_t,
        name="flashlite.gallery.relative_bias",
        tile_reads=lambda bm, bn: 4 * bm * bn,
        limits=(None, table.shape[0], None),
    )
