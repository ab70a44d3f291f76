"""How a mod is called: by the kernels, through :func:`apply_mask` and :func:`apply_score` (a
score function's derivative too: it takes the same arguments) with up to :data:`MAX_BUFFERS`
buffers in fixed slots (:func:`kernel_buffers`), and by the fp64 reference and the tests, through
its torch twin on broadcast index tensors (:func:`torch_indices`, :func:`torch_mask`,
:func:`torch_score`). The mods themselves are :mod:`flashlite.masking.mods`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from flashlite.masking.mods import Buffer, MaskMod, ScoreMod

__all__ = [
    "MAX_BUFFERS",
    "apply_mask",
    "apply_score",
    "kernel_buffers",
    "torch_indices",
    "torch_mask",
    "torch_score",
]

#: How many buffers a mod may read (the kernels pass this many slots).
MAX_BUFFERS = 4


# --------------------------------------------------------------------------- kernel side
# Triton calls a function with a fixed number of arguments: one arm per buffer count (the
# count is a constexpr, so only one arm is compiled).
@triton.jit
def apply_mask(MOD: tl.constexpr, b, h, q_idx, kv_idx, B0, B1, B2, B3, N_BUF: tl.constexpr):
    """``MOD(b, h, q_idx, kv_idx, *buffers[:N_BUF])``."""
    if N_BUF == 0:
        r = MOD(b, h, q_idx, kv_idx)
    elif N_BUF == 1:
        r = MOD(b, h, q_idx, kv_idx, B0)
    elif N_BUF == 2:
        r = MOD(b, h, q_idx, kv_idx, B0, B1)
    elif N_BUF == 3:
        r = MOD(b, h, q_idx, kv_idx, B0, B1, B2)
    else:
        r = MOD(b, h, q_idx, kv_idx, B0, B1, B2, B3)
    return r


@triton.jit
def apply_score(MOD: tl.constexpr, score, b, h, q_idx, kv_idx, B0, B1, B2, B3, N_BUF: tl.constexpr):
    """``MOD(score, b, h, q_idx, kv_idx, *buffers[:N_BUF])`` (also a score function's
    derivative: same arguments)."""
    if N_BUF == 0:
        r = MOD(score, b, h, q_idx, kv_idx)
    elif N_BUF == 1:
        r = MOD(score, b, h, q_idx, kv_idx, B0)
    elif N_BUF == 2:
        r = MOD(score, b, h, q_idx, kv_idx, B0, B1)
    elif N_BUF == 3:
        r = MOD(score, b, h, q_idx, kv_idx, B0, B1, B2)
    else:
        r = MOD(score, b, h, q_idx, kv_idx, B0, B1, B2, B3)
    return r


def kernel_buffers(buffers: Sequence[Buffer]) -> tuple[list[Buffer], int]:
    """A mod's buffers as the kernels' four slots (unused ones 0) and how many are used."""
    return [*buffers] + [0] * (MAX_BUFFERS - len(buffers)), len(buffers)


# --------------------------------------------------------------------------- torch twins
def torch_indices(
    b: int, h: int, nq: int, nk: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, ...]:
    """The index tensors a twin is called with: ``b`` ``(B, 1, 1, 1)``, ``h`` ``(1, H, 1, 1)``,
    ``q_idx`` ``(1, 1, Nq, 1)``, ``kv_idx`` ``(1, 1, 1, Nk)``, broadcasting to the
    ``(B, H, Nq, Nk)`` scores."""
    ar = [torch.arange(n, device=device) for n in (b, h, nq, nk)]
    return (
        ar[0].view(-1, 1, 1, 1),
        ar[1].view(1, -1, 1, 1),
        ar[2].view(1, 1, -1, 1),
        ar[3].view(1, 1, 1, -1),
    )


def torch_mask(
    mod: MaskMod, b: int, h: int, nq: int, nk: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Twin of :func:`apply_mask` over every pair: ``(B, H, Nq, Nk)`` bools (``B`` or ``H``
    may be 1 to broadcast)."""
    out = mod(*torch_indices(b, h, nq, nk, device))
    return torch.as_tensor(out, device=device).to(torch.bool).expand(b, h, nq, nk)


def torch_score(mod: ScoreMod, scores: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`apply_score` on ``(B, H, Nq, Nk)`` scores."""
    b, h, nq, nk = scores.shape
    out = mod(scores, *torch_indices(b, h, nq, nk, scores.device))
    return torch.as_tensor(out, dtype=scores.dtype, device=scores.device).expand_as(scores)
