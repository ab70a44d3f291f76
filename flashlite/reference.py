"""Plain torch baselines: every test and every traffic comparison is held against these.

Nothing here imports the rest of flashlite but :mod:`flashlite.masks`, the one definition of
which keys a query sees, and :mod:`flashlite.mods`, whose torch twins apply your own masks and
score functions.
"""

from __future__ import annotations

import math

import torch

from flashlite.masking.masks import torch_visible
from flashlite.masking.mods import MaskMod, ScoreMod, torch_mask, torch_score

#: ``backend=`` names of :func:`sdpa` and the torch backend each one pins.
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def softmax_three_pass(x: torch.Tensor, dim: int = -1, *, log: bool = False) -> torch.Tensor:
    """The safe softmax as three passes over the row: max, sum of exponentials, write.

    Args:
        x: ``(..., n, ...)`` float tensor.
        dim: the dimension to normalise.
        log: return ``log_softmax`` instead.

    Returns:
        Same shape and dtype as ``x``; computed in fp32 (fp64 for fp64 inputs).
    """
    xf = x.double() if x.dtype == torch.float64 else x.float()
    m = xf.amax(dim, keepdim=True)  # pass 1
    shifted = xf - m
    s = torch.exp(shifted).sum(dim, keepdim=True)  # pass 2
    out = shifted - torch.log(s) if log else torch.exp(shifted) / s  # pass 3
    return out.to(x.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    upcast: bool = False,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Naive attention that materialises ``S = Q Kᵀ`` and ``P = softmax(S)`` (layout b h n d),
    one torch op per step: the traffic model counts them (docs/how-it-works/hbm-traffic.md).

    Args:
        q: ``(B, Hq, Nq, D)``.
        k, v: ``(B, Hkv, Nk, D)`` with ``Hq % Hkv == 0`` (k and v are broadcast over groups).
        causal: bottom-right aligned mask: query i sees key j iff ``j <= i + Nk - Nq``.
        scale: defaults to ``1/sqrt(D)``.
        upcast: compute in fp64 (the accurate reference) instead of the input dtype.
        return_lse: also return the fp32 ``(B, Hq, Nq)`` natural-log LSE of the scaled scores.
        window: ``(left, right)`` keys around the bottom-right diagonal, −1 unlimited
            (flash-attn's ``window_size``; with ``causal`` right is 0), as
            :func:`flashlite.masks.torch_visible` builds it.
        softcap: cap ``c > 0`` of Gemma 2's ``c·tanh(s/c)`` on the scaled scores, before the
            mask.
        seqlens_k: ``(B,)`` ints: batch b has only its first ``seqlens_k[b]`` keys (causal and
            window align to that length).
        sinks: ``(Hq,)`` sink logits in the scaled-score space (gpt-oss): one more column of
            each head's scores, with no value, in the softmax's denominator (differentiable).
        mask_mod, score_mod: your own mask and score function (:mod:`flashlite.mods`), their
            torch twins applied to the ``(B, Hq, Nq, Nk)`` scores: the score function after the
            cap, then the mask.

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` in ``q``'s dtype (and the LSE, the sink's column included).
        Rows with no visible key give 0 (and with a sink, LSE = the sink).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    # GQA: view q as (B, Hkv, group, Nq, D) and broadcast k, v over the group (torch.matmul
    # materialises that broadcast when B·Hkv > 1; the traffic model counts the copy)
    if hq != hkv:
        q = q.reshape(b, hkv, hq // hkv, nq, d)
        k, v = k.unsqueeze(2), v.unsqueeze(2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2))
    s = s * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    masked = causal or window is not None or seqlens_k is not None or mask_mod is not None
    if masked or score_mod is not None:
        s = _masked(s, hq, causal, window, seqlens_k, mask_mod, score_mod)
    if sinks is not None:  # the sink's column, per query head, broadcast over batch and rows
        sink = sinks.to(s.dtype).reshape(*([hkv, hq // hkv] if hq != hkv else [hq]), 1, 1)
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if masked:  # rows that see no key are all −inf: softmax gives NaN, the convention is 0
        p = p.nan_to_num(0.0)
    if sinks is not None:  # the sink has no value: its probability leaves the output
        p = p[..., :-1]
    o = torch.matmul(p, v).reshape(b, hq, nq, v.shape[-1]).to(dtype)
    if not return_lse:
        return o
    lse = torch.logsumexp(s.float() if not upcast else s, dim=-1).reshape(b, hq, nq).float()
    return o, lse


def _masked(
    s: torch.Tensor,
    hq: int,
    causal: bool,
    window: tuple[int, int] | None,
    seqlens_k: torch.Tensor | None,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
) -> torch.Tensor:
    """:func:`attention`'s scaled (and capped) scores ``s``, ``(B, Hq, Nq, Nk)`` or with GQA
    ``(B, Hkv, group, Nq, Nk)``, through the score function, then every mask: −inf where a
    query does not see a key."""
    b, nq, nk, device = s.shape[0], s.shape[-2], s.shape[-1], s.device
    if score_mod is not None or mask_mod is not None:  # the twins see (B, Hq, Nq, Nk)
        s4 = s.reshape(b, hq, nq, nk)
        if score_mod is not None:
            s4 = torch_score(score_mod, s4)
        if mask_mod is not None:
            s4 = torch.where(torch_mask(mask_mod, b, hq, nq, nk, device), s4, -math.inf)
        s = s4.reshape(s.shape)
    if seqlens_k is not None:  # one (Nq, Nk) mask per batch, broadcast over the heads
        seen = torch.zeros(b, nq, nk, dtype=torch.bool, device=device)
        for i, n in enumerate(seqlens_k.tolist()):
            seen[i, :, :n] = torch_visible(nq, n, causal, window=window, device=device)
        seen = seen.view(b, *([1] * (s.dim() - 3)), nq, nk)
        s = torch.where(seen, s, -math.inf)
    elif causal or window is not None or mask_mod is not None:
        s = torch.where(torch_visible(nq, nk, causal, window=window, device=device), s, -math.inf)
    return s


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = "flash",
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on one pinned backend, with flashlite's conventions.

    The one SDPA runner of the benchmarks and the traffic tool. Two conventions differ from SDPA's
    defaults and are bridged here: ``causal`` is bottom-right aligned (SDPA's ``is_causal`` is
    top-left; the two agree when ``Nq == Nk``, otherwise ``causal_lower_right`` is passed), and
    ``Hq != Hkv`` (GQA) is passed as ``enable_gqa=True`` instead of repeating k and v.

    Args:
        q: ``(B, Hq, Nq, D)``.
        k, v: ``(B, Hkv, Nk, D)`` with ``Hq % Hkv == 0``.
        causal: query i sees key j iff ``j <= i + Nk - Nq`` (as :func:`attention`).
        scale: defaults to ``1/sqrt(D)``.
        backend: one of ``"flash"``, ``"cudnn"``, ``"efficient"``, ``"math"`` (the call fails
            when that backend cannot run the inputs, instead of silently falling back), or None
            to let torch choose. Pinning enters ``sdpa_kernel`` on every call, which costs host
            time; a loop timing per-call cost pins once around it and passes None.

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` in ``q``'s dtype.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    if backend is not None and backend not in SDPA_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(SDPA_BACKENDS)} or None")
    nq, nk = q.shape[-2], k.shape[-2]
    extra: dict = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if causal and nq != nk:
        extra["attn_mask"] = causal_lower_right(nq, nk)
    else:
        extra["is_causal"] = causal
    run = torch.nn.functional.scaled_dot_product_attention
    if backend is None:
        return run(q, k, v, scale=scale, **extra)
    pinned = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    with sdpa_kernel(pinned):
        return run(q, k, v, scale=scale, **extra)


def quantize_e4m3(
    x: torch.Tensor, per_head: bool = False, kv_heads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``b h n d``) as ``float8_e4m3fn`` and its fp32 descale factor (``x ≈
    x8·descale``): the largest magnitude maps to e4m3's 448. ``per_head``: one factor per
    batch and KV head, ``(B, kv_heads)`` (default: x's heads; queries share one per group of
    ``H / kv_heads`` heads), else one for the tensor, ``(1,)``: flash-attn's two conventions."""
    if per_head:
        b, h = x.shape[:2]
        kv = kv_heads or h
        amax = x.detach().abs().reshape(b, kv, -1).amax(dim=-1).float()
        descale = (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
        factor = descale.repeat_interleave(h // kv, 1)[:, :, None, None]
        return (x.float() / factor).to(torch.float8_e4m3fn), descale
    amax = x.detach().abs().amax().float()
    descale = (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    return (x.float() / descale).to(torch.float8_e4m3fn), descale


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """FlashAttention-3's FP8 recipe in plain torch (layout b h n d), the row maximum known:
    fp32 scores of the e4m3 ``q``, ``k`` times ``scale·q_descale·k_descale``, ``p = e^(s − max)``
    rounded to e4m3 for the product with ``v``, the denominator summed from the unrounded
    ``p``, the output times ``v_descale``. The descales are ``(1,)`` or ``(B, Hkv)``. Tests hold
    the kernels' FP8 error against this recipe's own."""
    b, hq, nq, d = q.shape
    group = hq // k.shape[1]

    def factor(x: torch.Tensor | None) -> torch.Tensor:  # (B, Hq, 1, 1) from (1,) or (B, Hkv)
        if x is None:
            return torch.ones((1, 1, 1, 1), device=q.device)
        return x.float().expand(b, k.shape[1]).repeat_interleave(group, 1)[:, :, None, None]

    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * (
        scale * factor(q_descale) * factor(k_descale)
    )
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal or window is not None or seqlens_k is not None:
        s = _masked(s, hq, causal, window, seqlens_k, None, None)
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(b, hq, nq, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p8 = p[..., : nq and kf.shape[2]].to(torch.float8_e4m3fn).float()
    o = torch.matmul(p8, vf) * factor(v_descale) / denom
    return torch.where(denom > 0, o, 0.0).to(out_dtype)
