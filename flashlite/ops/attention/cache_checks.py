""":func:`~flashlite.attention_kvcache`'s argument checks: its tensors (layout ``b n h d``,
dtypes, devices, the caches' shapes, lengths and pages, new keys and values) and its mask and
score functions. Every check comes before anything is written into the caches."""

from __future__ import annotations

from typing import Any

import torch

from flashlite import _backend
from flashlite.masking import mods
from flashlite.masking.mod_args import check_mod
from flashlite.ops.attention.checks import DTYPES, MAX_HEAD_DIM, check_page_size, check_writable
from flashlite.ops.attention.fp8 import E4M3, OTHER_FP8, check_dtype, factor_views
from flashlite.ops.attention.request import mod_fields


def check_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> None:
    """TypeError, ValueError or NotImplementedError naming the argument, unless the tensors
    make one decode step (q ``(B, Nq, Hq, D)``, caches ``(B, Ncap, Hkv, D)`` or paged, int32
    lengths and pages, ``k_new``/``v_new`` ``(B, Nnew, Hkv, D)`` into writable caches)."""
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("k_new", k_new),
        ("v_new", v_new),
    ):
        if t is None:
            continue
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (b n h d), got {tuple(t.shape)}")
        if name in ("k_cache", "v_cache") and t.dtype == E4M3 and q.dtype in DTYPES[:2]:
            pass  # an FP8 cache read by 16-bit queries
        elif t.dtype != q.dtype or t.dtype not in DTYPES:
            if t.dtype in OTHER_FP8:
                check_dtype(t, name, fp8=True)
            raise TypeError(
                f"{name} has dtype {t.dtype}; q, the caches and k_new/v_new share "
                "one of torch.float16, torch.bfloat16, torch.float32 (or the caches are "
                "torch.float8_e4m3fn with 16-bit q, k_new, v_new)"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        _backend.check_device(t, name)
    bsz, nq, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d:
        raise _layout_error(q, k_cache, block_table is not None, f"q's D={d}, the caches' D={dk}")
    if hkv == 0 or hq % hkv:
        problem = f"read as Hq={hq}, Hkv={hkv}: Hq is not a multiple of Hkv"
        raise _layout_error(q, k_cache, block_table is not None, problem)
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} is not supported: flashlite supports 1 to 256")
    for name, t, dims in (("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2)):
        if t is not None:
            check_index(name, t, q, dims)
    if block_table is None and k_cache.shape[0] != bsz:
        problem = f"q's B={bsz}, the caches' B={k_cache.shape[0]}"
        raise _layout_error(q, k_cache, False, problem)
    if block_table is not None:
        check_page_size(k_cache.shape[1])
    n_new = 0 if k_new is None else k_new.shape[1]
    if k_new is not None:
        want = (bsz, n_new, hkv, d)
        if k_new.shape != want or v_new.shape != want:  # type: ignore[union-attr]
            raise ValueError(
                f"k_new and v_new must be (B, Nnew, Hkv, D) = {want}, got "
                f"{tuple(k_new.shape)} and {tuple(v_new.shape)}"  # type: ignore[union-attr]
            )
        check_writable(k_cache, v_cache)


def cache_fp8(
    q: torch.Tensor, k_cache: torch.Tensor, k_descale: object, v_descale: object
) -> dict[str, object]:
    """The request fields of an FP8 cache: q's factor (ones) and the caches' ``(B, Hkv)``
    views, one stride pair for the three; ``{}`` for a 16/32-bit cache, whose factors are
    refused by name."""
    given = [n for n, x in (("k_descale", k_descale), ("v_descale", v_descale)) if x is not None]
    if k_cache.dtype != E4M3:
        if given:
            raise TypeError(
                f"{', '.join(given)}: for torch.float8_e4m3fn caches; these are {k_cache.dtype}"
            )
        return {}
    b, hkv = q.shape[0], k_cache.shape[2]
    given = {"q_descale": None, "k_descale": k_descale, "v_descale": v_descale}
    return dict(zip(given, factor_views(given, b, hkv, q, per_head=True), strict=True))


def check_index(name: str, t: torch.Tensor, q: torch.Tensor, dims: int) -> None:
    """A cache's lengths (``dims`` 1) or block table (2): int32, ``B`` rows, on q's device."""
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != dims or t.shape[0] != q.shape[0] or t.device != q.device:
        shape = "(B,)" if dims == 1 else "(B, max_pages)"
        raise ValueError(
            f"{name} must be a {shape} tensor with B={q.shape[0]} on {q.device}, "
            f"got {tuple(t.shape)} on {t.device}"
        )


def _layout_error(q: torch.Tensor, k_cache: torch.Tensor, paged: bool, problem: str) -> ValueError:
    """The ValueError for q and caches that do not make one ``b n h d`` call: the layout, the
    shapes expected and given, and the transposes that fix tensors given as ``b h n d``."""
    cache = "(num_pages, page_size, Hkv, D)" if paged else "(B, Ncap, Hkv, D)"
    msg = (
        f"attention_kvcache's layout is fixed at 'b n h d': q must be (B, Nq, Hq, D) and "
        f"k_cache, v_cache {cache}, with one D and Hq a multiple of Hkv; got q "
        f"{tuple(q.shape)} and k_cache {tuple(k_cache.shape)} ({problem})"
    )
    fix = _transposes(q.shape, k_cache.shape, paged)
    if fix:
        verb = "looks" if len(fix) == 1 else "look"
        calls = ", ".join(f"{n}.transpose(1, 2)" for n in fix)
        names = fix[0] if len(fix) == 1 else f"{', '.join(fix[:-1])} and {fix[-1]}"
        msg += f"; {names} {verb} like 'b h n d': pass {calls}"
    return ValueError(msg)


def _transposes(qs: torch.Size, ks: torch.Size, paged: bool) -> list[str]:
    """The fewest of q and the caches that, read as ``b h n d``, make the heads agree (none
    when the head dims differ or no reading does)."""
    if ks[3] != qs[3] or (ks[2] > 0 and qs[2] % ks[2] == 0):  # (the heads agree as given)
        return []
    readings = [(["q"], qs[1], ks[2])]
    if not paged:  # (a paged cache's second dimension is its page size, never its heads)
        readings.append((["k_cache", "v_cache"], qs[2], ks[1]))
        readings.append((["q", "k_cache", "v_cache"], qs[1], ks[1]))
    for names, hq, hkv in readings:
        if hkv > 0 and hq % hkv == 0:
            return names
    return []


def cache_mods(
    mask_mod: Any,
    score_mod: Any,
    softcap: float | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
) -> dict[str, object]:
    """The request fields of a decode step's mask and score functions, each checked against
    the call (its buffers on q's device, the batch, heads and positions they hold)."""
    bsz, hq = q.shape[0], q.shape[2]
    mods_given: dict[str, object] = {}
    if mask_mod is not None or score_mod is not None:
        # (the positions a mod may see: the cache's capacity per sequence)
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        if mask_mod is not None:
            mm = mods.as_mask_mod(mask_mod)
            check_mod(mm, "mask_mod", q.device, bsz, hq, capacity)
            mods_given.update(mod_fields("mask", mm))
        if score_mod is not None:
            if softcap is not None:
                raise ValueError(
                    "attention_kvcache takes score_mod without softcap: write the "
                    "cap as flashlite.gallery.tanh_softcap(c) in it"
                )
            sm = mods.as_score_mod(score_mod)
            check_mod(sm, "score_mod", q.device, bsz, hq, capacity)
            mods_given.update(mod_fields("score", sm))
    return mods_given
