"""FP8 attention's arguments: e4m3 inputs, their descale factors and the output's dtype.

An FP8 tensor ``x8`` stands for ``x ≈ x8·descale``: the forward multiplies the scores by
``q_descale·k_descale`` (with the softmax scale, so the soft cap, the sinks and the LSE follow)
and the output by ``v_descale``. The factors follow flash-attn's convention: fp32, one per tensor
``(1,)`` or one per batch and KV head ``(B, Hkv)``; None means 1. The kernels read them on the
device (no host sync). A KV cache's factors may also be one per KV head ``(Hkv,)``, the scale
that new keys are quantised with as they are appended.
"""

from __future__ import annotations

import torch

from flashlite import _backend
from flashlite._caches import Cache

#: The FP8 format attention takes (e5m2 has too few mantissa bits for Q, K and V).
E4M3 = torch.float8_e4m3fn

#: The other FP8 formats, refused by name.
OTHER_FP8 = (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

#: The output dtypes an FP8 forward writes (bf16 unless asked).
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The largest finite e4m3 value: appended values are clamped to it before rounding.
E4M3_MAX = 448.0


def fp8_fields(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: object,
    k_descale: object,
    v_descale: object,
    out_dtype: object,
    batch: int | None = None,
) -> dict[str, object]:
    """The Request fields of an FP8 call on checked ``(B, H, N, D)`` views (``{}`` for another
    dtype with no FP8 argument): the three descales as ``(B, Hkv)`` fp32 views with one stride
    pair, and the output's dtype. ``batch``: the number of sequences where q is a packed
    ``(1, H, total, D)`` view (varlen), else q's batch.

    Raises:
        TypeError: FP8 arguments for 16/32-bit inputs, a descale that is not an fp32 tensor, an
            ``out_dtype`` that is not bf16, fp16 or fp32.
        ValueError: a descale of another shape than ``(1,)`` or ``(B, Hkv)``, or on another
            device than q.
        RuntimeError: q, k or v requiring a gradient (FP8 attention is forward only).
        NotImplementedError: a CUDA GPU without FP8 (compute capability below 8.9).
    """
    given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if q.dtype != E4M3 and q_descale is k_descale is v_descale is out_dtype is None:
        return {}  # (the usual call)
    if q.dtype != E4M3:
        named = [n for n, x in (*given.items(), ("out_dtype", out_dtype)) if x is not None]
        if named:
            raise TypeError(
                f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} for "
                f"torch.float8_e4m3fn inputs; q, k, v are {q.dtype}"
            )
        return {}
    refuse_grad(q, k, v)
    check_fp8_device(q)
    b, hkv = q.shape[0] if batch is None else batch, k.shape[1]
    scales = factor_views(given, b, hkv, q)
    return {
        **dict(zip(given, scales, strict=True)),
        "out_dtype": check_out_dtype(out_dtype),
    }


def descale(
    x: object, name: str, batch: int, hkv: int, q: torch.Tensor, per_head: bool = False
) -> torch.Tensor:
    """A given descale factor as a ``(batch, hkv)`` fp32 view: ``x`` checked (fp32, ``(1,)`` or
    ``(batch, hkv)``, or ``(hkv,)`` with ``per_head``, on q's device). (An absent one:
    :func:`factor_views`.)"""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    shapes = [(1,), (batch, hkv)] + ([(hkv,)] if per_head else [])
    if tuple(x.shape) not in shapes:
        accepted = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {accepted}, got {tuple(x.shape)}")
    if not _backend.same_device(x, q):
        raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} requires grad, but FP8 attention is forward only")
    return factor_view(x, batch, hkv)


def factor_view(x: torch.Tensor, batch: int, hkv: int) -> torch.Tensor:
    """A checked ``(1,)``, ``(hkv,)`` or ``(batch, hkv)`` factor as a ``(batch, hkv)`` view."""
    if x.dim() == 1:
        return x.expand(batch, hkv) if x.shape[0] == 1 else x.unsqueeze(0).expand(batch, hkv)
    return x


#: Factors of 1 by shape and device (never written: shared by every call that needs one).
_ones = Cache("attention.fp8_ones", 16)


def factor_views(
    given: dict[str, object], batch: int, hkv: int, q: torch.Tensor, per_head: bool = False
) -> list[torch.Tensor]:
    """The factors ``given`` (by name, None for absent) checked (:func:`descale`) as ``(batch,
    hkv)`` views with one stride pair: an absent one is a 1 shaped like a given one, so that
    its view has the same strides (no copies per call); ``(1,)`` ones where none is given."""
    views = {n: descale(x, n, batch, hkv, q, per_head) for n, x in given.items() if x is not None}
    base = next((x for x in given.values() if isinstance(x, torch.Tensor)), None)
    shape = tuple(base.shape) if base is not None else (1,)
    if len(views) < len(given):
        ones = _ones_of(shape, q.device)
        views |= {n: factor_view(ones, batch, hkv) for n in given if n not in views}
    return same_strides([views[n] for n in given])


def _ones_of(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 ones of ``shape`` on ``device``, made once (fresh while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return _new_ones(shape, device)
    return _ones.made((shape, device), _new_ones, shape, device)


def _new_ones(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.float32, device=device)


def same_strides(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """The three ``(B, Hkv)`` factors with one stride pair, as the kernels read them: as they
    are when theirs agree, else each made contiguous (a mix of per-tensor and per-head ones)."""
    if all(x.stride() == scales[0].stride() for x in scales):
        return scales
    return [x.contiguous() for x in scales]


def check_out_dtype(out_dtype: object) -> torch.dtype:
    """The output dtype of an FP8 forward: bf16 for None, else one of :data:`OUT_DTYPES`."""
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}"
        )
    return out_dtype  # type: ignore[return-value]


def refuse_grad(*tensors: torch.Tensor, names: str = "q, k, v") -> None:
    """FP8 attention has no backward (neither has FlashAttention-3's): a call that would need
    one is refused before anything runs."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            f"FP8 attention is forward only: {names} must not require grad (run it under "
            "torch.no_grad(), or attend in bf16 where a gradient is needed)"
        )


def check_fp8_device(q: torch.Tensor) -> None:
    """FP8 runs on CPU (the interpreter) and on CUDA GPUs with FP8 tensor cores (sm_89+)."""
    if q.is_cuda and _backend.capability(q.device.index or 0) < (8, 9):
        major, minor = _backend.capability(q.device.index or 0)
        raise NotImplementedError(
            f"FP8 attention needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{q.device} is {major}.{minor}"
        )


def check_dtype(t: torch.Tensor, name: str, fp8: bool) -> None:
    """Raise the ``TypeError`` for a tensor whose dtype attention does not take (``fp8``: a
    function that takes e4m3 inputs)."""
    if t.dtype in OTHER_FP8:
        raise TypeError(
            f"{name} has dtype {t.dtype}; of the FP8 formats attention takes torch.float8_e4m3fn "
            "only (with q_descale, k_descale, v_descale)"
        )
    if t.dtype == E4M3 and not fp8:
        raise TypeError(
            f"{name} has dtype torch.float8_e4m3fn, which this function does not take: FP8 "
            "inputs go to attention and attention_varlen (forward only), FP8 caches to "
            "attention_kvcache and attention_shared_prefix"
        )
    accepted = "torch.float16, torch.bfloat16, torch.float32"
    if fp8:
        accepted += ", torch.float8_e4m3fn"
    raise TypeError(f"{name} has dtype {t.dtype}; accepted: {accepted}")
