"""What the attention, softmax, decode and cross-entropy models share: GPU tables, the L2
estimate, and the attention configs the models count with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashlite.ops import attention as attention_ops
from flashlite.ops.attention import Config, block_d, keep_config
from flashlite.traffic.shapes import (
    AttentionShape,
    make_inputs,
)


@dataclass(frozen=True)
class Gpu:
    """What the DRAM estimate needs of a GPU."""

    sms: int
    l2_bytes: int
    smem_per_sm: int = 228 * 1024


#: The GPU tables ``--gpu`` names: the H200 (132 SMs, 60 MiB L2) and a generic GPU of the A100's
#: size (108 SMs, 40 MiB L2).
GPUS = {"h200": Gpu(132, 60 * 2**20), "generic": Gpu(108, 40 * 2**20, 164 * 1024)}
#: L2 assumed where no GPU says (the H200's)
DEFAULT_L2_BYTES = GPUS["h200"].l2_bytes


def attention_dims(shape: AttentionShape) -> tuple[int, int, int, int, int]:
    return shape.batch, shape.heads, shape.seq_q, shape.nk, shape.head_dim


def config_name(cfg: Config) -> str:
    """``BMxBNxWARPSxSTAGES`` plus the loop variants that are on, e.g. ``64x64x4x2+overlap``."""
    flags = [n for n in ("warp_specialize", "lazy_rescale", "overlap") if getattr(cfg, n)]
    return "x".join(map(str, cfg[:4])) + "".join(f"+{f.split('_')[0]}" for f in flags)


def parse_config(text: str, head_dim: int, dtype: torch.dtype) -> Config:
    """``BMxBN[xWARPSxSTAGES]`` (e.g. ``64x64`` or ``128x64x4x3``) as a config that fits the head
    dim; ``ValueError`` naming the accepted values otherwise."""
    try:
        fields = [int(f) for f in text.lower().split("x")]
    except ValueError:
        fields = []
    if len(fields) not in (2, 4):
        raise ValueError(f"config={text!r}: expected BMxBN or BMxBNxWARPSxSTAGES, e.g. 64x64x4x2")
    bm, bn, warps, stages = (*fields, 4, 2) if len(fields) == 2 else fields
    tiles, warp_counts = (16, 32, 64, 128, 256), (1, 2, 4, 8, 16)
    if bm not in tiles or bn not in tiles:
        raise ValueError(f"config={text!r}: BM and BN must be powers of two in {tiles}")
    if warps not in warp_counts or stages < 1:
        raise ValueError(f"config={text!r}: warps must be one of {warp_counts}, stages >= 1")
    cfg = Config(bm, bn, warps, stages)
    if not keep_config(cfg, block_d(head_dim), dtype.itemsize, False):
        raise ValueError(
            f"config={text!r} does not fit head dim {head_dim} ({dtype}): the tiles must fit "
            "shared memory and registers (try smaller BM/BN or more warps, e.g. 64x64x4x2)"
        )
    return cfg


def counted_config(
    shape: AttentionShape, *, gpu: str = "h200", config: Config | None = None
) -> tuple[Config, bool]:
    """The config flashlite is counted and modelled with (``config``, else what the ``gpu``
    table runs for the shape) and whether that GPU loads through tensor descriptors."""
    cfg, desc = attention_ops.gpu_config(attention_dims(shape), shape.dtype, shape.causal, gpu)
    return config or cfg, desc


def flashlite_config(
    shape: AttentionShape, device: str = "cpu", *, gpu: str = "h200", config: Config | None = None
) -> dict[str, Any]:
    """The launch config flashlite's attention kernel uses for ``shape``.

    Counting and modelling (``device="cpu"``): the config the ``gpu`` table runs for the shape
    (:func:`flashlite.ops.attention.gpu_config`), or ``config``; the interpreter runs any tile.
    CUDA: one call of the host launcher, which reports what it ran (autotuning once if needed).
    """
    if not device.startswith("cuda"):
        cfg, desc = counted_config(shape, gpu=gpu, config=config)
        return {
            **cfg.constexprs(),
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            "USE_DESC": desc,
            "gpu": gpu,
            "config": config_name(cfg),
        }
    q, k, v = make_inputs(shape, device)
    _, _, info = attention_ops.attention_fwd(
        q, k, v, attention_ops.Request.of_mask(shape.mask, shape.head_dim**-0.5)
    )
    if info is None:  # empty problem: nothing launched
        return {"BLOCK_M": 1, "BLOCK_N": 1}
    cfg = info.config
    return {
        **cfg.constexprs(),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "USE_DESC": info.use_desc,
        "gpu": device,
        "config": config_name(cfg),
    }


# =============================================================================== DRAM estimate
#: The share of L2 that holds a kernel's working set, fitted to the H200 measurements in
#: ``benchmarks/results/traffic-nvidia-h200.json`` (docs/how-it-works/hbm-traffic.md): the dirty
#: bytes left in L2 when a streaming kernel ends, and the working set past which K/V tiles miss,
#: both behave as if about 0.65 of the 60 MiB were available (the rest holds lines of the other
#: partition).
L2_EFFECTIVE = 0.65


def effective_l2(gpu: str, l2_bytes: int | None) -> int:
    if l2_bytes is not None and l2_bytes <= 0:
        raise ValueError(f"l2_bytes={l2_bytes}: the L2 size must be positive")
    return int(L2_EFFECTIVE * (l2_bytes if l2_bytes is not None else GPUS[gpu].l2_bytes))


def written_back(read: int, write: int, l2: int) -> int:
    """DRAM writes of one kernel that starts with a cold L2, as ncu counts them: dirty lines are
    written back only when evicted during the kernel. A kernel whose reads and writes fit in L2
    writes nothing back; a larger one keeps ``l2·write/(read + write)`` dirty bytes (LRU mixes
    its reads and writes in proportion) and writes the rest."""
    if read + write <= l2:
        return 0
    return write - (l2 * write) // (read + write)
