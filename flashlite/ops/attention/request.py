"""One attention call, described once: :class:`Request`.

The public functions check their arguments and build a Request; everything below reads it. It is
the only place that says whether a call is *plain* (:attr:`Request.plain`: no option beyond
causal and the scale, the call whose plan is made once per kind of tensors) and the only source of
a plan's key (:attr:`Request.key`). A new option is a new field here: it is part of every key and
makes a call non-plain without any other line changing, and the ops' schemas gain it by name
(:func:`flashlite.ops._dispatch.Op` derives them from these fields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flashlite._caches import memo
from flashlite.masking import masks
from flashlite.masking.mod_args import ModArgs, spec_mod
from flashlite.masking.mods import MaskMod, ScoreMod


class Request(NamedTuple):
    """What one attention call asks for, beyond its q, k and v: immutable, normalised once.

    Attributes:
        scale: multiplies ``QKᵀ`` before the softmax.
        causal: bottom-right causal (a window ``(-1, 0)`` is stored as causal).
        window_left, window_right: how many keys before / after its diagonal a query sees;
            None: unlimited (with ``causal`` the right side is 0 and stored as None).
        softcap: scores become ``softcap·tanh(s/softcap)``; None: no cap.
        seqlens_k: int32 ``(B,)``: batch b has only its first ``seqlens_k[b]`` keys.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed sequences (varlen);
            q, k, v are then ``(1, H, total, D)`` views.
        num_splits: split-KV partitions (n >= 1: the decode kernel); None: no split.
        sinks: fp32 ``(Hq,)`` sink logits.
        q_descale, k_descale, v_descale: FP8 inputs' fp32 descale factors, each a ``(B, Hkv)``
            view (one factor per tensor is an expanded ``(1,)``), all three with one stride
            pair: the scores are ``scale·q_descale·k_descale·(q·kᵀ)`` and the output is
            multiplied by ``v_descale`` (:mod:`flashlite.ops.attention.fp8`).
        out_dtype: the output's dtype where it is not q's (FP8 inputs: bf16 unless asked).
        head_dim_v: V's (and O's) head dim where it is not Q's and K's (DeepSeek's 192/128).
        cache_seqlens, block_table: a KV cache's int32 lengths ``(B,)`` and page table
            ``(B, max_pages)`` (decoding).
        validate: how a KV cache's values are checked: ``"device"``, ``"sync"`` or ``"off"``.
        mask_mod, score_mod: a mask or score function as the ops carry it: its registered name
            and the kinds of its buffers (:func:`flashlite.masking.mod_args.spec_mod`), with
            ``mask_tensors``/``mask_nums`` (``score_…``) its tensor and number buffers.
        block_tables: a block mask's eight tables (:data:`flashlite.masking.block_mask._TABLES`
            order: the key tiles per query block, partial then full, and the query tiles per
            key block), with ``block_size`` its ``[BLOCK_M, BLOCK_N]`` (flex).
    """

    scale: float
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    seqlens_k: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    num_splits: int | None = None
    sinks: torch.Tensor | None = None
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    head_dim_v: int | None = None
    cache_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    validate: str | None = None
    mask_mod: str | None = None
    mask_tensors: list[torch.Tensor] | None = None
    mask_nums: list[float] | None = None
    score_mod: str | None = None
    score_tensors: list[torch.Tensor] | None = None
    score_nums: list[float] | None = None
    block_tables: list[torch.Tensor] | None = None
    block_size: list[int] | None = None

    @classmethod
    def make(
        cls,
        causal: bool,
        scale: float,
        window_left: int | None = None,
        window_right: int | None = None,
        softcap: float | None = None,
        seqlens_k: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        num_splits: int | None = None,
        sinks: torch.Tensor | None = None,
        **cache: object,
    ) -> Request:
        """A Request in its normal form: a negative window side (flash-attn's −1) or a zero cap
        or split count means none, a window ``(unlimited, 0)`` is causal, and causal needs no
        right side. Two calls that run the same kernels get equal Requests (one plan)."""
        if window_left is not None and window_left < 0:
            window_left = None
        if window_right is not None and window_right < 0:
            window_right = None
        causal, window_left, window_right = _normal(causal, window_left, window_right)
        request = cls(
            float(scale),
            bool(causal),
            window_left,
            window_right,
            softcap or None,
            seqlens_k,
            cu_seqlens_q,
            cu_seqlens_k,
            None if max_seqlen_q is None else int(max_seqlen_q),
            None if max_seqlen_k is None else int(max_seqlen_k),
            num_splits or None,
            sinks,
        )
        return request._replace(**cache) if cache else request

    @classmethod
    def of_mask(cls, mask: masks.Mask, scale: float, **fields: object) -> Request:
        """The Request of a :class:`~flashlite.masks.Mask` (what :func:`flashlite.masks.describe`
        made from the public arguments) and the other fields by name."""
        return cls.make(mask.causal, scale, mask.left, mask.right, mask.softcap, **fields)  # type: ignore[arg-type]

    @classmethod
    def of_call(
        cls,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None,
        softcap: float | None,
        seqlens_k: torch.Tensor | None,
        num_splits: int,
        sinks: torch.Tensor | None,
    ) -> Request:
        """The Request of :func:`flashlite.attention`'s public options (``seqlens_k`` and
        ``sinks`` already checked; the window and soft cap checked here)."""
        usual = window is None and softcap is None and seqlens_k is None and sinks is None
        if usual:  # nothing to check or normalise (tuple's own new: no Python-level defaults)
            if not num_splits:
                return _new(cls, (scale, causal) + _PLAIN_TAIL)
            return _new(cls, (scale, causal) + _BEFORE_SPLITS + (num_splits,) + _AFTER_SPLITS)
        mask = masks.describe(causal, window, softcap)  # (checked, unlimited sides None)
        causal, left, right = _normal(mask.causal, mask.left, mask.right)
        return cls(
            scale,
            causal,
            left,
            right,
            mask.softcap,
            seqlens_k,
            None,
            None,
            None,
            None,
            num_splits or None,
            sinks,
        )

    @property
    def plain(self) -> bool:
        """No option beyond causal and the scale: the call the kernels' plain (or causal) path
        runs and whose plan is made once per kind of tensors. The one plainness test."""
        return self[2:] == _PLAIN_TAIL

    @property
    def scalar_key(self) -> tuple | None:
        """The key of a request with no field beyond causal, the scale, the window and the soft
        cap (its five scalars), else None. Every argument of such a forward's launch is known
        from its plan key, so its launch is bound once per kind of call."""
        return self[:5] if self[5:] == _SCALAR_TAIL else None

    @property
    def key(self) -> tuple:
        """What a plan depends on in this request: its values, each tensor field as its kind
        (dtype, shape, strides, device), never its contents. Every field is in it."""
        scalars = self.scalar_key  # (no tensor field: its five scalars, a short hash)
        return scalars if scalars is not None else tuple(_kind(f) for f in self)

    @property
    def mask(self) -> masks.Mask:
        """The mask fields as the launchers' :class:`~flashlite.masks.Mask`."""
        return masks.Mask(
            self.causal, self.window_left, 0 if self.causal else self.window_right, self.softcap
        )

    @property
    def fp8(self) -> bool:
        """Whether the inputs are FP8 (their descale factors are set)."""
        return self.k_descale is not None

    @property
    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, or None."""
        if self.cu_seqlens_q is None or self.cu_seqlens_k is None:
            return None
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q or 0, self.max_seqlen_k or 0

    @property
    def mask_args(self) -> ModArgs | None:
        """The mask function as the plans take it (:data:`~flashlite.masking.mod_args.ModArgs`),
        or None."""
        if self.mask_mod is None:
            return None
        return self.mask_mod, list(self.mask_tensors or ()), list(self.mask_nums or ())

    @property
    def score_args(self) -> ModArgs | None:
        """The score function as the plans take it, or None."""
        if self.score_mod is None:
            return None
        return self.score_mod, list(self.score_tensors or ()), list(self.score_nums or ())

    def only(self, *names: str) -> bool:
        """Whether no field beyond causal, the scale and ``names`` is set (a backend's test of
        whether it takes the request)."""
        for a, b in _unset_runs(names):  # noqa: SIM110  (a loop: no generator per call)
            if self[a:b] != _NONES[a:b]:
                return False
        return True

    def given(self) -> list[str]:
        """The names of the fields set beyond causal and the scale (for refusals by name)."""
        return [name for name, f in zip(self._fields[2:], self[2:], strict=True) if f is not None]

    def refuse(self, backend: str, supported: tuple[str, ...] = ()) -> None:
        """Raise a ``NotImplementedError`` naming every field set here that ``backend`` does
        not take (its ``supported`` fields aside): nothing is silently dropped."""
        if self.only(*supported):
            return
        missing = [name for name in self.given() if name not in supported]
        if missing:
            raise NotImplementedError(
                f"{backend} does not support {', '.join(missing)} (the request sets them)"
            )


#: The tail of a plain request: every optional field unset.
_PLAIN_TAIL = (None,) * (len(Request._fields) - 2)
_NONES = (None,) * len(Request._fields)
_SCALAR_TAIL = (None,) * (len(Request._fields) - 5)
_new = tuple.__new__
#: A request of splits alone: the unset fields before and after ``num_splits``.
_BEFORE_SPLITS = (None,) * (Request._fields.index("num_splits") - 2)
_AFTER_SPLITS = (None,) * (len(Request._fields) - Request._fields.index("num_splits") - 1)


@memo("attention.request_runs")
def _unset_runs(names: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """The runs ``[a, b)`` of field positions (after causal and the scale) outside ``names``:
    what :meth:`Request.only` needs unset."""
    runs: list[tuple[int, int]] = []
    for i, name in enumerate(Request._fields[2:], start=2):
        if name in names:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def mod_fields(prefix: str, mod: MaskMod | ScoreMod | None) -> dict[str, Any]:
    """A mask (``prefix="mask"``) or score function (``"score"``) as the Request's three
    fields: its spec, tensors and numbers (:func:`~flashlite.masking.mod_args.spec_mod`); none
    for None."""
    if mod is None:
        return {}
    names = (f"{prefix}_mod", f"{prefix}_tensors", f"{prefix}_nums")
    return dict(zip(names, spec_mod(mod), strict=True))


def _normal(
    causal: bool, left: int | None, right: int | None
) -> tuple[bool, int | None, int | None]:
    """The window's normal form (unlimited sides already None): ``(unlimited, 0)`` is causal,
    and causal needs no right side."""
    if left is None and right == 0:
        causal = True
    return causal, left, None if causal else right


def _kind(f: object) -> object:
    """A field as a plan key holds it: a tensor's :func:`tensor_meta`
    (its kind and alignment, never its contents), a list's items so, else the value."""
    if isinstance(f, torch.Tensor):
        return tensor_meta(f)
    if isinstance(f, list):
        return tuple(_kind(x) for x in f)
    return f


def tensor_meta(t: torch.Tensor | None) -> tuple | None:
    """What a launch plan depends on in a tensor: shape, strides, dtype, device, alignment."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
