"""Your own masks and score functions: :func:`flex_attention`, named and shaped as
``torch.nn.attention.flex_attention``'s, on :mod:`flashlite.kernels.attention.flex` (and the
Hopper kernels on an sm_90 device), over the tables of
:func:`~flashlite.ops.attention.block_mask.create_block_mask`.

What a call runs is planned once per kind of call (:mod:`~flashlite.ops.attention.backends.tables`).
The ops ``flashlite::flex_attention_fwd``/``_bwd`` carry a mod as its registered name
(:func:`flashlite.mods.registered`), its tensor buffers and its numbers, so that
``torch.compile(fullgraph=True)`` traces a call like any other custom op, and the block tables
as tensors: a new sequence length is new table shapes, never a new kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from flashlite import _backend, _launch
from flashlite.kernels.attention import flex as KF
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.masking import classify as KB
from flashlite.masking import mods as M
from flashlite.masking.create import block_mask_for
from flashlite.masking.mod_args import check_mod
from flashlite.ops._dispatch import Op
from flashlite.ops.attention.backends.common import empty_output
from flashlite.ops.attention.backends.tables.args import FLEX_FIELDS, table_request
from flashlite.ops.attention.backends.tables.bwd import flex_bwd_body
from flashlite.ops.attention.backends.tables.fwd import flex_fwd_body
from flashlite.ops.attention.checks import check_views
from flashlite.ops.attention.request import Request

__all__ = ["flex_attention", "compiled_variants"]


def _fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request
) -> tuple[torch.Tensor, torch.Tensor]:
    o = empty_output(q, None, request.head_dim_v)
    return o, q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_fake(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    request: Request,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


FLEX_BWD = Op(
    "flex_attention_bwd",
    flex_bwd_body,
    fake=_bwd_fake,
    inputs=7,
    request=Request,
    takes=FLEX_FIELDS,
    moves=False,
)


def _setup_context(ctx, inputs, request: Request, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *request.block_tables)  # type: ignore[misc]
    ctx.request = request._replace(block_tables=None)


def _backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def]
    q, k, v, o, lse, *tables = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    # (the kernels read dO through its strides: no copy)
    request = ctx.request._replace(block_tables=tables)
    dq, dk, dv = FLEX_BWD(grad_o, q, k, v, o, lse, grad_lse, request)
    return (dq, dk, dv), {}


FLEX_FWD = Op(
    "flex_attention_fwd",
    flex_fwd_body,
    fake=_fwd_fake,
    inputs=3,
    request=Request,
    takes=FLEX_FIELDS,
    setup_context=_setup_context,
    backward=_backward,
    materialize_grads=False,
    moves=False,
)


def compiled_variants() -> int:
    """How many compiled variants of the flex and classifier kernels this process holds (what
    a loop over sequence lengths should not grow; 0 in the interpreter, which compiles
    nothing). With Gluon, the Hopper kernels' variants count too (the plain attention's
    among them)."""
    kernels = [
        KF._flex_fwd_kernel,
        KF._flex_bwd_dkdv_kernel,
        KF._flex_bwd_dq_kernel,
        KB._classify_tiles_kernel,
    ]
    if KH.available():
        kernels.append(KH._attention_fwd_hopper_kernel)
    if KHB.available():
        kernels.append(KHB._attention_bwd_hopper_kernel)
    return _launch.compiled_variants(kernels)


# --------------------------------------------------------------------------- public
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    layout: str = "b h n d",
) -> Any:
    """Attention with your own mask and score function (``torch.nn.attention.flex_attention``'s
    signature), differentiable in query, key and value.

    Args:
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hkv, Nk, D)`` (``layout="b n h d"``: heads
            second to last). fp16, bf16 or fp32; GQA when ``Hkv`` divides ``Hq``.
        score_mod: a :class:`~flashlite.mods.ScoreMod` (or a bare jit score function, forward
            only): rewrites each scaled score ``q·k·scale`` before the softmax.
        block_mask: a :class:`~flashlite.block_mask.BlockMask` from :func:`create_block_mask`,
            or torch's ``BlockMask`` built from a flashlite ``MaskMod``; None: no mask.
        scale: the softmax scale (default ``1/sqrt(D)``).
        enable_gqa: accepted for torch's signature; GQA works either way.
        return_lse: also return the natural-log LSE ``(B, Hq, Nq)`` fp32 (differentiable).
        layout: ``"b h n d"`` (torch's) or ``"b n h d"``.

    Returns:
        The output like ``query`` (and the LSE). A row that sees no key gives 0 (LSE −inf).

    Raises:
        TypeError, ValueError: bad tensors, mods or block masks, each naming the argument.
    """
    scale, q, k, v = check_views(query, key, value, layout, scale, head_dim_v=True)
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    request = _request(block_mask, score_mod, q, k, q.shape[0], "flex_attention", scale)
    if v.shape[3] != q.shape[3]:  # V's own head dim (DeepSeek's 192/128)
        request = request._replace(head_dim_v=v.shape[3])
    o, lse = FLEX_FWD(q, k, v, request)
    if layout == "b n h d":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def _request(
    block_mask: Any,
    score_mod: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    batch: int,
    what: str,
    scale: float,
    lengths: tuple[int, int] | None = None,
    **fields: Any,
) -> Request:
    """The flex ops' :class:`Request`: the call's block tables (:func:`block_mask_for`), their
    block size and both mods as the ops carry them, checked against its ``batch``
    (sequences), heads, lengths (default q's and k's) and device, and the mods' ``limits``
    (``what``: the public call, for the message); ``fields``: packed sequences."""
    if not (q.is_cuda or _backend.INTERPRETED):  # (no moving copies here: say so instead)
        raise ValueError(
            f"{what} runs its kernels where the tensors are: CUDA tensors, or CPU tensors with "
            "Triton's interpreter (TRITON_INTERPRET=1); move query, key and value (and the "
            "block mask, and the mods' buffers) to the GPU"
        )
    bm = block_mask_for(block_mask, q, k, lengths)
    smod = None if score_mod is None else M.as_score_mod(score_mod)
    hq = q.shape[1]
    positions = max(lengths) if lengths is not None else max(q.shape[2], k.shape[2])
    if smod is not None:
        check_mod(smod, "score_mod", q.device, batch, hq, positions)
    check_mod(bm.mask_mod, "block_mask's mask_mod", q.device, batch, hq, positions)
    tb, th = bm.kv_num_blocks.shape[:2]
    if tb not in (1, batch) or th not in (1, hq):
        raise ValueError(
            f"block_mask was built for B={tb}, H={th}; the call has B={batch}, "
            f"H={hq} (build it with these, or None to broadcast)"
        )
    # one table for every batch (head) holds batch (head) 0's tiles: wrong for a mask whose
    # buffers differ per batch (head), whose other tiles would be skipped or left unmasked
    limits = bm.mask_mod.limits
    for shared, call, limit, arg, nouns in (
        (tb == 1, batch, limits[0], "B", "batches"),
        (th == 1, hq, limits[1], "H", "heads"),
    ):
        if shared and call > 1 and limit is not None and limit > 1:
            raise ValueError(
                f"block_mask was built with {arg}=None (the first one's tiles for "
                f"all), but its mask_mod {bm.mask_mod.name} holds entries for "
                f"{limit} {nouns} and may differ between them: build it with "
                f"{arg}={call}"
            )
    return table_request(bm, scale, smod, **fields)


def flex_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    score_mod: Any,
    block_mask: Any,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flashlite.attention_varlen` with a score function or block mask: the flex
    kernels over packed ``(1, H, total, D)`` views, sequence b as batch b of the tables and
    the mods (positions from its start). Returns ``(o, lse)`` as the views."""
    request = _request(
        block_mask,
        score_mod,
        q,
        k,
        cu_q.shape[0] - 1,
        "attention_varlen with score_mod or block_mask",
        scale,
        (max_q, max_k),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )
    if v.shape[3] != q.shape[3]:  # V's own head dim
        request = request._replace(head_dim_v=v.shape[3])
    return FLEX_FWD(q, k, v, request)
