"""What a call runs, decided from shapes, dtypes and the device: the tile config (pinned, the
measured tables or the autotuner), descriptor or pointer loads, the Gluon kernels' applicability,
the decode kernel's key chunks, and the plan caches that keep those decisions per kind of call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.kernels import configs as C
from flashlite.kernels.attention import fwd as K
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB

#: packed sequences as the launchers take them: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#: max_seqlen_k)``
Varlen = tuple[torch.Tensor, torch.Tensor, int, int]

#: Problems with fewer multiply-adds than this (``B·Hq·Nq·Nk·D``) load through pointers. Tensor
#: descriptors cost host time on every call (built in Python, then encoded by the launcher:
#: about 35 µs per call on the H200 with Triton 3.6), more than TMA saves on a small problem;
#: from about a billion multiply-adds the kernel runs long enough for TMA to pay.
DESC_MIN_WORK = 1 << 30
#: The tile small problems run on a GPU (few programs: a 64-row tile keeps more SMs busy).
SMALL_CONFIG = C.Config(64, 64, 4, 2)


@dataclass(frozen=True)
class LaunchInfo:
    """What one kernel launch used (read by the traffic tools and the benchmark)."""

    config: C.Config
    block_d: int
    use_desc: bool


def small_problem(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Too little work for TMA descriptors to pay (fewer than :data:`DESC_MIN_WORK`
    multiply-adds ``B·Hq·Nq·Nk·D`` for ``(B, H, N, D)`` views): pointer loads."""
    b, hq, nq, d = q.shape
    return b * hq * nq * k.shape[2] * d < DESC_MIN_WORK


def descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a CUDA tensor, unit stride along D, 16-byte aligned base and strides."""
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
            return False
    return True


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


def gpu_config(
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    causal: bool,
    gpu: str = "h200",
) -> tuple[C.Config, bool]:
    """The tile config a GPU runs for a problem, known without one (what the traffic tools count
    and model; the interpreter runs any tile).

    Args:
        shape: ``(B, Hq, Nq, Nk, D)``.
        dtype: the inputs' dtype.
        causal: the mask.
        gpu: ``"h200"`` or ``"generic"`` (:data:`GPU_TABLES`).

    Returns:
        The config (the pinned one when ``$FLASHLITE_ATTENTION_CONFIG`` is set) and whether that
        GPU loads through tensor descriptors (problems past :data:`DESC_MIN_WORK`). Where the
        H200 runs the Gluon kernel (:func:`hopper_config`, with Triton 3.6's Gluon), its tiles as
        a ``warp_specialize`` config: the Triton kernel with those tiles issues the same bytes
        (Q and O once, K and V once per 128-row block), so the interpreter counts them.
    """
    if gpu not in GPU_TABLES:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(map(repr, GPU_TABLES))}")
    b, hq, nq, nk, d = shape
    block_d = C.block_d(d)
    use_desc = b * hq * nq * nk * d >= DESC_MIN_WORK
    hopper = _hopper_entry(dtype, d, nk) if gpu == "h200" and use_desc else None
    if hopper is not None:
        return hopper_launch_config(hopper), True
    config = C.pinned_config() or _table_entry(block_d, causal, dtype, not use_desc, gpu == "h200")
    return config or C.default_config(block_d, dtype.itemsize, use_desc), use_desc


def empty_output(q: torch.Tensor) -> torch.Tensor:
    """``O`` for ``q`` (``b h n d`` view): dense in the order of q's strides, so it keeps q's
    layout (``b n h d`` too, also for slices of a packed qkv buffer)."""
    if q.is_contiguous() or q.transpose(1, 2).is_contiguous():  # the usual layouts, quickly
        return torch.empty_like(q)
    order = sorted(range(4), key=lambda i: -q.stride(i))
    o = q.new_empty([q.shape[i] for i in order])
    return o.permute([order.index(i) for i in range(4)])


_plans = Cache("attention.configs", 1024)

#: ``FLASHLITE_HOPPER_KERNEL=0`` keeps every forward on the Triton kernel (A/B runs, debugging).
HOPPER_ENV = "FLASHLITE_HOPPER_KERNEL"


def hopper_config(q: torch.Tensor, n_keys: int) -> KH.HopperConfig | None:
    """The Gluon kernel's config for a plain forward of ``q`` ``(B, H, N, D)`` over ``n_keys``
    keys, or None where it does not apply: not a CUDA sm_90 device, not fp16/bf16, a head dim
    without a measured entry (:data:`~flashlite.kernels.attention.hopper.CONFIGS`) or fewer
    keys than the entry's ``min_keys``, no Gluon in this Triton, a config pinned through the
    environment, or ``FLASHLITE_HOPPER_KERNEL=0``."""
    if not _on_hopper(q, KH.available()):
        return None
    return _hopper_entry(q.dtype, q.shape[-1], n_keys)


def _on_hopper(t: torch.Tensor, gluon_ok: bool) -> bool:
    """Whether ``t`` lives on a compiled (not interpreted) CUDA sm_90 device and this Triton
    can build the Gluon kernel in question (``gluon_ok``)."""
    if t.device.type != "cuda" or _backend.kernels_interpreted() or not gluon_ok:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _backend.capability(index)[0] == 9


def hopper_bwd_applies(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> bool:
    """Whether a plain backward (causal or not, GQA; no window, soft cap, per-batch lengths or
    packed sequences: the caller checks those) of these ``(B, H, N, D)`` tensors takes the fused
    Gluon kernel (:mod:`flashlite.kernels.attention.hopper_bwd`): a CUDA sm_90 device with
    Gluon, 16-bit inputs, a head dim in its ``HEAD_DIMS``, tensors TMA can read, gradients with
    a unit last stride, ``FLASHLITE_HOPPER_KERNEL`` not ``0``, and deterministic algorithms not
    requested (``torch.use_deterministic_algorithms``): its dQ is summed by atomic reductions
    in no fixed order, so there the two Triton kernels run instead."""
    if qs.dtype not in (torch.float16, torch.bfloat16) or qs.shape[-1] not in KHB.HEAD_DIMS:
        return False
    if torch.are_deterministic_algorithms_enabled() or _backend.getenv(HOPPER_ENV) == "0":
        return False
    units = dk.stride(-1) == 1 and dv.stride(-1) == 1
    return _on_hopper(qs, KHB.available()) and descriptor_ok(qs, k, v, do) and units


def _hopper_entry(dtype: torch.dtype, head_dim: int, n_keys: int) -> KH.HopperConfig | None:
    """The rule :func:`hopper_config` and :func:`gpu_config` share, from the problem alone: a
    16-bit problem whose head dim has a measured entry and at least its ``min_keys`` keys, with
    no config pinned and the kernel not switched off."""
    if dtype not in (torch.float16, torch.bfloat16) or C.pinned_text():
        return None
    if _backend.getenv(HOPPER_ENV) == "0":
        return None
    config = KH.CONFIGS.get(head_dim)
    return config if config is not None and n_keys >= config.min_keys else None


def hopper_launch_config(config: KH.HopperConfig) -> C.Config:
    """How launches of the Gluon kernel are reported (``LaunchInfo``, the traffic tools): its
    tiles, its 4-warp consumers and ring slots, ``warp_specialize`` on."""
    return C.Config(config.block_m, config.block_n, 4, config.stages, warp_specialize=True)


def tensor_meta(t: torch.Tensor | None) -> tuple | None:
    """What a launch plan depends on in a tensor: shape, strides, dtype, device, alignment."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def default_splits(
    dev: torch.device, programs: int, rows: int, nk: int, block_m: int, per_sm: int = 1
) -> int:
    """Key chunks per row block on this device: :func:`splits_for` on a GPU, 1 in the
    interpreter (its programs run one after the other)."""
    if _backend.kernels_interpreted() or dev.type != "cuda":
        return 1
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return splits_for(programs, rows, nk, _backend.num_sms(index), block_m, per_sm)


