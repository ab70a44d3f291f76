"""The Triton kernels' tiles: pinned, the measured table of this GPU family, or the autotuner per
length bucket (forward), and the backward pair's; the forward's constexprs and bound launcher
(:func:`triton_plan`), kept per kind of call."""

from __future__ import annotations

import torch
import triton

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.kernels.attention import fwd as K
from flashlite.ops.attention.backends.common import (
    dot_flags,
)

#: The inputs whose scale the forward folds into Q (16-bit: one rounding, one multiply less).
_PRESCALED = (torch.float16, torch.bfloat16)

#: The tile small problems run on a GPU (few programs: a 64-row tile keeps more SMs busy).
SMALL_CONFIG = C.Config(64, 64, 4, 2)


_tuned = Cache("attention.tuned", 64)


def tuned_kernel(seq_q: int, seq_k: int) -> object:
    """The kernel with its filtered autotune list, one per power-of-two length bucket: a
    config tuned at one length serves every length of its bucket, so a decoding or varlen loop
    over many lengths tunes a handful of times, not once per length."""
    bucket = (C.next_pow2(seq_q), C.next_pow2(seq_k))
    if bucket not in _tuned:

        def prune(configs: list, named_args: dict, **kwargs: object) -> list:
            out = named_args["O"]
            esize = getattr(out, "base", out).element_size()  # a descriptor or a tensor
            fits = (kwargs["BLOCK_D"], esize, kwargs["USE_DESC"])
            keep = [c for c in configs if C.keep_config(C.Config.of(c), *fits)]
            return keep or [C.as_triton_config(C.default_config(*fits), C.set_block_shapes)]

        _tuned[bucket] = triton.autotune(
            configs=[C.as_triton_config(c, C.set_block_shapes) for c in C.GPU_CONFIGS],
            key=["HEAD_DIM", "IS_CAUSAL", "USE_DESC", "DOT_FP32", "DOT_PRECISION"],
            prune_configs_by={"early_config_prune": prune},
        )(K._attention_fwd_kernel)
    return _tuned[bucket]


def fixed_config(
    device: torch.device,
    block_d: int | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
    small: bool = False,
    softcap: bool = False,
) -> C.Config | None:
    """The config used without autotuning: the one pinned through ``$FLASHLITE_ATTENTION_CONFIG``,
    else ``CPU_CONFIG`` in the interpreter, else ``SMALL_CONFIG`` for ``small`` problems that fit
    it, else on Hopper for 16-bit inputs the measured ``HOPPER_CONFIGS`` entry for
    ``(block_d, causal)`` (``HOPPER_SOFTCAP_CONFIGS`` with a soft cap); None means autotune."""
    pinned = C.pinned_config()
    if pinned is not None:
        return pinned
    if _backend.kernels_interpreted():
        return C.CPU_CONFIG
    hopper = device.type == "cuda" and _backend.capability(device.index or 0) == (9, 0)
    return _table_entry(block_d, causal, dtype, small, hopper, softcap)


def _table_entry(
    block_d: int | None,
    causal: bool,
    dtype: torch.dtype | None,
    small: bool,
    hopper: bool,
    softcap: bool = False,
) -> C.Config | None:
    """A GPU's fixed choice: the small-problem config, else Hopper's measured table."""
    if block_d is None or dtype is None:
        return None
    if small and C.keep_config(SMALL_CONFIG, block_d, dtype.itemsize, False):
        return SMALL_CONFIG
    if hopper and dtype in (torch.float16, torch.bfloat16):
        table = C.HOPPER_CONFIGS
        if softcap and (block_d, bool(causal)) in C.HOPPER_SOFTCAP_CONFIGS:
            table = C.HOPPER_SOFTCAP_CONFIGS
        return table.get((block_d, bool(causal)))
    return None


#: The GPU tables :func:`gpu_config` knows: the H200's (Hopper's measured table) and any other
#: GPU's (no measured entry: the autotuner's first candidate that fits stands in for its pick).
GPU_TABLES = ("h200", "generic")


def table_config(
    head_dim: int, causal: bool, dtype: torch.dtype, use_desc: bool, h200: bool
) -> C.Config:
    """The Triton forward's tile for a problem a GPU runs (:func:`~flashlite.ops.attention.
    planner.gpu_config`): the pinned config (``$FLASHLITE_ATTENTION_CONFIG``), else the H200's
    or the generic table's entry, else the default."""
    block_d = C.block_d(head_dim)
    config = C.pinned_config() or _table_entry(block_d, causal, dtype, not use_desc, h200)
    return config or C.default_config(block_d, dtype.itemsize, use_desc)


_plans = Cache("attention.configs", 1024)


