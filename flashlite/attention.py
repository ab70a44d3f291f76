"""Tiled attention front-end: validation, layouts, dispatch and the autograd wrapper.

The kernel lives in :mod:`flashlite.kernels.attention_fwd`; this module reads any layout through
strides (einops patterns, no copies), chooses tensor-descriptor or pointer loads, the tile config
(pinned, the interpreter's, the measured Hopper table, else autotuned: :func:`fixed_config`) and
launches it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import einops
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend
from flashlite.kernels import attention_fwd as K

LAYOUTS = ("b h n d", "b n h d")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class LaunchInfo:
    """What one kernel launch used (read by the traffic tools and the benchmark)."""

    config: K.Config
    block_d: int
    use_desc: bool


def _to_bhnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "b h n d" else einops.rearrange(t, f"{layout} -> b h n d")


def _check(
    q: object, k: object, v: object, layout: object, scale: object
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the public arguments; return the softmax scale and q, k, v as ``b h n d`` views."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions ({layout}), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; accepted: "
                "torch.float16, torch.bfloat16, torch.float32"
            )
        _backend.check_device(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    qc, kc, vc = (_to_bhnd(t, layout) for t in (q, k, v))  # type: ignore[arg-type]
    (b, hq, _, d), (bk, hkv, _, dk) = qc.shape, kc.shape
    if kc.shape != vc.shape:
        raise ValueError(
            f"k and v must have the same shape (B, Hkv, Nk, D) in layout {layout!r}, got "
            f"{tuple(kc.shape)} and {tuple(vc.shape)} (as b h n d)"
        )
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head dim, got {d} and {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value "
            f"heads ({hkv}) for GQA/MQA"
        )
    if d == 0:
        raise ValueError("head dim must be at least 1, got 0")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} is not supported: flashlite supports 1 to 256")
    if scale is None:
        return 1.0 / math.sqrt(d), qc, kc, vc
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return float(scale), qc, kc, vc


def _descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a CUDA tensor, unit stride along D, 16-byte aligned base and strides."""
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
            return False
    return True


_autotuned = None


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _tuned_kernel():
    """The GPU kernel with its filtered autotune list (built on first use)."""
    global _autotuned
    if _autotuned is None:

        def prune(configs: list, named_args: dict, **kwargs: object) -> list:
            out = named_args["O"]
            esize = (out.base if kwargs["USE_DESC"] else out).element_size()
            fits = (kwargs["BLOCK_D"], esize, kwargs["USE_DESC"])
            keep = [c for c in configs if K.keep_config(K.Config.of(c), *fits)]
            return keep or [K.as_triton_config(K.default_config(*fits), K.set_block_shapes)]

        _autotuned = triton.autotune(
            configs=[K.as_triton_config(c, K.set_block_shapes) for c in K.GPU_CONFIGS],
            key=["seq_q", "seq_k", "HEAD_DIM", "IS_CAUSAL", "USE_DESC", "DOT_FP32"],
            prune_configs_by={"early_config_prune": prune},
        )(K._attention_fwd_kernel)
    return _autotuned


def fixed_config(
    device: torch.device,
    block_d: int | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
) -> K.Config | None:
    """The config used without autotuning: the one pinned through ``$FLASHLITE_ATTENTION_CONFIG``,
    else ``CPU_CONFIG`` (interpreter and CPU tensors), else on Hopper for 16-bit inputs the measured
    ``HOPPER_CONFIGS`` entry for ``(block_d, causal)``; None means autotune."""
    pinned = K.pinned_config()
    if pinned is not None:
        return pinned
    if device.type == "cpu" or _backend.is_interpreted(device):
        # the interpreter's small tile; CPU tensors on a CUDA machine take it too (they go
        # through the launcher's GPU round trip, which the autotuner cannot do)
        return K.CPU_CONFIG
    hopper = device.type == "cuda" and _is_hopper(device.index or 0)
    if hopper and dtype in (torch.float16, torch.bfloat16):
        return K.HOPPER_CONFIGS.get((block_d, bool(causal)))
    return None


