"""Which keys a query sees: the one place that answers it, for kernels, models, references, tests.

Masks, all aligned bottom-right (flash-attn >= 2.1, ``causal_lower_right``), with
``diag = Nk − Nq``:

- none: every query sees every key;
- causal: query ``i`` sees key ``j`` iff ``j <= i + diag``. With ``Nq > Nk`` the first ``Nq − Nk``
  queries see nothing (their output is 0 and their LSE −inf);
- sliding window ``(left, right)`` (flash-attn's ``window_size``, −1 unlimited): query ``i`` sees
  ``i + diag − left <= j <= i + diag + right``; ``(-1, 0)`` is causal, and ``causal=True`` sets
  ``right = 0``.

A call's mask is described once: :func:`describe` checks the public ``causal``, ``window`` and
``softcap`` and makes a :class:`Mask` (None for an unlimited side or no cap), which the ops'
schemas carry field by field and the launchers take whole; :meth:`Mask.kernel` turns it into the
kernels' arguments for the call's lengths, a :class:`KernelMask` (``IS_CAUSAL``, ``WINDOW``,
``left``, ``right``, ``SOFTCAP``, ``softcap``; no mask and causal keep code paths of their own).

Three questions, each a ``@triton.jit`` helper and its torch twin (same arithmetic, host ints or
tensors; the range twins read a :class:`Mask`, ``torch_visible`` the public arguments, as the
reference takes them):

===================  ======================  ===============================================
helper               twin                    answers
===================  ======================  ===============================================
``key_range``        ``torch_key_range``     the key tiles a block of ``BLOCK_M`` queries
                                             visits, ``(lo, full_lo, full_hi, hi)``:
                                             ``[full_lo, full_hi)`` seen whole by every row
                                             of the block (no mask arithmetic), ``[lo,
                                             full_lo)`` and ``[full_hi, hi)`` in part
                                             (masked); other keys are never loaded
``visible``          ``torch_visible``       per (query, key) pair: is it seen?
``query_range``      ``torch_query_range``   the query blocks that see a block of keys, the
                                             backward's dK/dV loop, ``(lo, full_lo, full_hi,
                                             hi)`` the same way round
===================  ======================  ===============================================

The next masks (per-batch key lengths, varlen offsets, split-KV ranges) extend these functions,
so everything that asks keeps agreeing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    "Mask",
    "KernelMask",
    "NO_MASK",
    "CAUSAL",
    "describe",
    "check_softcap",
]


# --------------------------------------------------------------------------- Triton helpers
@triton.jit
def _window_range(first, last, lo_off, hi_off, n, BLOCK: tl.constexpr):
    """The window's ``(lo, full_lo, full_hi, hi)`` on the other axis for the block of indices
    ``[first, last]`` of this one, where index x sees ``[x + lo_off, x + hi_off]`` of ``[0, n)``:
    tiles of ``BLOCK`` from ``lo`` hold something some index sees, ``[full_lo, full_hi)`` only
    what every index sees; ``key_range`` and ``query_range`` are its two readings."""
    hi = tl.minimum(tl.maximum(last + hi_off + 1, 0), n)
    lo = tl.minimum((tl.maximum(first + lo_off, 0) // BLOCK) * BLOCK, (hi // BLOCK) * BLOCK)
    # whole tiles between the last index's first neighbour and the first index's last one
    full_lo = tl.cdiv(tl.maximum(last + lo_off, 0), BLOCK) * BLOCK
    full_hi = (tl.minimum(tl.maximum(first + hi_off + 1, 0), n) // BLOCK) * BLOCK
    # no whole tile (a window narrower than the block): everything is masked, split anywhere
    full_lo = tl.maximum(tl.minimum(full_lo, full_hi), lo)
    return lo, full_lo, tl.maximum(full_hi, full_lo), hi


@triton.jit
def key_range(
    start_m,
    seq_q,
    seq_k,
    left,
    right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """``(lo, full_lo, full_hi, hi)`` for the query block ``[start_m, start_m + BLOCK_M)``: key
    tiles ``[full_lo, full_hi)`` are seen whole by every row of the block (no mask arithmetic),
    ``[lo, full_lo)`` and ``[full_hi, hi)`` in part (masked), the rest not at all (never
    loaded). ``lo``, ``full_lo`` and ``full_hi`` are multiples of ``BLOCK_N``;
    ``0 <= lo <= full_lo <= full_hi <= hi <= seq_k``. ``WINDOW``: query i sees keys
    ``[i + diag − left, i + diag + right]`` (``diag = seq_k − seq_q``; the host passes a bound
    past both lengths for an unlimited side); ``IS_CAUSAL`` is the window ``(∞, 0)``."""
    diag = seq_k - seq_q
    if WINDOW:  # row i sees keys [i + diag − left, i + diag + right]
        lo, full_lo, full_hi, hi = _window_range(
            start_m, start_m + BLOCK_M - 1, diag - left, diag + right, seq_k, BLOCK_N
        )
    elif IS_CAUSAL:
        lo = start_m * 0
        full_lo = lo
        # the block's first row sees keys [0, start_m + diag + 1): whole tiles below that are
        # seen by every row; its last row sees [0, start_m + BLOCK_M + diag)
        first_row_sees = tl.minimum(tl.maximum(start_m + diag + 1, 0), seq_k)
        full_hi = (first_row_sees // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), seq_k)
    else:
        lo = start_m * 0
        full_lo = lo
        full_hi = (seq_k // BLOCK_N) * BLOCK_N
        hi = seq_k
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(rows, cols, seq_q, seq_k, left, right, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[R, C]`` bools: query ``rows[r]`` sees key ``cols[c]`` (keys past ``seq_k`` never)."""
    seen = cols[None, :] < seq_k
    if WINDOW:
        rel = cols[None, :] - rows[:, None]  # key offset from the query's diagonal, plus diag
        seen = seen & (rel <= (seq_k - seq_q) + right) & (rel >= (seq_k - seq_q) - left)
    elif IS_CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None] + (seq_k - seq_q))
    return seen


