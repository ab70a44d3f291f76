"""Which keys a query sees: the one place that answers it, for kernels, models, references, tests.

Today's masks: none, and causal aligned bottom-right (flash-attn >= 2.1, ``causal_lower_right``):
query ``i`` of ``Nq`` sees key ``j`` of ``Nk`` iff ``j <= i + Nk − Nq``. With ``Nq > Nk`` the first
``Nq − Nk`` queries see nothing (their output is 0 and their LSE −inf).

Two questions, each a ``@triton.jit`` helper and its torch twin (same arithmetic, host ints or
tensors):

===================  ======================  ===============================================
helper               twin                    answers
===================  ======================  ===============================================
``key_range``        ``torch_key_range``     the key tiles a block of ``BLOCK_M`` queries
                                             visits: ``[0, full_hi)`` seen by every row of the
                                             block (no mask arithmetic), ``[full_hi, hi)`` the
                                             diagonal and boundary tiles (masked); keys from
                                             ``hi`` on are never loaded
``visible``          ``torch_visible``       per (query, key) pair: is it seen?
``query_range``      ``torch_query_range``   the query blocks that see a block of keys, the
                                             backward's dK/dV loop: from ``lo`` some rows
                                             see some keys (masked), from ``full_lo`` every
                                             row sees every key of the block (no mask)
===================  ======================  ===============================================

The next masks (sliding window, per-batch key lengths, varlen offsets, split-KV ranges) extend
these functions, so everything that asks keeps agreeing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "key_range",
    "query_range",
    "visible",
    "visible_t",
    "torch_key_range",
    "torch_query_range",
    "torch_visible",
    "window_bounds",
]


# --------------------------------------------------------------------------- Triton helpers
@triton.jit
def key_range(start_m, seq_q, seq_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr):  # fmt: skip
    """``(full_hi, hi)`` for the query block ``[start_m, start_m + BLOCK_M)``; ``full_hi`` is a
    multiple of ``BLOCK_N``, ``0 <= full_hi <= hi <= seq_k``."""
    if IS_CAUSAL:
        diag = seq_k - seq_q
        # the block's first row sees keys [0, start_m + diag + 1): whole tiles below that are
        # seen by every row; its last row sees [0, start_m + BLOCK_M + diag)
        first_row_sees = tl.minimum(tl.maximum(start_m + diag + 1, 0), seq_k)
        full_hi = (first_row_sees // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), seq_k)
    else:
        full_hi = (seq_k // BLOCK_N) * BLOCK_N
        hi = seq_k
    return full_hi, hi


@triton.jit
def visible(rows, cols, seq_q, seq_k, IS_CAUSAL: tl.constexpr):
    """``[R, C]`` bools: query ``rows[r]`` sees key ``cols[c]`` (keys past ``seq_k`` never)."""
    seen = cols[None, :] < seq_k
    if IS_CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None] + (seq_k - seq_q))
    return seen


@triton.jit
def visible_t(cols, rows, seq_q, seq_k, IS_CAUSAL: tl.constexpr):
    """:func:`visible` transposed: ``[C, R]`` bools for keys ``cols`` (down) and queries ``rows``
    (across), for the backward's keys-major tiles."""
    seen = cols[:, None] < seq_k
    if IS_CAUSAL:
        seen = seen & (cols[:, None] <= rows[None, :] + (seq_k - seq_q))
    return seen


@triton.jit
def query_range(start_n, seq_q, seq_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IS_CAUSAL: tl.constexpr):  # fmt: skip
    """``(lo, full_lo)`` for the key block ``[start_n, start_n + BLOCK_N)``, both multiples of
    ``BLOCK_M``: query blocks before ``lo`` see none of its keys; from ``full_lo`` on, every row
    sees every key of the block below ``seq_k``. Query i sees key j iff ``j <= i + Nk − Nq``
    when causal."""
    if IS_CAUSAL:
        diag = seq_k - seq_q
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        # the first row that sees the block's last key, rounded up to a block boundary
        last_key = tl.minimum(start_n + BLOCK_N, seq_k) - 1
        full_lo = tl.cdiv(tl.maximum(last_key - diag, 0), BLOCK_M) * BLOCK_M
    else:
        lo = start_n * 0
        full_lo = lo
    return lo, full_lo


# --------------------------------------------------------------------------- torch twins
def torch_query_range(
    start_n: int, block_m: int, block_n: int, seq_q: int, seq_k: int, causal: bool
) -> tuple[int, int]:
    """Host twin of :func:`query_range`: ``(lo, full_lo)`` for one key block."""
    if not causal:
        return 0, 0
    diag = seq_k - seq_q
    lo = (max(start_n - diag, 0) // block_m) * block_m
    last_key = min(start_n + block_n, seq_k) - 1
    return lo, -(-max(last_key - diag, 0) // block_m) * block_m


def torch_key_range(
    start_m: int, block_m: int, block_n: int, seq_q: int, seq_k: int, causal: bool
) -> tuple[int, int]:
    """Host twin of :func:`key_range`: ``(full_hi, hi)`` for one query block."""
    if causal:
        diag = seq_k - seq_q
        first_row_sees = min(max(start_m + diag + 1, 0), seq_k)
        return (first_row_sees // block_n) * block_n, min(max(start_m + block_m + diag, 0), seq_k)
    return (seq_k // block_n) * block_n, seq_k


def window_bounds(window: tuple[int, int] | None, causal: bool) -> tuple[int, int]:
    """``(left, right)`` key offsets a query sees around its bottom-right diagonal, −1 meaning
    unlimited: ``window`` (flash-attn's ``window_size``), with ``causal`` setting right to 0.

    Raises:
        TypeError: ``window`` is not a pair of ints.
        ValueError: a bound below −1.
    """
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        raise TypeError(f"window must be a pair of ints (left, right); got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)}: each bound is >= 0, or -1 for unlimited")
    return left, 0 if causal else right


def torch_visible(
    seq_q: int,
    seq_k: int,
    causal: bool,
    *,
    window: tuple[int, int] | None = None,
    rows: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Twin of :func:`visible`: ``(len(rows), Nk)`` bools, query ``rows[r]`` sees key ``j``.

    ``rows`` defaults to every query, ``arange(Nq)``, giving the ``(Nq, Nk)`` mask. With
    ``window=(left, right)`` (see :func:`window_bounds`) query i sees key j iff
    ``i + Nk − Nq − left <= j <= i + Nk − Nq + right``; ``causal`` is ``(-1, 0)``. (The kernels'
    helpers do not take windows yet.)
    """
    if rows is None:
        rows = torch.arange(seq_q, device=device)
    cols = torch.arange(seq_k, device=rows.device)
    left, right = window_bounds(window, causal)
    if left < 0 and right < 0:
        return torch.ones(rows.shape[0], seq_k, dtype=torch.bool, device=rows.device)
    # each bound folds its offset into the scalar: causal stays one add and one comparison (what
    # the naive traffic model counts)
    diag = seq_k - seq_q
    seen = None
    if right >= 0:
        seen = cols[None, :] <= rows[:, None] + (diag + right)
    if left >= 0:
        after = cols[None, :] >= rows[:, None] + (diag - left)
        seen = after if seen is None else seen & after
    return seen