def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    config: K.Config | None = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo | None]:
    """Launch the forward kernel on ``(B, H, N, D)`` views.

    Returns ``O`` (strided like ``q``'s layout), the fp32 LSE ``(B, Hq, Nq)`` and what the
    launch used. ``config`` pins a :class:`~flashlite.kernels.attention_fwd.Config` (else
    :func:`fixed_config` or the autotuner chooses); ``use_desc`` forces descriptor (True) or
    pointer (False) loads.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dev = q.device
    # O keeps q's dimension order (e.g. "b n h d", also for slices of a packed qkv buffer):
    # dense in the order of q's strides, viewed as b h n d
    order = sorted(range(4), key=lambda i: -q.stride(i))
    o = torch.empty([q.shape[i] for i in order], device=dev, dtype=q.dtype)
    o = o.permute([order.index(i) for i in range(4)])
    lse = torch.empty((b, hq, nq), device=dev, dtype=torch.float32)
    if b * hq * nq == 0:
        return o, lse, None
    if nk == 0:  # no key at all: every row sees nothing
        return o.zero_(), lse.fill_(-math.inf), None

    block_d = max(16, triton.next_power_of_2(d))
    if use_desc is None:
        use_desc = _descriptor_ok(q, k, v, o)
    if prescale_q is None:
        prescale_q = q.dtype != torch.float32
    if config is None:
        config = fixed_config(dev, block_d, causal, q.dtype)
    if config is not None:  # a plain tuple works too
        config = K.Config(*config)
    if use_desc:  # block shapes are set per config (set_block_shapes), placeholders here
        bm, bn = (config.block_m, config.block_n) if config is not None else (16, 16)
        srcs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
                for t, r in ((q, bm), (k, bn), (v, bn), (o, bm))]  # fmt: skip
    else:
        srcs = [q, k, v, o]
    args = (*srcs, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            hq, hq // hkv, nq, nk, scale)  # fmt: skip
    consts = {
        "HEAD_DIM": d,
        "BLOCK_D": block_d,
        "IS_CAUSAL": bool(causal),
        "USE_DESC": use_desc,
        "PRESCALE_Q": prescale_q,
        "DOT_FP32": _backend.dot_upcast(q.dtype, dev),
        # fp32 inputs: three TF32 passes give about fp32 accuracy on tensor cores
        "DOT_PRECISION": "tf32x3" if q.dtype == torch.float32 else "tf32",
    }
    if config is not None:
        grid = (triton.cdiv(nq, config.block_m), b * hq)
        kernel = _backend.launcher(K._attention_fwd_kernel, dev)
        kernel[grid](*args, **config.constexprs(), num_warps=config.num_warps,
                     num_stages=config.num_stages, **consts)  # fmt: skip
    else:
        tuned = _tuned_kernel()
        tuned[lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), b * hq)](*args, **consts)
        config = K.Config.of(tuned.best_config)
    return o, lse, LaunchInfo(config, block_d, use_desc)


class AttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward only for now (the backward kernel is a later issue)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):  # type: ignore[override]
        o, lse, _ = _attention_fwd(q, k, v, causal, scale)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise NotImplementedError(
            "flashlite.attention has no backward pass yet; use "
            "torch.nn.functional.scaled_dot_product_attention for training"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "b h n d",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention computed tile by tile (FlashAttention-2 loop order).

    Args:
        q: ``(B, Hq, Nq, D)`` (or ``(B, Nq, Hq, D)`` with ``layout="b n h d"``).
        k, v: ``(B, Hkv, Nk, D)`` in the same layout; ``Hq % Hkv == 0`` gives GQA/MQA without
            repeating k and v in memory. Any strides: slices of a packed qkv buffer work.
        causal: bottom-right aligned mask (flash-attn >= 2.1, ``causal_lower_right``): query i
            sees key j iff ``j <= i + Nk - Nq``. Rows that see no key give 0 and LSE −inf.
        scale: multiplies ``QKᵀ`` before the softmax; defaults to ``1/sqrt(D)``; must be > 0.
        layout: ``"b h n d"`` or ``"b n h d"`` (einops notation).
        return_lse: also return the natural-log LSE of the scaled scores.

    Returns:
        ``out`` in ``q``'s layout and dtype, or ``(out, lse)`` with ``lse`` fp32 ``(B, Hq, Nq)``.
        fp16/bf16 run on tensor cores with fp32 accumulation; fp32 uses three TF32 passes
        (``tf32x3``) on a GPU, about fp32 accuracy. D runs from 1 to 256.

    Raises:
        TypeError: non-tensors, unsupported or mixed dtypes, a non-numeric scale.
        ValueError: wrong rank, mismatched batch/heads/lengths/head dims, unknown layout,
            mixed devices, a non-positive scale.
        NotImplementedError: head dim above 256.
    """
    sm_scale, qc, kc, vc = _check(q, k, v, layout, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = AttentionFunction.apply(qc, kc, vc, bool(causal), sm_scale)
    else:  # no graph to record: skip autograd's per-call cost (small problems feel it)
        o, lse, _ = _attention_fwd(qc, kc, vc, bool(causal), sm_scale)
    if layout != "b h n d":
        o = einops.rearrange(o, f"b h n d -> {layout}")
    return (o, lse) if return_lse else o