@triton.jit
def visible_t(cols, rows, seq_q, seq_k, left, right, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """:func:`visible` transposed: ``[C, R]`` bools for keys ``cols`` (down) and queries ``rows``
    (across), for the backward's keys-major tiles."""
    seen = cols[:, None] < seq_k
    if WINDOW:
        rel = cols[:, None] - rows[None, :]
        seen = seen & (rel <= (seq_k - seq_q) + right) & (rel >= (seq_k - seq_q) - left)
    elif IS_CAUSAL:
        seen = seen & (cols[:, None] <= rows[None, :] + (seq_k - seq_q))
    return seen


@triton.jit
def query_range(
    start_n,
    seq_q,
    seq_k,
    left,
    right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """``(lo, full_lo, full_hi, hi)`` for the key block ``[start_n, start_n + BLOCK_N)``, the
    first three multiples of ``BLOCK_M`` (or ``seq_q``): query blocks ``[full_lo, full_hi)``
    see every key of the block below ``seq_k`` in every row (no mask), ``[lo, full_lo)`` and
    ``[full_hi, hi)`` some (masked), the others none;
    ``0 <= lo <= full_lo <= full_hi <= hi <= seq_q``. Query i sees key j iff
    ``j − diag − right <= i <= j − diag + left`` (see :func:`key_range`)."""
    diag = seq_k - seq_q
    last_key = tl.minimum(start_n + BLOCK_N, seq_k) - 1
    if WINDOW:  # key j is seen by rows [j − diag − right, j − diag + left]
        lo, full_lo, full_hi, hi = _window_range(
            start_n, last_key, -diag - right, left - diag, seq_q, BLOCK_M
        )
    else:
        if IS_CAUSAL:
            lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
            # the first row that sees the block's last key, rounded up to a block boundary
            full_lo = tl.cdiv(tl.maximum(last_key - diag, 0), BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
            full_lo = lo
        full_lo = tl.minimum(full_lo, seq_q)
        # the ragged last query block is masked too
        full_hi = tl.maximum((seq_q // BLOCK_M) * BLOCK_M, full_lo)
        hi = seq_q
    return lo, full_lo, full_hi, hi


# --------------------------------------------------------------------------- torch twins
def _torch_window_range(
    first: int, last: int, lo_off: int, hi_off: int, n: int, block: int
) -> tuple[int, int, int, int]:
    """Host twin of :func:`_window_range`."""
    hi = min(max(last + hi_off + 1, 0), n)
    lo = min((max(first + lo_off, 0) // block) * block, (hi // block) * block)
    full_lo = -(-max(last + lo_off, 0) // block) * block
    full_hi = (min(max(first + hi_off + 1, 0), n) // block) * block
    full_lo = max(min(full_lo, full_hi), lo)
    return lo, full_lo, max(full_hi, full_lo), hi


def torch_query_range(
    start_n: int, block_m: int, block_n: int, seq_q: int, seq_k: int, mask: Mask
) -> tuple[int, int, int, int]:
    """Host twin of :func:`query_range`: ``(lo, full_lo, full_hi, hi)`` for one key block."""
    km = mask.kernel(seq_q, seq_k)
    diag = seq_k - seq_q
    last_key = min(start_n + block_n, seq_k) - 1
    if km.WINDOW:
        return _torch_window_range(
            start_n, last_key, -diag - km.right, km.left - diag, seq_q, block_m
        )
    lo = full_lo = 0
    if km.IS_CAUSAL:
        lo = (max(start_n - diag, 0) // block_m) * block_m
        full_lo = -(-max(last_key - diag, 0) // block_m) * block_m
    full_lo = min(full_lo, seq_q)
    return lo, full_lo, max((seq_q // block_m) * block_m, full_lo), seq_q


def torch_key_range(
    start_m: int, block_m: int, block_n: int, seq_q: int, seq_k: int, mask: Mask
) -> tuple[int, int, int, int]:
    """Host twin of :func:`key_range`: ``(lo, full_lo, full_hi, hi)`` for one query block."""
    km = mask.kernel(seq_q, seq_k)
    diag = seq_k - seq_q
    if km.WINDOW:
        return _torch_window_range(
            start_m, start_m + block_m - 1, diag - km.left, diag + km.right, seq_k, block_n
        )
    if km.IS_CAUSAL:
        first_row_sees = min(max(start_m + diag + 1, 0), seq_k)
        hi = min(max(start_m + block_m + diag, 0), seq_k)
        return 0, 0, (first_row_sees // block_n) * block_n, hi
    return 0, 0, (seq_k // block_n) * block_n, seq_k


def window_bounds(window: tuple[int, int] | None, causal: bool) -> tuple[int, int]:
    """``(left, right)`` key offsets a query sees around its bottom-right diagonal, −1 meaning
    unlimited: ``window`` (flash-attn's ``window_size``), with ``causal`` setting right to 0.

    ``window`` may also be a 2-element integer tensor (flash-attn accepts one); its values are
    read on the host.

    Raises:
        TypeError: ``window`` is not a pair of ints.
        ValueError: a bound below −1.
    """
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    if isinstance(window, torch.Tensor):
        if window.numel() != 2 or window.is_floating_point() or window.dtype == torch.bool:
            raise TypeError(
                f"window must be a pair of ints (left, right); got a tensor of "
                f"shape {tuple(window.shape)} and dtype {window.dtype}"
            )
        window = tuple(int(w) for w in window.reshape(2).tolist())
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


class KernelMask(NamedTuple):
    """A :class:`Mask` as the kernels take it for one call's lengths (:meth:`Mask.kernel`): the
    constexprs choose the code path, the values are runtime arguments (a new window size or cap
    never recompiles).

    Attributes:
        IS_CAUSAL: the causal path (window ``(∞, 0)``).
        WINDOW: any other window: query i sees keys ``[i + diag − left, i + diag + right]``.
        left, right: the window's sides, an unlimited one a bound past both lengths; 0 without
            ``WINDOW``.
        SOFTCAP: scores become ``softcap·tanh(s/softcap)``.
        softcap: the cap, 0.0 without ``SOFTCAP``.
    """

    IS_CAUSAL: bool
    WINDOW: bool
    left: int
    right: int
    SOFTCAP: bool
    softcap: float

    def constexprs(self) -> dict[str, bool]:
        """The kernels' ``IS_CAUSAL``, ``WINDOW`` and ``SOFTCAP`` keyword arguments."""
        return {"IS_CAUSAL": self.IS_CAUSAL, "WINDOW": self.WINDOW, "SOFTCAP": self.SOFTCAP}


class Mask(NamedTuple):
    """Which scores a query keeps, as the public arguments say it, normalised once
    (:func:`describe`): the ops' schemas carry these fields as they are, the launchers take the
    whole, and :meth:`kernel` turns it into the kernels' arguments. (A tuple: plan keys hash
    and compare it at C speed.)

    Attributes:
        causal: bottom-right causal (then ``right`` is 0).
        left, right: how many keys before / after its diagonal a query sees; None: unlimited.
        softcap: scores become ``softcap·tanh(s/softcap)``; None: no cap.
    """

    causal: bool
    left: int | None = None
    right: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """No window beyond causal's and no cap: the kernels' unmasked or causal path
        (:attr:`is_causal` says which), the one plain calls plan once per kind of tensors."""
        unbounded = self.causal or self.right is None or self.right == 0
        return self.left is None and self.softcap is None and unbounded

    @property
    def is_causal(self) -> bool:
        """The kernels' causal path: left side unlimited, right side 0 (``causal``, or the
        window ``(-1, 0)``)."""
        return self.left is None and (self.causal or self.right == 0)

    def kernel(self, seq_q: int, seq_k: int) -> KernelMask:
        """The kernels' mask arguments for ``seq_q`` queries against ``seq_k`` keys: no mask and
        causal keep their own code paths; any other window sets ``WINDOW``, an unlimited side
        becoming ``seq_q + seq_k`` (past every real row's keys)."""
        cap = (self.softcap is not None, self.softcap or 0.0)
        if self.is_causal:
            return KernelMask(True, False, 0, 0, *cap)
        if self.left is None and self.right is None:  # (and not causal: is_causal said)
            return KernelMask(False, False, 0, 0, *cap)
        far = seq_q + seq_k
        right = 0 if self.causal else self.right
        return KernelMask(
            False,
            True,
            far if self.left is None else self.left,
            far if right is None else right,
            *cap,
        )


#: the masks of plain calls (no window, no cap), shared: :func:`describe` returns them
NO_MASK = Mask(False)
CAUSAL = Mask(True, right=0)


def describe(
    causal: bool, window: tuple[int, int] | None = None, softcap: float | None = None
) -> Mask:
    """The :class:`Mask` of a public call: ``window`` checked and aligned as
    :func:`window_bounds` says (``causal`` sets its right side to 0), ``softcap`` checked.

    Raises:
        TypeError: ``window`` is not a pair of ints, ``softcap`` not a number.
        ValueError: a window bound below −1, a softcap that is not finite and positive.
    """
    if window is None and softcap is None:
        return CAUSAL if causal else NO_MASK
    left, right = window_bounds(window, causal)
    return Mask(
        causal, None if left < 0 else left, None if right < 0 else right, check_softcap(softcap)
    )


def check_softcap(softcap: object) -> float | None:
    """A soft cap (attention scores, logits) checked: None, or a finite positive float.

    Raises:
        TypeError: not a number.
        ValueError: not finite and positive.
    """
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    if not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a finite positive number or None, got {softcap}")
    return float(softcap)


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
    ``i + Nk − Nq − left <= j <= i + Nk − Nq + right``; ``causal`` is ``(-1, 0)``.
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
