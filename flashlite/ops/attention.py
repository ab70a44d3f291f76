"""Tiled attention front-end: validation, layouts, config choice, launch, custom op, autograd.

The kernel lives in :mod:`flashlite.kernels.attention.fwd` and its tile table in
:mod:`flashlite.kernels.configs`; on Hopper, the plain cases (16-bit, head dim 64 or 128, causal
or not, TMA-readable strides) run :mod:`flashlite.kernels.attention.hopper`'s warp-specialised
Gluon kernel instead (:func:`hopper_config` says when). This module reads any layout through
strides (no copies), chooses tensor-descriptor or pointer loads and the tile config
(:func:`fixed_config`, else the autotuner, once per length bucket), and launches it.

``flashlite::attention_fwd`` is a ``torch.library`` custom op with a fake implementation, so
``torch.compile(fullgraph=True)`` traces through :func:`attention` without a graph break; its
autograd formula is ``flashlite::attention_bwd`` (the kernels of :mod:`..kernels.attention.bwd`).
It is a ``custom_op`` rather than a ``triton_op``: the same op runs CPU tensors in Triton's
interpreter or moves them to the GPU, picks descriptors and configs on the host per call, and
Inductor could only inline the CUDA case.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _backend, masks
from flashlite.kernels import configs as C
from flashlite.kernels.attention import bwd as KB
from flashlite.kernels.attention import decode as KD
from flashlite.kernels.attention import fwd as K
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.attention import hopper_bwd as KHB
from flashlite.ops.common import (
    check_flag,
    check_softcap,
    on_compute_device,
    overlapping,
    plain_eager,
    skip_dispatcher,
)

LAYOUTS = ("b h n d", "b n h d")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
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
        if t.dtype not in DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; accepted: "
                "torch.float16, torch.bfloat16, torch.float32"
            )
        _backend.check_device(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if layout == "b n h d":  # a strided view, no copy
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (B, Hkv, Nk, D) in layout {layout!r}, got "
            f"{tuple(k.shape)} and {tuple(v.shape)} (as b h n d)"
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
    return _check_scale(scale, d), q, k, v


def check_inputs(
    q: object, k: object, v: object, layout: str, scale: object
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention`'s argument checks for other front-ends (ring attention): the softmax
    scale and ``b h n d`` views of q, k and v, or the errors :func:`attention` raises."""
    return _check(q, k, v, layout, scale)


def _check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: ``scale`` validated, or ``1/sqrt(D)`` for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not 0 < scale < math.inf:  # (NaN fails it too; comparisons trace under torch.compile)
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return float(scale)


