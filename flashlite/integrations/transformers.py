"""Hugging Face ``transformers`` models on flashlite's kernels
(``pip install "flashlite-attn[hf]"``).

    from flashlite.integrations.transformers import register
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register())

:func:`register` adds flashlite to ``transformers.AttentionInterface`` and its mask hook to
``AttentionMaskInterface``. What models pass maps onto flashlite's options: causal or not, the
scaling, a sliding window (Mistral, Gemma 2/3: ``window=(W − 1, 0)``), a soft cap (Gemma 2),
GQA (key/value heads as they come, never repeated), attention sinks (gpt-oss's ``s_aux``: one
learnable logit per head, ``sinks=``), a padded batch (the mask hook hands over
the ``(B, Nk)`` padding mask, never an ``N × N`` one, and the real tokens run as packed
sequences through :func:`flashlite.attention_varlen`), and generation with a KV cache (a few
queries against the grown cache: on a GPU :func:`flashlite.attention` takes its split-KV
decode kernel). What it cannot map raises ``NotImplementedError`` naming the feature (attention
dropout in training, dense 4-D masks); it never falls back to another implementation.

``transformers`` is imported only by :func:`register`: ``import flashlite`` never imports it.
"""

from __future__ import annotations

from typing import Any

import torch

import flashlite

#: The name to pass as ``attn_implementation``. transformers 5.x reads any name that contains
#: "flash" as a Flash-Attention kernel to fetch from its hub (offline that fails), and any that
#: contains "sdpa" as SDPA, so the name avoids both.
NAME = "flite"


def _mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask hook: the 2-D ``(B, Nk)`` padding mask (True = a real token), or None
    when nothing is padded — never an ``N × N`` mask (causality and windows are the kernel's)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook.

    Args:
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hkv, Nk, D)`` (the cache included);
            value may have a head dim of its own, ``Dv`` (DeepSeek's multi-head latent
            attention).
        attention_mask: None, or the ``(B, Nk)`` padding mask from :func:`_mask`.
        scaling, sliding_window, softcap: the layer's; ``is_causal`` (kwargs) or the module's;
            ``s_aux`` (kwargs): gpt-oss's per-head sink logits, ``(Hq,)``.

    Returns:
        ``(out, None)``: ``out`` ``(B, Nq, Hq, Dv)`` (no attention weights).
    """
    for feature in _UNSUPPORTED:  # e.g. ALiBi biases: refused, never dropped
        if kwargs.get(feature) is not None:
            raise NotImplementedError(
                f"{_model_name(module)} passes {feature!r} to attention "
                f"({_UNSUPPORTED[feature]}), which flashlite does not support"
            )
    if dropout and module.training:
        raise NotImplementedError(
            f"{_model_name(module)}: attention dropout > 0 in training "
            f"(dropout={dropout}); flashlite has no dropout"
        )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    window = None
    if sliding_window is not None:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"{_model_name(module)}: a {attention_mask.dim()}-D attention_mask (a dense custom or "
            "float mask); flashlite takes (B, Nk) padding masks only"
        )
    opts = {
        "causal": causal,
        "scale": scaling,
        "window": window,
        "softcap": softcap,
        "sinks": kwargs.get("s_aux"),
    }
    if attention_mask is None:
        out = flashlite.attention(query, key, value, **opts).transpose(1, 2)
    else:
        out = _unpadded(query, key, value, attention_mask.bool(), opts)
    return out.contiguous(), None


def _unpadded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    opts: dict[str, Any],
) -> torch.Tensor:
    """A padded batch as packed sequences (``attention_varlen``): each row's real tokens, in
    order, its queries the last ``Nq`` positions; padded query rows give 0. ``(B, Nq, Hq,
    Dv)`` (V's head dim, which may differ from Q's: DeepSeek's)."""
    b, hq, nq, _ = query.shape
    nk = key.shape[2]
    q_mask, k_mask = mask[:, -nq:], mask[:, -nk:]
    q_rows = q_mask.reshape(-1).nonzero().squeeze(1)
    k_rows = k_mask.reshape(-1).nonzero().squeeze(1)

    def packed(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])[rows]

    lens_q, lens_k = q_mask.sum(1), k_mask.sum(1)
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)
    # (Nq and Nk bound the lengths, so no host sync for their maxima; the offsets are built
    # here, so they need no checking either)
    out = flashlite.attention_varlen(
        packed(query, q_rows),
        packed(key, k_rows),
        packed(value, k_rows),
        cu_q,
        cu_k,
        nq,
        nk,
        validate=False,
        **opts,
    )
    dv = value.shape[3]
    full = query.new_zeros((b * nq, hq, dv))
    full[q_rows] = out
    return full.view(b, nq, hq, dv)


#: Arguments some models pass to their attention function that flashlite cannot honour.
_UNSUPPORTED = {
    "position_bias": "an additive position bias such as ALiBi or T5's",
    "alibi": "ALiBi",
    "head_mask": "a per-head mask",
}


def _model_name(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


def register() -> str:
    """Register flashlite in ``transformers.AttentionInterface`` (and its mask hook); returns
    the name to pass as ``attn_implementation``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(
            "flashlite.integrations.transformers needs Hugging Face transformers >= 5: "
            'pip install "flashlite-attn[hf]"'
        ) from err

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