def fixed_reference(
    dtype: torch.dtype, softcap: float | None, sinks: torch.Tensor | None = None
) -> bool:
    """Whether the forward drops the running maximum for a fixed reference (no row max, no
    rescale of the accumulator: softcap's time drops to about that of no cap on the H200).

    A soft cap c bounds every score to [−c, c], so with the reference at c − δ,
    δ = max(2c − 80, 0), each ``p = e^(x − ref)`` lies in [e^−80, e^δ]: normal in fp32 and bf16
    (8 exponent bits; fp16's 5 would overflow or flush it). c ≤ 50 keeps p ≤ e^20 ≈ 5e8, so the
    sums stay far from overflow for any realistic V and length. A sink is not capped (it may
    sit far above c), so calls with sinks keep the running maximum. FP8's probabilities are
    rounded to e4m3 (4 exponent bits), which flushes ``p`` below about e^−6 relative to the
    reference: they need the row's own maximum."""
    wide = dtype not in (torch.float16, torch.float8_e4m3fn)  # (p's exponent range)
    return softcap is not None and softcap <= 50.0 and wide and sinks is None


def triton_plan(
    dev: torch.device,
    dtype: torch.dtype,
    d: int,
    causal: bool,
    small: bool,
    use_desc: bool,
    prescale_q: bool | None,
    config: C.Config | None,
    window: bool = False,
    softcap: bool = False,
    seqlens: bool = False,
    varlen: bool = False,
    fixed_ref: bool = False,
    sinks: bool = False,
    out_dtype: torch.dtype | None = None,
    head_dim_v: int | None = None,
) -> tuple[C.Config | None, dict]:
    """The config and the kernel's keyword arguments for one kind of call, worked out once per
    kind (small problems feel every microsecond of host work). ``out_dtype``: the output's,
    where it is not ``dtype`` (FP8 inputs); ``head_dim_v``: V's, where it is not ``d``."""
    key = (
        dev,
        dtype,
        d,
        causal,
        small,
        use_desc,
        prescale_q,
        config,
        window,
        softcap,
        seqlens,
        varlen,
        fixed_ref,
        sinks,
        out_dtype,
        head_dim_v,
        C.pinned_text(),
    )
    plan = _plans.get(key)
    if plan is not None:
        return plan
    block_d = C.block_d(d)
    # (the tile's table entry for the wider of the two head dims: what shared memory holds)
    widest = block_d if head_dim_v is None else max(block_d, C.block_d(head_dim_v))
    if config is None:
        config = fixed_config(dev, widest, causal, dtype, small=small, softcap=softcap)
    if config is not None:  # a plain tuple works too
        config = C.Config(*config)
    launch = {
        "HEAD_DIM": d,
        "BLOCK_D": block_d,
        "IS_CAUSAL": causal,
        "WINDOW": window,
        "SOFTCAP": softcap,
        "HAS_SEQLENS": seqlens,
        "VARLEN": varlen,
        "HAS_SINKS": sinks,
        "FIXED_REF": fixed_ref,
        "USE_DESC": use_desc,
        # fold the scale into Q for 16-bit inputs (see the kernel)
        "PRESCALE_Q": dtype in _PRESCALED if prescale_q is None else prescale_q,
        **dot_flags(dtype),
    }
    if head_dim_v is not None:  # V and O have a head dim of their own
        launch |= {"HEAD_DIM_V": head_dim_v, "BLOCK_DV": C.block_d(head_dim_v)}
    if dtype == torch.float8_e4m3fn:  # (Q·scale rounded to e4m3 would lose too much)
        # (ROUND_BF16: the interpreter's own rounding, to bf16 and to e4m3, is not to nearest)
        launch |= {"FP8": True, "PRESCALE_Q": False, "ROUND_BF16": _backend.INTERPRETED}
    if config is not None:
        launch |= config.constexprs()
        launch |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    _plans.put(key, (config, launch))
    return config, launch


def bwd_config(dev: torch.device, dtype: torch.dtype, head_dim: int, causal: bool) -> C.BwdConfig:
    """The backward's tiles and launch options: the interpreter's small tiles on CPU, else
    :func:`bwd_tiles` for this GPU."""
    if _backend.kernels_interpreted():
        return C.CPU_BWD_CONFIG
    return bwd_tiles(dtype.itemsize, head_dim, causal, _backend.capability(dev.index or 0))


def bwd_tiles(
    elem_bytes: int, head_dim: int, causal: bool, capability: tuple[int, int]
) -> C.BwdConfig:
    """The backward's config on a GPU of this compute capability, from the problem alone: what
    the backward plan runs there (:func:`bwd_config`) and what :mod:`flashlite.traffic` counts
    and models (the H200's, ``(9, 0)``, on any machine)."""
    return C.bwd_config(elem_bytes, head_dim, causal, capability)
