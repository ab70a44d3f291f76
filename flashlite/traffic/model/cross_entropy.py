"""Cross-entropy's bytes: the fused kernels' passes over the logits and the compulsory floor."""

from __future__ import annotations

import torch

from flashlite.ops.cross_entropy.plan import bwd_tiling, fwd_reads
from flashlite.traffic.shapes import (
    Traffic,
)


# ----------------------------------------------------------------------------- cross-entropy
def model_cross_entropy(
    rows: int,
    n: int,
    dtype: torch.dtype,
    *,
    weight_bytes: int = 0,
    target_bytes: int = 8,
    backward: bool = True,
    unit_grad: bool = True,
    scalar_grad: bool = True,
    prefetch: bool = False,
    smoothing: bool = False,
    scale: bool = True,
    reduce: bool = True,
) -> Traffic:
    """Bytes the fused cross-entropy kernels issue for ``(rows, n)`` logits (classes last),
    ``weight_bytes`` > 0 with class weights of that element size, and the backward's kernel
    with ``backward`` (:mod:`flashlite.kernels.cross_entropy`)::

        scale    read  = rows·(target [+ w]),  write = 4          the mean's 1/Σ, the check
        forward  read  = rows·(target + 4 + passes·n·b [+ 4 + w + passes·n·w])   passes: 1 or 2
                 write = rows·(n·b + 8)                                        gradient, loss, lse
        backward read  = p·4·g [+ rows·n·b],  write [rows·n·b]    g = ⌈n/(16·4096)⌉

    Rows that fit on chip (``ce_config``'s single read) are read once; longer rows twice (the
    statistics, then the gradient). The forward stores the gradient already scaled for a unit
    loss (``1/Σ`` for a mean), so with ``unit_grad`` (``loss.backward()``) the backward's
    programs read the incoming gradient (one scalar) and stop; otherwise they rescale the
    gradient (the bracketed terms). Its ``p`` programs along the rows loop over them:
    ``p = min(rows, 1024)`` each read a scalar incoming gradient (``scalar_grad``: a mean or a
    sum) once; a per-row one (``none``) is read once per row (``p = rows``). With ``scale``
    (every call but an unchecked ``sum`` or ``none``), one launch first reads the targets (and
    their class weights) for the mean's divisor and the device-side target check. The sum of
    the losses (a torch reduction) is not counted here.

    ``prefetch``: the GPU's Gluon team kernel for long rows
    (:mod:`flashlite.kernels.cross_entropy_gluon`, no class weights) as an eager call runs it,
    modelled only (the interpreter cannot run it): logits read once, but each of a row's ``C``
    programs reads the row's target, and the row's ``C·k`` words (``k = 2`` with
    ``smoothing``) are filled with −1, published once and read by each of its ``C`` programs
    (``8·rows·C·k`` written twice, ``8·rows·C²·k`` read; spin re-reads not modelled), plus two
    control words filled. ``scale`` happens inside it (the targets read once more for the
    mean's count and the check, no separate launch), and with ``reduce`` (a mean or a sum) its
    last program reads the losses back and writes their sum. Atomics on the control words are
    not modelled.
    """
    b = torch.empty((), dtype=dtype).element_size()
    if prefetch and weight_bytes:
        raise ValueError("the prefetch kernel takes no class weights")
    passes, chunks = fwd_reads(n, b, prefetch)
    t = Traffic()
    if scale and prefetch:
        t.add("count, check: targets", rows * target_bytes, 0)
    elif scale:
        t.add("scale: targets", rows * (target_bytes + weight_bytes), 4)
    t.add("target, gradient scale", rows * chunks * (target_bytes + (0 if prefetch else 4)), 0)
    t.add("logits", rows * passes * n * b, 0)
    if prefetch:
        words = chunks * (2 if smoothing else 1)
        t.add("words", 8 * rows * chunks * words, 2 * 8 * rows * words + 16)
        if reduce:
            t.add("loss sum", rows * 4, 4)
    if weight_bytes:
        t.add("weight", rows * (4 + weight_bytes + passes * n * weight_bytes), 0)
    t.add("gradient", 0, rows * n * b)
    t.add("loss, lse", 0, rows * 8)
    if backward:
        _, _, (programs, col_groups, _) = bwd_tiling(rows, n)  # the launcher's own tiling
        # one read per program of a scalar (mean, sum), one per row of per-row gradients
        reads = programs if scalar_grad else rows
        t.add("backward: incoming gradient", reads * 4 * col_groups, 0)
        if not unit_grad:
            t.add("backward: gradient", rows * n * b, rows * n * b)
    t.info = {"passes": passes}
    return t


def compulsory_cross_entropy(rows: int, n: int, dtype: torch.dtype) -> Traffic:
    """The logits read once, the gradient written once, the targets read and the loss written."""
    b = torch.empty((), dtype=dtype).element_size()
    t = Traffic()
    t.add("logits", rows * n * b, 0)
    t.add("gradient", 0, rows * n * b)
    t.add("target, loss", rows * 8, rows * 4)
    return t
