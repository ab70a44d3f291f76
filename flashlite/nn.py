"""``torch.nn`` modules on flashlite's ops."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import flashlite


class MultiheadAttention(nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)`` on
    :func:`flashlite.attention`: the same parameters (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``), so ``load_state_dict`` of torch's module works both ways.

    Supported: self- and cross-attention, ``is_causal`` (torch's top-left causal mask for
    ``N × N`` self-attention), and ``key_padding_mask`` whose padding is at the end of each row
    (passed as per-batch key lengths, ``seqlens_k``: no ``N × N`` mask). Not supported, with a
    clear error: dropout, ``batch_first=False``, separate ``kdim``/``vdim``, ``attn_mask``,
    ``need_weights=True`` (the weights are never formed), padding that is not a suffix, and
    ``is_causal`` together with ``key_padding_mask``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dropout:
            raise NotImplementedError(f"dropout={dropout}: flashlite's attention has no dropout")
        if not batch_first:
            raise ValueError("batch_first=False is not supported: pass (B, N, E) tensors")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be a multiple of num_heads {num_heads}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, True
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **kw)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._reset_parameters()

    def _reset_parameters(self) -> None:  # torch's initialisation
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Args: query ``(B, N, E)``, key and value ``(B, S, E)``; key_padding_mask ``(B, S)``
        bool, True where a key is padding. Returns ``(out (B, N, E), None)``."""
        if need_weights:
            raise NotImplementedError("need_weights=True: flashlite never forms the weights")
        if attn_mask is not None:
            raise NotImplementedError("attn_mask: use is_causal=True, or key_padding_mask")
        b, n, e = query.shape
        s = key.shape[1]
        w, bias = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            q, k, v = F.linear(query, w, bias).chunk(3, -1)
        else:
            ws, bs = w.chunk(3), (bias.chunk(3) if bias is not None else (None, None, None))
            q, k, v = (
                F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), ws, bs, strict=True)
            )
        lengths = None
        if key_padding_mask is not None:
            lengths = self._lengths(key_padding_mask, b, s, bool(is_causal))
        h, d = self.num_heads, self.head_dim
        out = flashlite.attention(
            q.reshape(b, n, h, d),
            k.reshape(b, s, h, d),
            v.reshape(b, s, h, d),
            causal=bool(is_causal),
            scale=1.0 / math.sqrt(d),
            layout="b n h d",
            seqlens_k=lengths,
        )
        return self.out_proj(out.reshape(b, n, e)), None

    @staticmethod
    def _lengths(mask: torch.Tensor, b: int, s: int, causal: bool) -> torch.Tensor:
        if mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor, got {mask.dtype}")
        if mask.shape != (b, s):
            raise ValueError(f"key_padding_mask must be (B, S) = {(b, s)}, got {tuple(mask.shape)}")
        if causal:
            raise NotImplementedError("is_causal together with key_padding_mask")
        lengths = (~mask).sum(1)
        suffix = torch.arange(s, device=mask.device)[None, :] >= lengths[:, None]
        if not torch.equal(suffix, mask):
            raise NotImplementedError(
                "key_padding_mask with padding that is not at the end of its row"
            )
        return lengths.to(torch.int32)
