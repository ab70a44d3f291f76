"""Fused softmax cross-entropy front-end, one module per idea:

==============  ==================================================================================
``api``         the public functions :func:`cross_entropy` and :func:`linear_cross_entropy`
``checks``      argument checks, and the bad-target record (device flag, pinned host flag)
``plan``        the planned launches (kernel, options, grid, Triton's binding), cached per call
                signature
``fwd``         the launchers: forward, the backward's scaling, the gradient scale
``autograd``    the ops ``flashlite::cross_entropy_fwd``, ``_fwd_inplace``, ``_bwd_inplace``,
                stated once, and the autograd that hands over the gradient the forward wrote
``linear``      linear cross-entropy's sweep over token chunks, its ops and autograd
==============  ==================================================================================

The kernel (:mod:`flashlite.kernels.cross_entropy`) computes each row's loss and LSE and writes
its gradient in the same pass, so the softmax is never stored; the backward only rescales that
gradient when the incoming one is not what a unit loss sends. ``flashlite::cross_entropy_fwd``
writes the gradient into a buffer of its own (one logits-sized buffer of extra memory);
``flashlite::cross_entropy_fwd_inplace`` writes it over the logits (none). Both are
``torch.library`` custom ops with fakes that declare what they write; the autograd formula lives
in a ``torch.autograd.Function`` around them, and ``torch.compile(fullgraph=True)`` traces
:func:`cross_entropy`.
"""

from flashlite.ops.cross_entropy.api import cross_entropy, linear_cross_entropy
from flashlite.ops.cross_entropy.fwd import (
    cross_entropy_bwd,
    cross_entropy_fwd,
    cross_entropy_fwd_eager,
    cross_entropy_scale,
)
from flashlite.ops.cross_entropy.linear import LINEAR_CHUNK_BYTES, LINEAR_MIN_TOKENS
from flashlite.ops.cross_entropy.plan import BWD_BLOCK, BWD_PROGRAMS, BWD_TILES

__all__ = [
    "BWD_BLOCK",
    "BWD_PROGRAMS",
    "BWD_TILES",
    "LINEAR_CHUNK_BYTES",
    "LINEAR_MIN_TOKENS",
    "cross_entropy",
    "cross_entropy_bwd",
    "cross_entropy_fwd",
    "cross_entropy_fwd_eager",
    "cross_entropy_scale",
    "linear_cross_entropy",
]