def _descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a CUDA tensor, unit stride along D, 16-byte aligned base and strides."""
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
            return False
    return True


_tuned: dict[tuple[int, int], object] = {}


def _tuned_kernel(seq_q: int, seq_k: int) -> object:
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
        return _hopper_launch_config(hopper), True
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


@on_compute_device
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    varlen: Varlen | None = None,
    num_splits: int = 0,
    config: C.Config | None = None,
    use_desc: bool | None = None,
    prescale_q: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LaunchInfo | None]:
    """Launch the forward kernel on validated ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hkv, Nk, D)``; any strides, one dtype and device.
        causal: bottom-right aligned mask (:mod:`flashlite.masks`).
        scale: the softmax scale.
        window: ``(left, right)`` sliding window, −1 unlimited (:mod:`flashlite.masks`).
        softcap: cap the scaled scores at ``softcap·tanh(s/softcap)`` (None: no cap).
        seqlens_k: int32 ``(B,)``: batch b has only its first ``seqlens_k[b]`` keys.
        varlen: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for packed
            sequences; q, k, v are then ``(1, H, total, D)`` views.
        num_splits: 0 runs this forward kernel; n >= 1 runs :func:`attention_decode_fwd` (GQA
            rows packed, the keys split across n programs per row block and merged; not with
            ``varlen``).
        config: pin a :class:`~flashlite.kernels.configs.Config` (else :func:`fixed_config` or
            the autotuner chooses).
        use_desc: force descriptor (True) or pointer (False) loads.
        prescale_q: fold the scale into Q (default for 16-bit inputs).

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` strided like ``q``, the fp32 LSE ``(B, Hq, Nq)`` and what the
        launch used (None when nothing was launched). CPU tensors in a process that compiles its
        kernels run on the GPU: moved there once, results moved back.
    """
    if num_splits > 0 and varlen is None:  # few rows: packed GQA, split-KV, the exact merge
        o, lse, _ = attention_decode_fwd(q, k, v, seqlens_k, causal, scale, window=window,
                                         softcap=softcap, num_splits=num_splits)  # fmt: skip
        return o, lse, None
    dev = q.device
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    o = empty_output(q)
    lse = q.new_empty((b, hq, nq), dtype=torch.float32)
    if b * hq * nq == 0:
        return o, lse, None
    if nk == 0:  # no key at all: every row sees nothing
        return o.zero_(), lse.fill_(-math.inf), None

    small = b * hq * nq * nk * d < DESC_MIN_WORK
    if use_desc is None:
        use_desc = not small and _descriptor_ok(q, k, v, o)
    is_causal, has_window, left, right = masks.kernel_window(window, causal, nq, nk)
    plain = not (has_window or softcap is not None or seqlens_k is not None or varlen is not None)
    if plain and use_desc and config is None and prescale_q is not False:
        hopper = hopper_config(q, nk)
        if hopper is not None and _run_hopper(q, k, v, o, lse, is_causal, scale, hopper):
            return o, lse, LaunchInfo(_hopper_launch_config(hopper), d, True)
    config, launch = _plan(dev, q.dtype, d, is_causal, small and not use_desc, use_desc,
                           prescale_q, config, has_window, softcap is not None,
                           seqlens_k is not None, varlen is not None,
                           _fixed_reference(q.dtype, softcap))  # fmt: skip
    block_d = launch["BLOCK_D"]
    if use_desc:  # block shapes are set per config (set_block_shapes), placeholders here
        bm, bn = (config.block_m, config.block_n) if config is not None else (16, 16)
        srcs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
                for t, r in ((q, bm), (k, bn), (v, bn), (o, bm))]  # fmt: skip
        if varlen is not None:  # O is stored through pointers (blocks cross sequences)
            srcs[3] = o
    else:
        srcs = [q, k, v, o]
    args = (*srcs, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            hq, hq // hkv, nq, nk, scale, left, right, softcap or 0.0,
            seqlens_k if seqlens_k is not None else lse,
            *(varlen[:2] if varlen is not None else (lse, lse)))  # fmt: skip
    # packed sequences: one program row per sequence, as many query blocks as the longest has
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    if config is not None:
        fwd = _backend.launcher(K._attention_fwd_kernel)
        fwd[(C.cdiv(rows, config.block_m), seqs * hq)](*args, **launch)
    else:
        tuned = _tuned_kernel(rows, nk)
        tuned[lambda meta: (C.cdiv(rows, meta["BLOCK_M"]), seqs * hq)](*args, **launch)  # type: ignore[index]
        config = C.Config.of(tuned.best_config)  # type: ignore[attr-defined]
    return o, lse, LaunchInfo(config, block_d, use_desc)


_plans: dict[tuple, tuple[C.Config | None, dict]] = {}

#: ``FLASHLITE_HOPPER_KERNEL=0`` keeps every forward on the Triton kernel (A/B runs, debugging).
HOPPER_ENV = "FLASHLITE_HOPPER_KERNEL"
#: Kernel variants whose first launch failed (a Triton whose Gluon differs): the Triton kernel
#: runs them instead, after one warning.
_hopper_failed: set[tuple] = set()


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


def _hopper_entry(dtype: torch.dtype, head_dim: int, n_keys: int) -> KH.HopperConfig | None:
    """The rule :func:`hopper_config` and :func:`gpu_config` share, from the problem alone: a
    16-bit problem whose head dim has a measured entry and at least its ``min_keys`` keys, with
    no config pinned and the kernel not switched off."""
    if dtype not in (torch.float16, torch.bfloat16) or C.pinned_text():
        return None
    if os.environ.get(HOPPER_ENV, "1") == "0":
        return None
    config = KH.CONFIGS.get(head_dim)
    return config if config is not None and n_keys >= config.min_keys else None


def _hopper_launch_config(config: KH.HopperConfig) -> C.Config:
    """How launches of the Gluon kernel are reported (``LaunchInfo``, the traffic tools): its
    tiles, its 4-warp consumers and ring slots, ``warp_specialize`` on."""
    return C.Config(config.block_m, config.block_n, 4, config.stages, warp_specialize=True)


def _run_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, causal: bool, scale: float,
                config: KH.HopperConfig) -> bool:  # fmt: skip
    """Launch the Gluon kernel; False (after one warning) if it fails to compile here."""
    key = (q.dtype, causal, config)
    if key in _hopper_failed:
        return False
    try:
        KH.attention_fwd_hopper(q, k, v, o, lse, causal, scale, config)
    except (triton.CompilationError, TypeError, ValueError, AttributeError) as err:
        _hopper_failed.add(key)
        warnings.warn(f"flashlite: the Hopper attention kernel failed to build ({err!r:.300}); "
                      "the Triton kernel runs instead", RuntimeWarning, stacklevel=3)  # fmt: skip
        return False
    return True


@on_compute_device
def attention_decode_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens_k: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: C.DecodeConfig | None = None,
    use_desc: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward for few query rows against many keys (:mod:`flashlite.kernels.attention.decode`):
    the query heads of a GQA group packed into one tile, the keys split across programs and the
    partials merged exactly (flash-decoding).

    Args:
        q: ``(B, Hq, Nq, D)`` view. k, v: a cache ``(B, Hkv, Ncap, D)`` or, with
            ``block_table`` ``(B, max_pages)`` int32, a paged one ``(num_pages, Hkv, page_size,
            D)`` (both as ``b h n d`` views of the ``b n h d`` storage).
        seqlens_k: int32 ``(B,)`` keys in use per batch (clamped to ``[0, Ncap]``), or None: all.
        num_splits: key chunks per row block (None: :func:`splits_for` this GPU; 1 on CPU).
        config: pin the tile (else :func:`flashlite.kernels.configs.decode_config`).
        use_desc: force TMA descriptor (True) or pointer (False) K/V loads (contiguous caches).

    Returns:
        ``O`` ``(B, Hq, Nq, D)`` strided like q, the fp32 LSE ``(B, Hq, Nq)``, the splits used.
    """
    o = empty_output(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    # (o is fresh and strided from q: q's entry pins it)
    key = (_meta(q), _meta(k), _meta(v), _meta(seqlens_k), _meta(block_table), causal, scale,
           window, softcap, num_splits, config, use_desc)  # fmt: skip
    plan = _planned(_decode_plans, key, lambda: DecodePlan(
        q, k, v, o, seqlens_k, block_table, causal, scale, window, softcap, num_splits, config,
        use_desc))  # fmt: skip
    return o, lse, plan(q, k, v, seqlens_k, block_table, o, lse)


def _meta(t: torch.Tensor | None) -> tuple | None:
    """What a launch plan depends on in a tensor: shape, strides, dtype, device, alignment."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


#: Plans kept per cache before it starts afresh (a serving loop sees a handful of shapes).
_PLAN_CACHE_LIMIT = 1024


def _cache(cache: dict, key: tuple, plan: object) -> object:
    if len(cache) >= _PLAN_CACHE_LIMIT:
        cache.clear()
    cache[key] = plan
    return plan


def _planned(cache: dict, key: tuple, make: Callable[[], object]) -> Any:
    """``cache[key]``, made by ``make()`` (and kept) the first time."""
    plan = cache.get(key)
    return plan if plan is not None else _cache(cache, key, make())


class DecodePlan:
    """Everything :func:`attention_decode_fwd` works out from shapes, strides and options — the
    tile, the key chunks, the grids, the kernels' scalar arguments and their compiled launches
    — made once per kind of call and reused: a decode loop calls one shape thousands of times,
    and at B=8 the host's per-call work was twice the GPU's (``benchmarks/NOTES.md``).

    The caller's key pins what the plan read (:func:`_meta` of every tensor, every option).
    ``o`` and ``lse`` must be fresh allocations strided like the ones it was made with.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        seqlens_k: torch.Tensor | None,
        block_table: torch.Tensor | None,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None,
        softcap: float | None,
        num_splits: int | None,
        config: C.DecodeConfig | None,
        use_desc: bool | None,
    ) -> None:
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        page_size = k.shape[2] if block_table is not None else 0
        nk = block_table.shape[1] * page_size if block_table is not None else k.shape[2]
        self.empty = b * hq * nq == 0 or nk == 0
        self.splits = 1
        if self.empty:
            return
        group = hq // hkv
        if config is None:
            config = C.decode_config(nq * group, _backend.kernels_interpreted(), b * hkv,
                                     C.block_d(d), q.element_size())  # fmt: skip
        if num_splits is None:  # (paged tiles load one after the other: two programs per SM)
            num_splits = _default_splits(q.device, b * hkv, nq * group, nk, config.block_m,
                                         2 if page_size else 1)  # fmt: skip
        bn = config.block_n
        split_len = bn * C.cdiv(C.cdiv(nk, bn), num_splits)
        self.splits = splits = C.cdiv(nk, split_len)  # chunks of whole tiles: at most num_splits
        if use_desc is None:
            use_desc = config.use_desc
        self.use_desc = use_desc and block_table is None and _descriptor_ok(k, v)
        self.desc_block = [1, 1, bn, C.block_d(d)]
        is_causal, has_window, left, right = masks.kernel_window(window, causal, nq, nk)
        self.options = {
            "GROUP": group, "HEAD_DIM": d, "BLOCK_D": C.block_d(d), "BLOCK_M": config.block_m,
            "BLOCK_N": bn, "IS_CAUSAL": is_causal, "WINDOW": has_window,
            "SOFTCAP": softcap is not None, "HAS_SEQLENS": seqlens_k is not None,
            "PAGE_SIZE": page_size, "USE_DESC": self.use_desc,
            "PRESCALE_Q": _prescale_q(q), **_dot_flags(q.dtype),
            "num_warps": config.num_warps, "num_stages": config.num_stages,
        }  # fmt: skip
        self.grid = (C.cdiv(nq * group, config.block_m), b * hkv, splits)
        # split partials: fp32 (S·B, Hq, Nq, D) and (S·B·Hq, Nq), contiguous
        self.parts = ((splits * b, hq, nq, d), (splits * b * hq, nq)) if splits > 1 else None
        parts_stride = (hq * nq * d, nq * d, d, 1)
        self.head = (*q.stride(), *k.stride(), *v.stride(),
                     *(parts_stride if self.parts else o.stride()), hkv, nq, nk, scale, left,
                     right, softcap or 0.0)  # fmt: skip
        self.tail = (block_table.stride(0) if block_table is not None else 0, k.shape[0],
                     split_len)  # fmt: skip
        self.combine_head = (b * hq * nq * d, *parts_stride, *o.stride(), hq, nq, splits)
        self.combine_options = {
            "HEAD_DIM": d, "BLOCK_D": C.block_d(d),
            "SPLITS_PAD": max(2, triton.next_power_of_2(splits)),
            "ROUND_BF16": _backend.round_bf16(o.dtype), "num_warps": 4, "num_stages": 1,
        }  # fmt: skip
        self.combine_grid = (nq, b * hq, 1)
        self._decode = self._combine = None  # bound at the first run (its tensors specialise)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens_k: torch.Tensor | None,
        block_table: torch.Tensor | None,
        o: torch.Tensor,
        lse: torch.Tensor,
    ) -> int:
        """Run on tensors of the planned kind (any view of the same memory: only their data
        pointers are read); returns the chunks used."""
        if self.empty:
            o.zero_()
            lse.fill_(-math.inf)
            return 1
        if self.parts is not None:
            o_out = torch.empty(self.parts[0], dtype=torch.float32, device=o.device)
            lse_out = torch.empty(self.parts[1], dtype=torch.float32, device=o.device)
        else:
            o_out, lse_out = o, lse
        if self.use_desc:  # (descriptors hold the data pointer: built per call)
            k = TensorDescriptor(k, list(k.shape), list(k.stride()), self.desc_block)
            v = TensorDescriptor(v, list(v.shape), list(v.stride()), self.desc_block)
        args = (q, k, v, o_out, lse_out, *self.head, lse if seqlens_k is None else seqlens_k,
                lse if block_table is None else block_table, *self.tail)  # fmt: skip
        if self._decode is None:
            self._decode = _backend.launcher(KD._attention_decode_kernel).bind(args, self.options)
        self._decode(self.grid, *args)
        if self.parts is not None:
            args = (o_out, lse_out, o, lse, *self.combine_head)
            if self._combine is None:
                kernel = _backend.launcher(KD._split_kv_combine_kernel)
                self._combine = kernel.bind(args, self.combine_options)
            self._combine(self.combine_grid, *args)
        return self.splits


def combine_splits(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge split-KV partials into ``o`` and ``lse`` (:mod:`flashlite.kernels.attention.decode`;
    the torch twin is :func:`flashlite.stats.merge_attention` folded over the splits).

    Args:
        o_parts: fp32 ``(S, B, H, Nq, D)``; lse_parts: contiguous fp32 ``(S, B, H, Nq)``.
        o: ``(B, H, Nq, D)`` output (any strides); lse: contiguous fp32 ``(B, H, Nq)``.
    """
    splits, b, h, nq, d = o_parts.shape
    combine = _backend.launcher(KD._split_kv_combine_kernel)
    combine[(nq, b * h)](
        o_parts, lse_parts, o, lse, *o_parts.stride(), *o.stride(), h, nq, splits, HEAD_DIM=d,
        BLOCK_D=C.block_d(d), SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        ROUND_BF16=_backend.round_bf16(o.dtype), num_warps=4, num_stages=1,
    )  # fmt: skip


#: :class:`DecodePlan` per kind of :func:`attention_decode_fwd` call.
_decode_plans: dict[tuple, DecodePlan] = {}


def _default_splits(
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


def _fixed_reference(dtype: torch.dtype, softcap: float | None) -> bool:
    """Whether the forward drops the running maximum for a fixed reference (no row max, no
    rescale of the accumulator: softcap's time drops to about that of no cap on the H200).

    A soft cap c bounds every score to [−c, c], so with the reference at c − δ,
    δ = max(2c − 80, 0), each ``p = e^(x − ref)`` lies in [e^−80, e^δ]: normal in fp32 and bf16
    (8 exponent bits; fp16's 5 would overflow or flush it). c ≤ 50 keeps p ≤ e^20 ≈ 5e8, so the
    sums stay far from overflow for any realistic V and length."""
    return softcap is not None and softcap <= 50.0 and dtype != torch.float16


def _plan(
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
) -> tuple[C.Config | None, dict]:
    """The config and the kernel's keyword arguments for one kind of call, worked out once per
    kind (small problems feel every microsecond of host work)."""
    key = (dev, dtype, d, causal, small, use_desc, prescale_q, config, window, softcap, seqlens,
           varlen, fixed_ref, C.pinned_text())  # fmt: skip
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
        "FIXED_REF": fixed_ref,
        "USE_DESC": use_desc,
        # fold the scale into Q for 16-bit inputs (see the kernel)
        "PRESCALE_Q": dtype != torch.float32 if prescale_q is None else prescale_q,
        **_dot_flags(dtype),
    }
    if config is not None:
        launch |= config.constexprs()
        launch |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    _plans[key] = (config, launch)
    return config, launch


# ----------------------------------------------------------------------------- custom op
def _attention_fwd_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    window, cap = _op_extras(window_left, window_right, softcap)
    varlen = _op_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse, _ = attention_fwd(q, k, v, causal, scale, window=window, softcap=cap,
                              seqlens_k=seqlens_k, varlen=varlen,
                              num_splits=num_splits)  # fmt: skip
    return o, lse


_attention_fwd_op = torch.library.custom_op("flashlite::attention_fwd", mutates_args=())(
    _attention_fwd_body
)


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0, seqlens_k=None,  # type: ignore[no-untyped-def]
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
      num_splits=0):  # fmt: skip
    return empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


#: packed sequences as the launchers take them: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#: max_seqlen_k)``
Varlen = tuple[torch.Tensor, torch.Tensor, int, int]


def _op_varlen(
    cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, max_q: int, max_k: int
) -> Varlen | None:
    return None if cu_q is None or cu_k is None else (cu_q, cu_k, max_q, max_k)


def _op_extras(
    window_left: int, window_right: int, softcap: float
) -> tuple[tuple[int, int] | None, float | None]:
    """The ops' flat mask arguments (−1, −1 and 0.0 mean none) as the launchers take them."""
    window = None if window_left == window_right == -1 else (window_left, window_right)
    return window, (softcap if softcap > 0 else None)


def bwd_config(dev: torch.device, dtype: torch.dtype, head_dim: int, causal: bool) -> C.BwdConfig:
    """The backward's tiles and launch options: the interpreter's small tiles on CPU, else
    :func:`flashlite.kernels.configs.bwd_config` for this GPU."""
    if _backend.kernels_interpreted():
        return C.CPU_BWD_CONFIG
    return C.bwd_config(dtype.itemsize, head_dim, causal, _backend.capability(dev.index or 0))


@on_compute_device
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    varlen: Varlen | None = None,
    config: C.BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on ``(B, H, N, D)`` views (no autograd, no checks).

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output; q, o alike; k, v ``(B, Hkv, Nk, D)``.
        lse: the forward's fp32 ``(B, Hq, Nq)`` LSE; dlse: its gradient, or None.
        causal, scale, window, softcap, seqlens_k, varlen: as in the forward.
        config: pin the kernels' tiles (the traffic tools count the GPU's on a CPU; benchmarks).

    Returns:
        ``(dq, dk, dv)``, each strided like its input. Extra memory: delta, fp32 ``(B, Hq, Nq)``;
        on the fused Hopper path (:func:`hopper_bwd_applies`) also dQ's fp32 accumulator,
        ``(B, Hq, Nq, D)``.
    """
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
    if b * hq * nq == 0 or nk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    is_causal, has_window = masks.kernel_window(window, causal, nq, nk)[:2]
    cfg = config or bwd_config(q.device, q.dtype, d, is_causal)
    # 16-bit inputs: the preprocess writes Qs (Q·scale·log2 e, as the forward rounded it) into
    # dq's memory; the dQ kernel reads each block of it before overwriting it with dQ
    qs = dq if _prescale_q(q) else q
    delta = bwd_preprocess(o, do, lse, dlse, q, qs, scale)
    lse = lse.contiguous()  # the kernels index the (B, Hq, Nq) statistics densely
    plain = not has_window and softcap is None and seqlens_k is None and varlen is None
    fused = config is None and plain and hopper_bwd_applies(qs, k, v, do, dk, dv)
    if fused and _run_hopper_bwd(qs, k, v, do, lse, delta, dq, dk, dv, is_causal, scale):
        return dq, dk, dv
    masking = {"window": window, "softcap": softcap, "seqlens_k": seqlens_k, "varlen": varlen}
    bwd_dkdv(qs, k, v, do, lse, delta, dk, dv, causal, scale, cfg, **masking)
    bwd_dq(qs, k, v, do, lse, delta, dq, causal, scale, cfg, **masking)
    return dq, dk, dv


#: Fused-backward variants whose first launch failed to build: the Triton kernels run them.
_hopper_bwd_failed: set[tuple] = set()


def hopper_bwd_applies(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                       dk: torch.Tensor, dv: torch.Tensor) -> bool:  # fmt: skip
    """Whether a plain backward (causal or not, GQA; no window, soft cap, per-batch lengths or
    packed sequences: the caller checks those) of these ``(B, H, N, D)`` tensors takes the fused
    Gluon kernel (:mod:`flashlite.kernels.attention.hopper_bwd`): a CUDA sm_90 device with
    Gluon, 16-bit inputs, a head dim in its ``HEAD_DIMS``, tensors TMA can read, gradients with
    a unit last stride, ``FLASHLITE_HOPPER_KERNEL`` not ``0``, and deterministic algorithms not
    requested (``torch.use_deterministic_algorithms``): its dQ is summed by atomic reductions
    in no fixed order, so there the two Triton kernels run instead."""
    if qs.dtype not in (torch.float16, torch.bfloat16) or qs.shape[-1] not in KHB.HEAD_DIMS:
        return False
    if torch.are_deterministic_algorithms_enabled() or os.environ.get(HOPPER_ENV, "1") == "0":
        return False
    units = dk.stride(-1) == 1 and dv.stride(-1) == 1
    return _on_hopper(qs, KHB.available()) and _descriptor_ok(qs, k, v, do) and units


def _run_hopper_bwd(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                    dv: torch.Tensor, causal: bool, scale: float) -> bool:  # fmt: skip
    """Launch the fused Gluon backward; False (after one warning) if it fails to build here."""
    key = (qs.dtype, qs.shape[-1], causal)
    if key in _hopper_bwd_failed:
        return False
    try:
        KHB.attention_bwd_hopper(qs, k, v, do, lse, delta, dq, dk, dv, causal, scale)
    except (triton.CompilationError, TypeError, ValueError, AttributeError) as err:
        _hopper_bwd_failed.add(key)
        warnings.warn(f"flashlite: the fused Hopper attention backward failed to build "
                      f"({err!r:.300}); the Triton kernels run instead", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
        return False
    return True


def _dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """The attention kernels' precision constexprs for inputs of ``dtype``: fp32 operands for
    ``tl.dot`` where the backend needs them (the interpreter's bf16), three TF32 passes for fp32
    inputs (about fp32 accuracy on tensor cores), and the store-side bf16 rounding."""
    return {
        "DOT_FP32": _backend.dot_upcast(dtype),
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",
        "ROUND_BF16": _backend.round_bf16(dtype),
    }


def _prescale_q(q: torch.Tensor) -> bool:
    return q.dtype != torch.float32  # as the forward computed the scores


def _bwd_args(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    window: tuple[int, int] | None,
    softcap: float | None,
    seqlens_k: torch.Tensor | None,
    varlen: Varlen | None,
    lse: torch.Tensor,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The backward kernels' mask arguments ``(win_left, win_right, softcap, SEQLENS_K, CU_Q,
    CU_K)`` and flags."""
    is_causal, has_window, left, right = masks.kernel_window(window, causal, q.shape[2], k.shape[2])
    lengths = seqlens_k if seqlens_k is not None else lse  # (a placeholder pointer)
    cu = varlen[:2] if varlen is not None else (lse, lse)
    return (left, right, softcap or 0.0, lengths, *cu), {
        "HAS_SEQLENS": seqlens_k is not None,
        "VARLEN": varlen is not None,
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": C.block_d(q.shape[-1]),
        "IS_CAUSAL": is_causal,
        "WINDOW": has_window,
        "SOFTCAP": softcap is not None,
        "PRESCALE_Q": _prescale_q(q),
        **_dot_flags(q.dtype),
    }


def bwd_preprocess(
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    qs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse``: fp32 ``(B, Hq, Nq)`` from ``(B, Hq, Nq, D)`` O, dO;
    for 16-bit inputs also ``qs = Q·scale·log2 e`` rounded as the forward rounded it (``qs`` is
    ``q`` itself for fp32, and not written)."""
    b, hq, nq, d = o.shape
    # an expanded or strided dlse (autograd may hand one over) is made dense here, O(N)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    delta = torch.empty((b, hq, nq), device=o.device, dtype=torch.float32)
    bm = 64 if d <= 128 else 32
    prep = _backend.launcher(KB._attention_bwd_preprocess_kernel)
    prep[(C.cdiv(nq, bm), b * hq)](
        o, do, dlse if dlse is not None else delta, delta, q, qs, *o.stride(), *do.stride(),
        *q.stride(), *qs.stride(), hq, nq, scale, HEAD_DIM=d, BLOCK_D=C.block_d(d),
        BLOCK_M=bm, HAS_DLSE=dlse is not None, PRESCALE_Q=_prescale_q(q),
        ROUND_BF16=_backend.round_bf16(q.dtype), num_warps=4, num_stages=1,
    )  # fmt: skip
    return delta


def bwd_dkdv(
    qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, scale: float,
    cfg: C.BwdConfig, *, window: tuple[int, int] | None = None, softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None, varlen: Varlen | None = None,
) -> None:  # fmt: skip
    """The dK/dV kernel into ``dk``, ``dv``; ``qs`` as :func:`bwd_preprocess` left it (``lse``,
    ``delta`` dense ``(B, Hq, Nq)``)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (qs, do), cfg.kv_block_m, d)
    extra, flags = _bwd_args(qs, k, causal, window, softcap, seqlens_k, varlen, lse)
    rows, seqs = (varlen[3], varlen[0].shape[0] - 1) if varlen is not None else (nk, b)
    kernel = _backend.launcher(KB._attention_bwd_dkdv_kernel)
    kernel[(C.cdiv(rows, cfg.kv_block_n), seqs * hkv)](
        srcs[0], k, v, srcs[1], lse, delta, dk, dv, *qs.stride(), *k.stride(), *v.stride(),
        *do.stride(), *dk.stride(), *dv.stride(), hq, hkv, hq // hkv, nq, nk, scale, *extra,
        USE_DESC=use_desc, **flags, **cfg.dkdv(),
    )  # fmt: skip


def _tile_sources(
    want: bool, tensors: tuple[torch.Tensor, ...], rows: int, head_dim: int
) -> tuple[tuple[torch.Tensor | TensorDescriptor, ...], bool]:
    """``(sources, use_desc)``: 4-D TMA descriptors over the ``(B, H, N, D)`` tensors with
    ``[1, 1, rows, BLOCK_D]`` blocks when ``want`` and the tensors allow it (always in the
    interpreter), else the tensors themselves."""
    if not want or not (_backend.kernels_interpreted() or _descriptor_ok(*tensors)):
        return tensors, False
    block = [1, 1, rows, C.block_d(head_dim)]
    descs = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in tensors)
    return descs, True


def bwd_dq(
    qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dq: torch.Tensor, causal: bool, scale: float, cfg: C.BwdConfig, *,
    window: tuple[int, int] | None = None, softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None, varlen: Varlen | None = None,
) -> None:  # fmt: skip
    """The dQ kernel into ``dq``; ``qs`` as :func:`bwd_preprocess` left it, possibly ``dq``
    itself (``lse``, ``delta`` dense ``(B, Hq, Nq)``)."""
    b, hq, nq, d = qs.shape
    hkv, nk = k.shape[1], k.shape[2]
    srcs, use_desc = _tile_sources(cfg.use_desc and varlen is None, (k, v), cfg.q_block_n, d)
    extra, flags = _bwd_args(qs, k, causal, window, softcap, seqlens_k, varlen, lse)
    rows, seqs = (varlen[2], varlen[0].shape[0] - 1) if varlen is not None else (nq, b)
    kernel = _backend.launcher(KB._attention_bwd_dq_kernel)
    kernel[(C.cdiv(rows, cfg.q_block_m), seqs * hq)](
        qs, *srcs, do, lse, delta, dq, *qs.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dq.stride(), hq, hq // hkv, nq, nk, scale, *extra, USE_DESC=use_desc, **flags,
        **cfg.dq(),
    )  # fmt: skip


def _attention_bwd_body(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_bwd_grads(do, o, lse, dlse)
    window, cap = _op_extras(window_left, window_right, softcap)
    varlen = _op_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attention_bwd(do, q, k, v, o, lse, dlse, causal, scale, window=window, softcap=cap,
                         seqlens_k=seqlens_k, varlen=varlen)  # fmt: skip


_attention_bwd_op = torch.library.custom_op("flashlite::attention_bwd", mutates_args=())(
    _attention_bwd_body
)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, window_left=-1, window_right=-1, softcap=0.0,  # type: ignore[no-untyped-def]
      seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
      max_seqlen_k=0):  # fmt: skip
    _check_bwd_grads(do, o, lse, dlse)
    return empty_output(q), empty_output(k), empty_output(v)


def _no_second_derivative(ctx, *grads):  # type: ignore[no-untyped-def]
    raise NotImplementedError(
        "flashlite.attention has no second derivative: its backward is a kernel without an "
        "autograd formula of its own (torch.autograd.grad(..., create_graph=True) through it "
        "cannot be differentiated again)"
    )


# (a registered formula that refuses: clearer than torch's "no autograd formula" for op authors)
_attention_bwd_op.register_autograd(_no_second_derivative,
                                    setup_context=lambda ctx, inputs, output: None)  # fmt: skip


def _check_bwd_grads(
    do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
) -> None:
    # autograd already matches shapes (and casts dtypes) for `out.backward(grad)`; this guards
    # direct calls of the op, whose kernels would otherwise read out of bounds
    if do.shape != o.shape or do.dtype != o.dtype:
        raise ValueError(
            f"attention_bwd: do must match the output O, {tuple(o.shape)} {o.dtype}; got "
            f"{tuple(do.shape)} {do.dtype}"
        )
    if dlse is not None and dlse.shape != lse.shape:
        raise ValueError(
            f"attention_bwd: dlse must match the LSE's shape {tuple(lse.shape)}; got "
            f"{tuple(dlse.shape)}"
        )


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, causal, scale, *extras = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)  # O(N) beyond the tensors: nothing N×N
    ctx.n_extras = len(extras)
    ctx.causal, ctx.scale, ctx.extras = causal, scale, extras[:8]  # (num_splits: forward only)


def _backward(ctx, grad_o, grad_lse, bwd=None):  # type: ignore[no-untyped-def]
    """The gradients of q, k, v through ``bwd`` (default: the op)."""
    q, k, v, o, lse = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = (bwd or _ATTENTION_BWD)(grad_o, q, k, v, o, lse, grad_lse, ctx.causal,
                                         ctx.scale, *ctx.extras)  # fmt: skip
    return dq, dk, dv, None, None, *(None for _ in range(ctx.n_extras))


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_ATTENTION_BWD = torch.ops.flashlite.attention_bwd.default
_ATTENTION_FWD = torch.ops.flashlite.attention_fwd.default


class AttentionFunction(torch.autograd.Function):
    """Eager autograd of attention around the ops' bodies: the same forward, saved tensors and
    backward as the custom op's autograd (``_setup_context``, ``_backward``), without the
    dispatcher's autograd wrapper and redispatch, which cost host time on every training call
    (felt at small shapes). Traced and observed calls take the op (:func:`plain_eager`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, *extras):  # type: ignore[no-untyped-def, override]
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None, as in the op
        o, lse = _attention_fwd_body(q, k, v, causal, scale, *extras)
        _setup_context(ctx, (q, k, v, causal, scale, *extras), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):  # type: ignore[no-untyped-def, override]
        # create_graph: the op, which refuses a second derivative; else its body
        bwd = _ATTENTION_BWD if torch.is_grad_enabled() else _attention_bwd_body
        return _backward(ctx, grad_o, grad_lse, bwd)


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, *extras: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``flashlite::attention_fwd`` with autograd: in an unobserved eager call
    (:func:`plain_eager`) through :class:`AttentionFunction`, else through the op."""
    if plain_eager(q, k, v):
        return AttentionFunction.apply(q, k, v, causal, scale, *extras)
    return _ATTENTION_FWD(q, k, v, causal, scale, *extras)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "b h n d",
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seqlens_k: torch.Tensor | None = None,
    num_splits: int | None = None,
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
        window: ``(left, right)`` sliding window aligned bottom-right like ``causal``: query i
            sees key j iff ``i + Nk − Nq − left <= j <= i + Nk − Nq + right``, −1 meaning
            unlimited (flash-attn's ``window_size``); ``(-1, 0)`` is causal, and with
            ``causal=True`` right becomes 0. Key tiles outside every row's window are skipped.
        softcap: scores ``s = scale·q·k`` become ``softcap·tanh(s/softcap)`` before masking
            and the softmax (Gemma 2); the LSE is of the capped scores.
        seqlens_k: int32 ``(B,)`` tensor on q's device: batch b has only its first
            ``seqlens_k[b]`` keys (a padded KV cache or batch); ``causal`` and ``window`` align
            to that length, and a length of 0 gives output 0 and LSE −inf. Keys past it get
            zero gradients. CPU tensors are checked to lie in ``[0, Nk]``; on a GPU (no host
            sync) values outside are clamped to it.
        num_splits: split the keys across this many programs per block of query rows and
            merge the partial results exactly (flash-decoding: few queries against many keys),
            the query heads of a GQA group packed into one tile. 1: no split, the plain
            forward kernel. None: on a GPU, when ``Nq·Hq/Hkv`` is at most 64 (decoding), the
            split that fills the GPU (:func:`splits_for`); otherwise no split.

    Returns:
        ``out`` in ``q``'s layout and dtype, or ``(out, lse)`` with ``lse`` fp32 ``(B, Hq, Nq)``.
        fp16/bf16 run on tensor cores with fp32 accumulation; fp32 uses three TF32 passes
        (``tf32x3``) on a GPU, about fp32 accuracy. D runs from 1 to 256. A custom op
        (``torch.ops.flashlite.attention_fwd``): ``torch.compile`` traces through it.

    Raises:
        TypeError: non-tensors, unsupported or mixed dtypes, a non-numeric scale or softcap,
            ``causal`` or ``return_lse`` not a bool, a window that is not a pair of ints, a
            seqlens_k that is not an int32 tensor.
        ValueError: wrong rank, mismatched batch/heads/lengths/head dims, unknown layout,
            mixed devices, a non-positive scale or softcap, a window bound below −1, a
            seqlens_k of the wrong shape or device (or, on CPU, values outside ``[0, Nk]``).
        NotImplementedError: head dim above 256.
    """
    sm_scale, qc, kc, vc = _check(q, k, v, layout, scale)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    splits = _decode_splits(qc, kc, _check_splits(num_splits))
    # the plain call passes five arguments: every default-valued one more is dispatcher host
    # time on every small call (issue 8's per-call cost)
    if window is None and softcap is None and seqlens_k is None and splits == 0:
        if skip_dispatcher(q, k, v):  # the op's own body, minus the dispatcher's host cost
            o, lse, _ = attention_fwd(qc, kc, vc, causal, sm_scale)
        else:
            o, lse = _attention_op(qc, kc, vc, causal, sm_scale)
    else:
        left, right = masks.window_bounds(window, causal)
        cap = check_softcap(softcap)
        lengths = _check_seqlens(seqlens_k, qc, kc)
        if skip_dispatcher(q, k, v):
            o, lse, _ = attention_fwd(qc, kc, vc, causal, sm_scale, window=(left, right),
                                      softcap=cap or None, seqlens_k=lengths,
                                      num_splits=splits)  # fmt: skip
        else:
            o, lse = _attention_op(qc, kc, vc, causal, sm_scale, left, right, cap, lengths, None,
                                   None, 0, 0, splits)  # fmt: skip
    if layout != "b h n d":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def _check_seqlens(seqlens_k: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``seqlens_k`` validated: an int32 ``(B,)`` tensor on q's device (values checked on CPU)."""
    if seqlens_k is None:
        return None
    if not isinstance(seqlens_k, torch.Tensor):
        raise TypeError(f"seqlens_k must be an int32 torch.Tensor, got {type(seqlens_k).__name__}")
    if seqlens_k.dtype != torch.int32:
        raise TypeError(f"seqlens_k must have dtype torch.int32, got {seqlens_k.dtype}")
    if seqlens_k.shape != (q.shape[0],):
        raise ValueError(
            f"seqlens_k must have shape (B,) = ({q.shape[0]},), got {tuple(seqlens_k.shape)}"
        )
    if seqlens_k.device != q.device:
        raise ValueError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    if seqlens_k.device.type == "cpu" and not torch.compiler.is_compiling():
        nk = k.shape[2]
        if bool(((seqlens_k < 0) | (seqlens_k > nk)).any()):
            raise ValueError(f"seqlens_k values must lie in [0, Nk = {nk}]: {seqlens_k.tolist()}")
    return seqlens_k.contiguous()


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (flash-attn's varlen convention),
    without padding: sequence b is rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` of q and
    ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])`` of k and v.

    Args:
        q: ``(total_q, Hq, D)``; k, v: ``(total_k, Hkv, D)``, ``Hq % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` offsets: start at 0, non-decreasing,
            last entry the packed length.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (at least the true maxima;
            the grid is sized by them).
        causal, scale, window, softcap: as :func:`attention`, per sequence (causal and window
            aligned bottom-right to each sequence's own lengths).
        return_lse: also return the fp32 LSE, ``(Hq, total_q)``.
        validate: check the values of the offsets (one host sync on a GPU; skipped inside
            ``torch.compile``). ``False`` skips it (no sync: CUDA graphs, training loops whose
            offsets are known good); the kernels clamp the offsets to the packed lengths, so
            bad ones give wrong rows, never reads or writes outside the tensors.

    Returns:
        ``out`` ``(total_q, Hq, D)`` (and the LSE). Differentiable in q, k, v (and through the
        LSE). Sequences of length 0 give nothing; a query that sees no key gives 0, LSE −inf.

    Raises:
        TypeError: non-tensors, wrong dtypes (cu_seqlens must be int32), flags that are not
            bools, as :func:`attention`.
        ValueError: shapes, devices; with ``validate``, cu_seqlens that do not start at 0,
            decrease or do not end at the packed length, max_seqlen below a sequence's length.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total, heads, head_dim), got {tuple(t.shape)}")
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("validate", validate)):
        check_flag(flag, name)
    # (1, H, total, D) views: one 'batch' in the layout the kernels read, no copy
    sm_scale, qc, kc, vc = _check(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), "b n h d", scale)
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, max_seqlen_q)
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, max_seqlen_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
        )
    if validate and not torch.compiler.is_compiling():
        _check_cu_values(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    left, right = masks.window_bounds(window, causal)
    cap = check_softcap(softcap)
    o, lse = _attention_op(qc, kc, vc, causal, sm_scale, left, right, cap, None, cu_q, cu_k,
                           int(max_seqlen_q), int(max_seqlen_k))  # fmt: skip
    o = o.transpose(1, 2).squeeze(0)
    return (o, lse.squeeze(0)) if return_lse else o


def _check_cu_seqlens(cu: object, name: str, q: torch.Tensor, max_seqlen: object) -> torch.Tensor:
    """``cu``'s type, shape and device checked: int32 ``(batch + 1,)`` on q's device."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}"
        )
    if cu.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"max_seqlen for {name} must be a non-negative int, got {max_seqlen!r}")
    return cu.contiguous()


def _check_cu_values(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int, max_k: int
) -> None:
    """Both offset tensors' values: from 0 to the packed length, never decreasing, no sequence
    longer than its max_seqlen (read back in one host sync)."""
    stats = []
    for cu in (cu_q, cu_k):
        lengths = cu[1:] - cu[:-1]
        stats += [cu[0], cu[-1], lengths.min(), lengths.max()]
    values = torch.stack(stats).tolist()
    for i, (name, cu, total, max_seqlen) in enumerate(
        (("cu_seqlens_q", cu_q, total_q, max_q), ("cu_seqlens_k", cu_k, total_k, max_k))
    ):
        first, last, shortest, longest = values[4 * i : 4 * i + 4]
        if first != 0 or last != total or shortest < 0:
            raise ValueError(
                f"{name} must start at 0, never decrease and end at the packed length {total}; "
                f"got {cu.tolist() if cu.numel() <= 16 else 'first ' + str(first)}"
            )
        if longest > max_seqlen:
            raise ValueError(
                f"max_seqlen ({max_seqlen}) is below the longest sequence of {name} ({longest})"
            )


def attention_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decoding against a KV cache (layout ``b n h d``), optionally paged: the query heads of a
    GQA group share one K/V read, the keys are split across programs (flash-decoding). Forward
    only.

    Args:
        q: ``(B, Nq, Hq, D)``, the new tokens' queries.
        k_cache, v_cache: ``(B, Ncap, Hkv, D)``, or with ``block_table`` a paged cache
            ``(num_pages, page_size, Hkv, D)``, page size a multiple of 16 from 16 to 256 or a
            multiple of 256 (flash-attn's pages: read as 256-key sub-pages, no copy). Any
            strides; expanded (stride-0) or otherwise overlapping caches are read, but refused
            when ``k_new`` is to be written into them.
        cache_seqlens: int32 ``(B,)``: keys already in the cache per batch (any stride).
        k_new, v_new: ``(B, Nnew, Hkv, D)``, written into the cache in place at
            ``cache_seqlens[b]`` before attending (both or neither).
        block_table: int32 ``(B, max_pages)``: batch b's key j lives in page
            ``block_table[b, j // page_size]`` (vLLM's convention; any strides).
        causal, scale, window, softcap: as :func:`attention`, aligned bottom-right to
            ``cache_seqlens[b] + Nnew`` keys (so with ``causal`` query i of Nq sees keys up to
            ``cache_seqlens[b] + Nnew − Nq + i``).
        num_splits: key chunks per block of query rows (None: one chunk per SM,
            :func:`splits_for`; 1 on CPU).
        return_lse: also return the fp32 LSE ``(B, Hq, Nq)``.
        validate: check the values of ``cache_seqlens`` and of the block table's pages in use
            before anything is written, which costs one host sync on a GPU. ``False`` skips it
            (no sync: CUDA graphs, tight decode loops); lengths are then clamped to the
            capacity and page ids to the pool, so bad values give wrong results but never a
            read or write outside the caches.

    Returns:
        ``out`` ``(B, Nq, Hq, D)`` (and the LSE). Forward only: with grad mode on, tensors
        that require grad are refused (use ``torch.no_grad()`` or ``.detach()``).

    Raises:
        TypeError: non-tensors, mixed or unsupported dtypes, index tensors that are not int32,
            flags that are not bools.
        ValueError: shapes, devices, an input that requires grad (grad mode on), ``k_new``
            with caches whose elements overlap (expanded, stride 0) or that are one tensor;
            with ``validate``, a negative ``cache_seqlens``, ``cache_seqlens + Nnew`` past the
            cache's capacity or a block-table entry outside ``[0, num_pages)`` among the pages
            in use. Every check comes before anything is written.
    """
    tensors = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    key = _kvcache_key(tensors, (causal, scale, window, softcap, num_splits, validate))
    plan = _checked_kvcache.get(key) if key is not None else None
    if plan is not None and skip_dispatcher(q, k_cache, v_cache):  # a kind of call seen before
        o, lse = plan(*tensors)
        return (o, lse) if return_lse else o
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: pass both or neither")
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("validate", validate)):
        check_flag(flag, name)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new)):  # fmt: skip
        if t is None:
            continue
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (b n h d), got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; q, the caches and k_new/v_new share "
                            "one of torch.float16, torch.bfloat16, torch.float32")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        _backend.check_device(t, name)
    bsz, nq, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")  # fmt: skip
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"the caches must be (.., .., Hkv, D={d}) with Hq={hq} a multiple of "
                         f"Hkv; got {tuple(k_cache.shape)}")  # fmt: skip
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim {d} is not supported: flashlite supports 1 to 256")
    for name, t, dims in (("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2)):
        if t is None:
            continue
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
        if t.dim() != dims or t.shape[0] != bsz or t.device != q.device:
            shape = "(B,)" if dims == 1 else "(B, max_pages)"
            raise ValueError(f"{name} must be a {shape} tensor with B={bsz} on {q.device}, "
                             f"got {tuple(t.shape)} on {t.device}")  # fmt: skip
    if block_table is None and k_cache.shape[0] != bsz:
        raise ValueError(f"k_cache must be (B={bsz}, Ncap, Hkv, D), got {tuple(k_cache.shape)}")
    if block_table is not None:
        _check_page_size(k_cache, v_cache)
    _check_forward_only(q, k_cache, v_cache, k_new, v_new)
    n_new = 0 if k_new is None else k_new.shape[1]
    if k_new is not None:
        want = (bsz, n_new, hkv, d)
        if k_new.shape != want or v_new.shape != want:  # type: ignore[union-attr]
            raise ValueError(f"k_new and v_new must be (B, Nnew, Hkv, D) = {want}, got "
                             f"{tuple(k_new.shape)} and {tuple(v_new.shape)}")  # type: ignore[union-attr]  # fmt: skip
        _check_writable(k_cache, v_cache)
    splits = _check_splits(num_splits) or 0
    left, right = masks.window_bounds(window, causal)
    cap = check_softcap(softcap)
    sm_scale = _check_scale(scale, d)
    args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, sm_scale,
            left, right, cap, splits, validate)  # fmt: skip
    if skip_dispatcher(q, k_cache, v_cache):  # the op's own body, minus the dispatcher
        plan = _kvcache_plan(args)
        if key is not None:  # these arguments passed every check above: next time, skip them
            _cache(_checked_kvcache, key, plan)
        o, lse = plan(*tensors)
    else:
        o, lse = torch.ops.flashlite.attention_kvcache.default(*args)
    return (o, lse) if return_lse else o


def _check_forward_only(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
) -> None:
    """:func:`attention_kvcache` records no autograd graph: refuse, with grad mode on, inputs
    that require grad (a backward would otherwise fail far from the call, or gradients go
    missing without a word)."""
    if not torch.is_grad_enabled():
        return
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new)):  # fmt: skip
        if t is not None and t.requires_grad:
            raise ValueError(
                f"attention_kvcache is forward-only (decoding: no gradient), but {name} requires "
                "grad with grad mode on; call it under torch.no_grad() or torch.inference_mode(), "
                f"or pass {name}.detach(); for a differentiable call use flashlite.attention "
                "(seqlens_k= for per-batch lengths)"
            )


def _check_page_size(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """A paged cache's page size: a multiple of 16 from 16 to 256, or a multiple of 256 whose
    pages can be read as 256-key sub-pages without a copy (:func:`_sub_pages`)."""
    slots = k_cache.shape[1]
    if 16 <= slots <= 256 and slots % 16 == 0:
        return
    if slots < 16 or slots % 256:
        raise ValueError(f"page size {slots}: must be a multiple of 16 from 16 to 256, or a "
                         "multiple of 256")  # fmt: skip
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[0] > 1 and t.stride(0) != slots * t.stride(1):
            raise ValueError(
                f"{name}: pages of {slots} keys are read as 256-key sub-pages, which needs each "
                f"page's keys evenly strided into the next page (stride(0) = page_size · "
                f"stride(1)); got strides {t.stride()}"
            )


def _sub_pages(cache: torch.Tensor, factor: int) -> torch.Tensor:
    """A paged cache ``(num_pages, factor·256, Hkv, D)`` as ``(num_pages·factor, 256, Hkv, D)``:
    a view (:func:`_check_page_size` checked the strides)."""
    n, slots, h, d = cache.shape
    return cache.unflatten(1, (factor, slots // factor)).view(n * factor, slots // factor, h, d)


def _sub_table(block_table: torch.Tensor, factor: int) -> torch.Tensor:
    """``block_table`` over pages of ``factor`` sub-pages: entry p becomes ``p·factor + j``,
    ``j < factor`` (entries outside the pool stay outside it: ``p < 0`` or ``p >= pages``)."""
    steps = torch.arange(factor, device=block_table.device, dtype=torch.int32)
    return (block_table[:, :, None] * factor + steps).flatten(1)


def _check_writable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The caches ``k_new``/``v_new`` are written into: no two elements of one cache may share
    memory, and the two caches may not be one tensor (torch's in-place ops refuse the same)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if overlapping(t):
            raise ValueError(
                f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) has elements that share "
                "memory (expanded or overlapping strides): k_new/v_new cannot be written into it; "
                "pass a cache of its own (.contiguous() or .clone())"
            )
    if torch.compiler.is_compiling():  # (a trace cannot compare data pointers)
        same = k_cache is v_cache
    else:
        same = k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride()
    if same:
        raise ValueError("k_cache and v_cache are the same memory: k_new and v_new would be "
                         "written over each other; pass two caches")  # fmt: skip


def _kvcache_key(tensors: tuple, options: tuple) -> tuple | None:
    """What :func:`attention_kvcache`'s checks read — each tensor's :func:`_meta` (plain
    ``torch.Tensor`` s only) and each option's type and value — or None where an option is not
    a plain value (those calls are checked every time), and None while tracing."""
    if torch.compiler.is_compiling():
        return None
    key: list = []
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.requires_grad):
            return None  # (a tensor that requires grad: refused, or not, by the checks each time)
        key.append(_meta(t))
    for x in options:
        kind = type(x)
        if kind is tuple:
            if not all(type(i) is int for i in x):
                return None
        elif kind not in (bool, int, float, type(None)):
            return None
        key.append((kind, x))
    return tuple(key)


#: :func:`attention_kvcache`'s plans by its own arguments (:func:`_kvcache_key`): a call that
#: matches passed every check before.
_checked_kvcache: dict[tuple, KVCachePlan] = {}


#: Largest page the decode kernel reads as one; bigger pages (multiples of it) are split.
MAX_PAGE = 256


class KVCachePlan:
    """:func:`_kvcache` for one kind of call (shapes, strides, dtypes and options): the value
    checks, the append and a :class:`DecodePlan` over the caches' ``b h n d`` views. Made from
    :func:`_kvcache`'s argument tuple (:data:`_TENSORS` tensors, then its options).

    The kernels index ``cache_seqlens`` and the block table's rows densely: other strides are
    made dense per call (``B`` or ``B·max_pages`` ints). Pages of more than :data:`MAX_PAGE`
    keys are read as that many sub-pages each (views of the caches, the table rewritten)."""

    def __init__(self, args: tuple) -> None:
        q, k_cache, v_cache, cache_seqlens, k_new, _, block_table = args[:_TENSORS]
        causal, scale, window_left, window_right, softcap, num_splits, validate = args[_TENSORS:]
        self.validate = validate
        self.slots, self.num_pages = k_cache.shape[1], k_cache.shape[0]
        self.capacity = block_table.shape[1] * self.slots if block_table is not None else self.slots
        self.n_new = 0 if k_new is None else k_new.shape[1]
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.dense_lengths = cache_seqlens.is_contiguous()
        self.dense_table = block_table is None or block_table.is_contiguous()
        paged = block_table is not None and self.slots > MAX_PAGE
        self.factor = self.slots // MAX_PAGE if paged else 1
        k_cache, v_cache, block_table = self._kernel_view(k_cache, v_cache, block_table)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.decode = DecodePlan(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
            o.transpose(1, 2), cache_seqlens.contiguous(), block_table, causal, scale,
            (window_left, window_right), softcap or None, num_splits or None, None, None,
        )  # fmt: skip

    def _kernel_view(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The caches and block table as the kernels read them: a dense table, and pages of at
        most :data:`MAX_PAGE` keys."""
        if not self.dense_table:
            block_table = block_table.contiguous()  # type: ignore[union-attr]
        if self.factor > 1:
            k_cache, v_cache = _sub_pages(k_cache, self.factor), _sub_pages(v_cache, self.factor)
            block_table = _sub_table(block_table, self.factor)  # type: ignore[arg-type]
        return k_cache, v_cache, block_table

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        block_table: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run on tensors of the planned kind: ``out`` ``(B, Nq, Hq, D)``, LSE ``(B, Hq, Nq)``."""
        if self.validate:  # every check that reads values, before anything is written (a sync)
            _check_cache_values(cache_seqlens, self.n_new, self.capacity, block_table,
                                self.slots, self.num_pages)  # fmt: skip
        if not self.dense_lengths:
            cache_seqlens = cache_seqlens.contiguous()
        if not self.dense_table or self.factor > 1:
            k_cache, v_cache, block_table = self._kernel_view(k_cache, v_cache, block_table)
        lengths = cache_seqlens
        if self.n_new:
            lengths = _append(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                              self.capacity)  # type: ignore[arg-type]  # fmt: skip
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.decode(q, k_cache, v_cache, lengths, block_table, o, lse)
        return o, lse


def _append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor | None,
    capacity: int,
) -> torch.Tensor:
    """Write ``k_new``/``v_new`` into the caches at ``cache_seqlens[b]``; the new lengths."""
    bsz, n_new, slots = k_new.shape[0], k_new.shape[1], k_cache.shape[1]
    # (clamped: without validation a bad length must still stay inside the cache)
    pos = (cache_seqlens.long()[:, None] + torch.arange(n_new, device=k_new.device)[None, :]
           ).clamp(0, capacity - 1)  # fmt: skip
    if block_table is None:
        rows = torch.arange(bsz, device=k_new.device)[:, None].expand_as(pos)
        k_cache[rows, pos] = k_new
        v_cache[rows, pos] = v_new
    else:
        pages = block_table.long().clamp(0, k_cache.shape[0] - 1)
        page = torch.gather(pages, 1, pos // slots)
        k_cache[page, pos % slots] = k_new
        v_cache[page, pos % slots] = v_new
    return (cache_seqlens + n_new).to(torch.int32)


#: :class:`KVCachePlan` per kind of :func:`_kvcache` call.
_kvcache_plans: dict[tuple, KVCachePlan] = {}


#: The tensors that lead :func:`_kvcache`'s arguments (q, the caches, lengths, new keys and
#: values, the block table); the options follow.
_TENSORS = 7


def _kvcache_plan(args: tuple) -> KVCachePlan:
    """The :class:`KVCachePlan` of :func:`_kvcache`'s (checked) arguments, made on first use."""
    key = (*map(_meta, args[:_TENSORS]), *args[_TENSORS:])
    return _planned(_kvcache_plans, key, lambda: KVCachePlan(args))


def _kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    block_table: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_kvcache` after its argument checks: the value checks, the append, the
    decode kernel (:class:`KVCachePlan`). ``num_splits`` 0 chooses; ``softcap`` 0.0 is none."""
    args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale,
            window_left, window_right, softcap, num_splits, validate)  # fmt: skip
    return _kvcache_plan(args)(*args[:_TENSORS])


#: ``flashlite::attention_kvcache``: :func:`_kvcache` as a custom op that declares the caches
#: written (the append), so ``torch.compile`` traces a decode step through it.
_attention_kvcache_op = torch.library.custom_op(
    "flashlite::attention_kvcache", mutates_args=("k_cache", "v_cache")
)(_kvcache)


@_attention_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale,  # type: ignore[no-untyped-def]
      window_left, window_right, softcap, num_splits, validate):  # fmt: skip
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                            dtype=torch.float32)  # fmt: skip


def _check_cache_values(
    cache_seqlens: torch.Tensor,
    n_new: int,
    capacity: int,
    block_table: torch.Tensor | None,
    page_size: int,
    num_pages: int,
) -> None:
    """:func:`attention_kvcache`'s value checks, read back in one host sync (a second one only
    to quote the offending values)."""
    lengths = cache_seqlens.long() + n_new
    negative = (cache_seqlens < 0).any()
    too_long = (lengths > capacity).any()
    bad_page = torch.zeros_like(negative)
    if block_table is not None:
        pages = torch.arange(block_table.shape[1], device=lengths.device)
        used = pages[None, :] < (-(-lengths.clamp(min=0) // page_size))[:, None]
        bad_page = (used & ((block_table < 0) | (block_table >= num_pages))).any()
    is_negative, is_too_long, page_wrong = torch.stack([negative, too_long, bad_page]).tolist()
    if is_negative or is_too_long:
        where = cache_seqlens < 0 if is_negative else lengths > capacity
        b = int(where.nonzero()[0, 0])
        value = int(cache_seqlens[b])
        if is_negative:
            raise ValueError(f"cache_seqlens must be >= 0 (keys already in the cache); got "
                             f"cache_seqlens[{b}] = {value}")  # fmt: skip
        raise ValueError(
            f"cache_seqlens + Nnew must be at most {capacity} (the cache's capacity); got "
            f"cache_seqlens[{b}] = {value}, Nnew = {n_new}"
        )
    if page_wrong:
        bad = used & ((block_table < 0) | (block_table >= num_pages))  # type: ignore[operator]
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table holds pages outside [0, {num_pages}) among the pages "
                         f"in use: block_table[{b}, {j}] = {int(block_table[b, j])}")  # type: ignore[index]  # fmt: skip


def _decode_splits(q: torch.Tensor, k: torch.Tensor, num_splits: int | None) -> int:
    """The op's ``num_splits`` for :func:`attention`'s: 0 runs the forward kernel, n >= 1 the
    decode kernel with n key chunks. ``None`` takes the decode kernel on a GPU when the packed
    query rows per KV head (``Nq·Hq/Hkv``) fit one of its tiles, with the chunks that fill the
    GPU; ``1`` never splits."""
    if num_splits is not None:
        return 0 if num_splits == 1 else num_splits
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = nq * (hq // hkv)
    if rows > DECODE_MAX_ROWS or q.device.type != "cuda" or _backend.kernels_interpreted():
        return 0
    block_m = C.decode_config(rows, False, b * hkv, C.block_d(q.shape[3]), q.element_size()).block_m
    return _default_splits(q.device, b * hkv, rows, nk, block_m)


#: :func:`attention` runs the decode kernel by itself up to this many packed rows (one tile).
DECODE_MAX_ROWS = 64


def _check_splits(num_splits: object) -> int | None:
    """``num_splits`` checked: None (choose) or an int >= 1."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    return num_splits