def splits_for(programs: int, rows: int, nk: int, sms: int, block_m: int, per_sm: int = 1) -> int:
    """At most ``per_sm`` programs per SM, no chunk shorter than 256 keys, at most 64 chunks
    (``programs`` = batch·KV heads, ``rows`` = packed query rows per KV head). A contiguous
    cache streams fastest with one long chunk per SM (its loads are pipelined; a second program
    only splits the SM's bandwidth); a paged one, whose loads wait on the block table, with two
    (H200, ``benchmarks/NOTES.md``)."""
    blocks = programs * C.cdiv(rows, block_m)
    if blocks == 0:  # an empty batch or no query rows: nothing to split
        return 1
    return max(1, min(per_sm * sms // blocks, C.cdiv(nk, 256), 64))


def prefix_splits(
    rows: int, hkv: int, n_keys: int, head_dim: int, elem_bytes: int, sms: int
) -> int:
    """Key chunks of :func:`flashlite.attention_shared_prefix`'s prefix pass (``rows`` query rows
    per KV head, all requests together, against ``n_keys`` shared keys) on a GPU of ``sms`` SMs:
    two programs per SM, where a single decode step's one per SM leaves its few programs
    waiting on their loads (at Np = 32k and 256 rows per KV head, 8 chunks ran 0.100 ms on the
    H200 in a CUDA graph, 4 chunks 0.119 ms). Read by the op and by :mod:`flashlite.traffic`."""
    block_m = decode_tiles(rows, hkv, head_dim, elem_bytes).block_m
    return splits_for(hkv, rows, n_keys, sms, block_m, per_sm=2)


def fixed_reference(
    dtype: torch.dtype, softcap: float | None, sinks: torch.Tensor | None = None
) -> bool:
    """Whether the forward drops the running maximum for a fixed reference (no row max, no
    rescale of the accumulator: softcap's time drops to about that of no cap on the H200).

    A soft cap c bounds every score to [−c, c], so with the reference at c − δ,
    δ = max(2c − 80, 0), each ``p = e^(x − ref)`` lies in [e^−80, e^δ]: normal in fp32 and bf16
    (8 exponent bits; fp16's 5 would overflow or flush it). c ≤ 50 keeps p ≤ e^20 ≈ 5e8, so the
    sums stay far from overflow for any realistic V and length. A sink is not capped (it may
    sit far above c), so calls with sinks keep the running maximum."""
    return softcap is not None and softcap <= 50.0 and dtype != torch.float16 and sinks is None


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
) -> tuple[C.Config | None, dict]:
    """The config and the kernel's keyword arguments for one kind of call, worked out once per
    kind (small problems feel every microsecond of host work)."""
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
        C.pinned_text(),
    )
    plan = _plans.get(key)
    if plan is not None:
        return plan
    block_d = C.block_d(d)
    if config is None:
        config = fixed_config(dev, block_d, causal, dtype, small=small, softcap=softcap)
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
        "PRESCALE_Q": dtype != torch.float32 if prescale_q is None else prescale_q,
        **dot_flags(dtype),
    }
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


def decode_tiles(
    rows: int, programs: int, head_dim: int, elem_bytes: int, interpreted: bool = False
) -> C.DecodeConfig:
    """The decode kernel's tile for ``rows`` packed query rows per KV head (``Nq·Hq/Hkv``) over
    ``programs`` = B·Hkv of them: what :class:`~flashlite.ops.attention.DecodePlan` runs (the
    interpreter's small tile where ``interpreted``) and what :mod:`flashlite.traffic` counts
    and models."""
    return C.decode_config(rows, interpreted, programs, C.block_d(head_dim), elem_bytes)


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """The attention kernels' precision constexprs for inputs of ``dtype``: fp32 operands for
    ``tl.dot`` where the backend needs them (the interpreter's bf16), three TF32 passes for fp32
    inputs (about fp32 accuracy on tensor cores), and the store-side bf16 rounding."""
    return {
        "DOT_FP32": _backend.dot_upcast(dtype),
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(dtype),
    }


def prescales_q(q: torch.Tensor) -> bool:
    return q.dtype != torch.float32  # as the forward computed the scores


def chosen_splits(q: torch.Tensor, k: torch.Tensor, num_splits: int | None) -> int:
    """The op's ``num_splits`` for :func:`attention`'s: 0 runs the forward kernel, n >= 1 the
    decode kernel with n key chunks. ``None`` takes the decode kernel on a GPU when the packed
    query rows per KV head (``Nq·Hq/Hkv``) fit one of its tiles, with the chunks that fill the
    GPU; ``1`` never splits."""
    if num_splits is not None:
        return 0 if num_splits == 1 else num_splits
    if not q.is_cuda or _backend.INTERPRETED:
        return 0
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = nq * (hq // hkv)
    if rows > DECODE_MAX_ROWS:
        return 0
    key = (q.shape, hkv, nk, q.dtype, q.device)
    found = _splits.get(key)
    if found is None:
        block_m = decode_tiles(rows, b * hkv, q.shape[3], q.element_size()).block_m
        found = _splits.put(key, default_splits(q.device, b * hkv, rows, nk, block_m))
    return found


#: :func:`chosen_splits` per decode shape (a decode loop asks once per step).
_splits = Cache("attention.decode_splits", 1024)


#: :func:`attention` runs the decode kernel by itself up to this many packed rows (one tile).
DECODE_MAX_ROWS = 64
