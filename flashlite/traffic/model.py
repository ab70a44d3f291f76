"""Closed-form bytes: what no implementation can avoid, and what each one issues.

For the naive reference the model is the sum over the ops :func:`flashlite.reference.attention`
runs, each reading its inputs once and writing its output once. For flashlite it is what the
kernel issues: Q once, K and V once per query block (only the tiles with a visible key when
causal), O and LSE once — counting only unmasked lanes of partial tiles, with the block sizes the
kernel really used. The softmax models count the passes each kernel makes over x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from flashlite import masks
from flashlite.kernels import configs, softmax_gluon
from flashlite.kernels import softmax as softmax_kernels
from flashlite.kernels.configs import BwdConfig, Config, bwd_config, keep_config
from flashlite.ops import attention as attention_ops
from flashlite.ops import softmax as softmax_ops
from flashlite.traffic.shapes import (
    ATTENTION_METHODS,
    SOFTMAX_ALGORITHMS,
    SOFTMAX_GPU_ALGORITHMS,
    AttentionShape,
    Traffic,
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


def compulsory_attention(shape: AttentionShape) -> Traffic:
    """Bytes no attention implementation can avoid: Q, K, V read once and O written once."""
    b, t = shape.itemsize, Traffic()
    q = shape.batch * shape.heads * shape.seq_q * shape.head_dim * b
    kv = shape.batch * shape.hkv * shape.nk * shape.head_dim * b
    t.add("q", q, 0)
    t.add("k", kv, 0)
    t.add("v", kv, 0)
    t.add("o", 0, q)
    return t


def model_naive_attention(shape: AttentionShape, *, return_lse: bool = False) -> Traffic:
    """Bytes of :func:`flashlite.reference.attention` (``upcast=False``), op by op.

    Each op reads its tensor inputs once and writes its output once. With ``S`` the
    ``B·H·Nq·Nk`` score elements, ``b`` the element size and ``G = H / Hkv``:

    ==============  ===============================  ==============================
    op              read                             write
    ==============  ===============================  ==============================
    expand K, V     ``B·Hkv·Nk·D·b`` each (G > 1)    ``B·H·Nk·D·b`` each
    S = Q Kᵀ        ``Q + K'``                       ``S·b``
    S·scale         ``S·b``                          ``S·b``
    causal mask     int64 aranges (tiny)             ``Nq·Nk`` bools (+ tiny)
    where (mask)    ``S·b + Nq·Nk``                  ``S·b``
    softmax         ``S·b``                          ``S·b``
    nan_to_num      ``S·b`` (causal only)            ``S·b``
    O = P V         ``S·b + V'``                     ``O``
    ==============  ===============================  ==============================

    ``K' = K`` without GQA; with GQA ``torch.matmul`` broadcasts K and V over the group and its
    reshape of the broadcast view copies them (unless ``B·Hkv = 1``, where it stays a view), so
    the matmuls read the ``G``-fold copies.
    """
    b = shape.itemsize
    B, H, Hkv, Nq, Nk, D = (
        shape.batch,
        shape.heads,
        shape.hkv,
        shape.seq_q,
        shape.nk,
        shape.head_dim,
    )
    q = B * H * Nq * D * b
    kv = B * Hkv * Nk * D * b
    s = B * H * Nq * Nk * b
    t = Traffic()
    kv_read = kv
    # torch.matmul folds (B, Hkv, G) into one batch dim; with a broadcast G that is a view only
    # when B·Hkv == 1, otherwise its reshape copies K and V G-fold first
    if Hkv != H and B * Hkv > 1:
        kv_read = kv * (H // Hkv)
        t.add("expand k", kv, kv_read)
        t.add("expand v", kv, kv_read)
    t.add("S = Q K^T", q + kv_read, s)
    t.add("S * scale", s, s)
    if shape.causal:
        i64 = 8
        # arange(Nq), arange(Nk), i + (Nk - Nq), j > i + (Nk - Nq)
        t.add("causal mask", i64 * (Nq + Nk + Nq), i64 * (Nq + Nk + Nq) + Nq * Nk)
        t.add("where (mask)", s + Nq * Nk, s)
    t.add("softmax", s, s)
    if shape.causal:
        t.add("nan_to_num", s, s)
    t.add("O = P V", s + kv_read, q)
    if return_lse:
        s32 = B * H * Nq * Nk * 4
        if b != 4:
            t.add("S.float()", s, s32)
        t.add("logsumexp", s32, B * H * Nq * 4)
    return t


def model_flashlite_attention(
    shape: AttentionShape, block_m: int | None = None, block_n: int | None = None
) -> Traffic:
    """Bytes the flashlite forward kernel issues, with its real ``BLOCK_M × BLOCK_N`` tiles.

    One program per (query block, batch·head): Q block loaded once, then K and V tiles of
    ``BLOCK_N`` keys — all ``⌈Nk/BLOCK_N⌉`` tiles, or when causal the tiles up to the last key the
    block's last row sees — then O and the fp32 LSE stored once. Lanes past ``Nq`` / ``Nk`` are
    masked and not counted, so for ``n_m = ⌈Nq/BLOCK_M⌉`` query blocks::

        read  = B·H·(Nq·D·b + 2·D·b·Σ_blocks keys_loaded(block))
        write = B·H·Nq·(D·b + 4)

    with ``keys_loaded = Nk`` without a mask and ``min(Nk, BLOCK_N·⌈vis/BLOCK_N⌉)`` causal, ``vis``
    the keys visible to the block's last row. Each query head reads its KV head's tiles itself,
    so GQA does not reduce the K/V term (only the compulsory bytes).
    """
    if block_m is None or block_n is None:
        cfg = flashlite_config(shape)
        block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    b = shape.itemsize
    B, H, Nq, Nk, D = shape.batch, shape.heads, shape.seq_q, shape.nk, shape.head_dim
    keys = 0
    for m0 in range(0, Nq, block_m):
        # the kernel's own key range: tiles [0, hi) step BLOCK_N, lanes past Nk masked
        hi = masks.torch_key_range(m0, block_m, block_n, Nq, Nk, shape.causal)[3]
        keys += min(Nk, block_n * triton.cdiv(hi, block_n))
    bh = B * H
    t = Traffic()
    t.add("q", bh * Nq * D * b, 0)
    t.add("k", bh * keys * D * b, 0)
    t.add("v", bh * keys * D * b, 0)
    t.add("o", 0, bh * Nq * D * b)
    t.add("lse", 0, bh * Nq * 4)
    return t


def _dims(shape: AttentionShape) -> tuple[int, int, int, int, int]:
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
    block_d = configs.block_d(head_dim)
    if not keep_config(cfg, block_d, dtype.itemsize, False):
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
    cfg, desc = attention_ops.gpu_config(_dims(shape), shape.dtype, shape.causal, gpu)
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
        return {**cfg.constexprs(), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                "USE_DESC": desc, "gpu": gpu, "config": config_name(cfg)}  # fmt: skip
    q, k, v = make_inputs(shape, device)
    _, _, info = attention_ops.attention_fwd(q, k, v, shape.causal, shape.head_dim**-0.5)
    if info is None:  # empty problem: nothing launched
        return {"BLOCK_M": 1, "BLOCK_N": 1}
    cfg = info.config
    return {**cfg.constexprs(), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "USE_DESC": info.use_desc, "gpu": device, "config": config_name(cfg)}  # fmt: skip


def model_attention(method: str, shape: AttentionShape, **config: int) -> Traffic | None:
    """Model bytes of ``method`` (``naive`` or ``flashlite``); None for the sdpa-* methods."""
    if method == "naive":
        return model_naive_attention(shape)
    if method == "flashlite":
        return model_flashlite_attention(shape, config.get("BLOCK_M"), config.get("BLOCK_N"))
    if method in ATTENTION_METHODS:
        return None
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def resolve_softmax_algorithm(algorithm: str, n: int, elem_bytes: int) -> str:
    """The softmax kernel ``algorithm`` names for rows of ``n`` elements of ``elem_bytes``."""
    # the front-end's own "auto" decision, as a CPU takes it: one read when the row fits on
    # chip, split otherwise (a GPU runs long rows with the prefetch or team kernel: one read each)
    if algorithm == "auto":
        return softmax_ops.softmax_kernel_for(n, elem_bytes, torch.device("cpu"))
    if algorithm not in SOFTMAX_ALGORITHMS + SOFTMAX_GPU_ALGORITHMS:
        accepted = ", ".join(("auto", *SOFTMAX_ALGORITHMS, *SOFTMAX_GPU_ALGORITHMS))
        raise ValueError(f"algorithm={algorithm!r} is not one of {accepted}")
    return algorithm


def compulsory_softmax(rows: int, n: int, dtype: torch.dtype) -> Traffic:
    """Read x once and write y once: ``rows·n·b`` each way."""
    b = torch.empty((), dtype=dtype).element_size()
    t = Traffic()
    t.add("x", rows * n * b, 0)
    t.add("y", 0, rows * n * b)
    return t


def model_softmax(rows: int, n: int, dtype: torch.dtype, algorithm: str = "auto") -> Traffic:
    """Bytes the softmax forward kernels issue for ``(rows, n)`` (softmax and log_softmax alike).

    With ``E = rows·n·b``: three_pass ``3E`` read + ``E`` write, online ``2E + E``, single_read
    ``E + E``, split ``2E + E`` plus the workspace: ``C = ⌈n/chunk⌉`` fp32 (m, s) pairs per row,
    written once by the stats kernel (``8·rows·C``) and read by each of the row's ``C`` write
    programs, which all repeat the C-way merge (``8·rows·C²``). team (GPU, what ``auto`` runs
    for long rows there) ``E + E`` plus the same workspace with its own chunk count and the
    zeroed per-row arrival counters (``4·rows``); the spin-wait atomics stay in L2 and are not
    modelled. prefetch (GPU with Gluon: what ``auto`` runs there for long rows) ``E + E``
    plus one 8-byte word per (row, chunk): filled with −1 and then published once
    (``8·rows·C`` each), read by each of the row's ``C`` programs (``8·rows·C²``, spin
    re-reads not modelled).
    """
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    algorithm = resolve_softmax_algorithm(algorithm, n, elem_bytes)
    e = rows * n * elem_bytes
    t = Traffic()
    passes = {"three_pass": 3, "online": 2, "single_read": 1, "split": 2, "team": 1,
              "prefetch": 1}[algorithm]  # fmt: skip
    t.add("x", passes * e, 0)
    t.add("y", 0, e)
    if algorithm == "split":
        chunks = softmax_kernels.split_config(n)["n_chunks"]
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
    elif algorithm == "team":
        chunks = softmax_kernels.team_config(n, elem_bytes)["n_chunks"]
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
        t.add("counters", 0, 4 * rows)
    elif algorithm == "prefetch":
        chunks = softmax_gluon.prefetch_config(n, elem_bytes)["n_chunks"]
        t.add("workspace", 8 * rows * chunks * chunks, 2 * 8 * rows * chunks)
    return t


def l2_note(shape: AttentionShape, l2_bytes: int | None = None) -> str | None:
    """A warning when the call's data fits in L2, where DRAM counters understate traffic."""
    if l2_bytes is None:
        l2_bytes = DEFAULT_L2_BYTES
        if torch.cuda.is_available():
            l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    data = compulsory_attention(shape).total
    if data <= l2_bytes:
        return (
            f"Q, K, V and O ({data / 1e6:.1f} MB) fit in L2 ({l2_bytes / 1e6:.0f} MB): "
            "measured DRAM bytes are misleading for this shape (writes can stay in L2, "
            "re-reads hit it)"
        )
    return None


# =============================================================================== DRAM estimate
#: The share of L2 that holds a kernel's working set, fitted to the H200 measurements in
#: ``benchmarks/results/traffic-nvidia-h200.json`` (docs/hbm-traffic.md): the dirty bytes left in
#: L2 when a streaming kernel ends, and the working set past which K/V tiles miss, both behave as
#: if about 0.65 of the 60 MiB were available (the rest holds lines of the other partition).
L2_EFFECTIVE = 0.65


def _l2(gpu: str, l2_bytes: int | None) -> int:
    if l2_bytes is not None and l2_bytes <= 0:
        raise ValueError(f"l2_bytes={l2_bytes}: the L2 size must be positive")
    return int(L2_EFFECTIVE * (l2_bytes if l2_bytes is not None else GPUS[gpu].l2_bytes))


def _written_back(read: int, write: int, l2: int) -> int:
    """DRAM writes of one kernel that starts with a cold L2, as ncu counts them: dirty lines are
    written back only when evicted during the kernel. A kernel whose reads and writes fit in L2
    writes nothing back; a larger one keeps ``l2·write/(read + write)`` dirty bytes (LRU mixes
    its reads and writes in proportion) and writes the rest."""
    if read + write <= l2:
        return 0
    return write - (l2 * write) // (read + write)


def dram_naive_attention(
    shape: AttentionShape, *, gpu: str = "h200", l2_bytes: int | None = None
) -> Traffic:
    """DRAM bytes of naive attention: each op of :func:`model_naive_attention` is one kernel that
    reads its inputs once from a cold L2 and writes back what does not stay dirty in L2."""
    l2 = _l2(gpu, l2_bytes)
    t = Traffic()
    for name, (read, write) in model_naive_attention(shape).parts.items():
        t.add(name, read, _written_back(read, write, l2))
    return t


def dram_flashlite_attention(
    shape: AttentionShape,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    num_warps: int = 4,
    num_stages: int = 2,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> Traffic:
    """DRAM bytes of the flashlite kernel, one launch from a cold L2.

    The grid runs the query blocks of one head next to each other (axis 0 is the block), and
    the ``P`` programs in flight (SMs × programs per SM, from the tile's shared memory and warps)
    start together and sweep the same K/V tiles at about the same pace, so within a wave every
    re-read of a tile hits L2. A head's ``n_m = ⌈Nq / BLOCK_M⌉`` query blocks take
    ``⌈n_m / P⌉`` waves; a later wave re-reads the head's K/V from L2 if the K/V of the heads in
    flight (``⌈P / n_m⌉`` heads, ``⌈that / G⌉`` K/V heads with GQA groups of ``G``) fit in L2
    beside the programs' Q and O tiles, else from DRAM once more per wave. Q is read once; O and
    the LSE are written back as :func:`_written_back` says.
    """
    if block_m is None or block_n is None:
        cfg = flashlite_config(shape, gpu=gpu)
        block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
        num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    issued = model_flashlite_attention(shape, block_m, block_n)
    device, l2 = GPUS[gpu], _l2(gpu, l2_bytes)
    smem = configs.smem_bytes(Config(block_m, block_n, num_warps, num_stages),
                              configs.block_d(shape.head_dim), shape.itemsize)  # fmt: skip
    b = shape.itemsize
    per_sm = max(1, min(device.smem_per_sm // max(smem, 1), 64 // num_warps))
    programs = device.sms * per_sm
    n_m = triton.cdiv(shape.seq_q, block_m)
    heads = min(shape.batch * shape.heads, triton.cdiv(programs, n_m))
    kv_heads = triton.cdiv(heads, shape.heads // shape.hkv)
    working_set = kv_heads * 2 * shape.nk * shape.head_dim * b
    working_set += programs * 2 * block_m * shape.head_dim * b  # Q and O tiles in flight
    waves = 1 if working_set <= l2 else triton.cdiv(n_m, programs)
    comp = compulsory_attention(shape)
    t = Traffic(info={"programs_in_flight": programs, "kv_working_set": working_set,
                      "kv_reads_per_head": waves})  # fmt: skip
    t.add("q", issued.parts["q"][0], 0)
    for name in ("k", "v"):  # never more than the kernel issues
        t.add(name, min(waves * comp.parts[name][0], issued.parts[name][0]), 0)
    write = issued.parts["o"][1] + issued.parts["lse"][1]
    t.add("o + lse", 0, _written_back(t.read, write, l2))
    return t


def dram_flashlite_attention_bwd(
    shape: AttentionShape,
    *,
    with_lse_grad: bool = False,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> Traffic:
    """DRAM bytes of the three backward kernels, each from a cold L2 (as ncu measures them).

    Each kernel reads every operand it issues once from DRAM: the dK/dV programs of a K/V head
    sweep its query rows (Qs, dO, LSE, delta) together and the dQ programs its K/V, so, as in the
    forward's first wave, the re-reads hit L2 (true at the measured sizes: a K/V head's working
    set of one wave is a few MB). Writes as :func:`_written_back`. With ``b`` the element size:
    preprocess reads O, dO (and Q for 16-bit inputs) and writes delta (and Qs); dK/dV reads K, V
    once and Qs, dO, LSE, delta once per query head; dQ the same; they write dK, dV and dQ.
    """
    l2 = _l2(gpu, l2_bytes)
    issued = model_flashlite_attention_bwd(shape, with_lse_grad=with_lse_grad)
    b, D = shape.itemsize, shape.head_dim
    rows, kv = shape.batch * shape.heads * shape.seq_q, shape.batch * shape.hkv * shape.nk
    per_query = rows * (2 * D * b + 8)  # Qs (or Q), dO, LSE, delta
    t = Traffic()
    pre_r = sum(issued.parts[k][0] for k in issued.parts if k.startswith("preprocess"))
    pre_w = sum(issued.parts[k][1] for k in issued.parts if k.startswith("preprocess"))
    for name, read, write in (
        ("preprocess", pre_r, pre_w),
        ("dk/dv", 2 * kv * D * b + per_query, 2 * kv * D * b),
        ("dq", 2 * kv * D * b + per_query, rows * D * b),
    ):
        t.add(name, read, _written_back(read, write, l2))
    return t


def dram_attention(
    method: str, shape: AttentionShape, *, gpu: str = "h200", l2_bytes: int | None = None,
    **config: Any,
) -> Traffic | None:  # fmt: skip
    """DRAM estimate of ``method`` (``naive`` or ``flashlite``); None for the sdpa-* methods."""
    if method == "naive":
        return dram_naive_attention(shape, gpu=gpu, l2_bytes=l2_bytes)
    if method == "flashlite":
        extra = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
        return dram_flashlite_attention(shape, config.get("BLOCK_M"), config.get("BLOCK_N"),
                                        gpu=gpu, l2_bytes=l2_bytes, **extra)  # fmt: skip
    if method in ATTENTION_METHODS:
        return None
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def dram_softmax(
    rows: int,
    n: int,
    dtype: torch.dtype,
    algorithm: str = "auto",
    *,
    gpu: str = "h200",
    l2_bytes: int | None = None,
) -> Traffic:
    """DRAM bytes of the softmax forward for a contiguous ``(rows, n)`` input, each kernel from a
    cold L2 (as ncu measures it).

    single_read, team and prefetch read x once whatever the L2. three_pass and online re-read
    each row (two more passes, one more): the ``P`` rows in flight (one per program; SMs ×
    programs per SM from the kernel's warps) stay in L2 between the passes when ``P·n·b`` fits
    in the effective L2, so x comes from DRAM once; otherwise every pass reads it again. split
    runs two kernels, and the second starts cold: x is read twice. Writes as
    :func:`_written_back`.
    """
    l2 = _l2(gpu, l2_bytes)
    b = dtype.itemsize
    algorithm = resolve_softmax_algorithm(algorithm, n, b)
    issued = model_softmax(rows, n, dtype, algorithm)
    e = rows * n * b
    passes = issued.parts["x"][0] // e if e else 1
    if algorithm in ("three_pass", "online") and passes > 1:
        warps = softmax_kernels.loop_config(n)["num_warps"]
        in_flight = min(rows, GPUS[gpu].sms * max(1, 64 // warps))
        if in_flight * n * b <= l2:
            passes = 1
    t = Traffic(info={"algorithm": algorithm, "x_reads": passes})
    t.add("x", passes * e, 0)
    work_read, work_write = issued.parts.get("workspace", [0, 0])
    t.add("workspace", work_read, 0)
    if algorithm == "split":  # stats kernel: x → workspace; write kernel: x + workspace → y
        written = _written_back(e, work_write, l2) + _written_back(e + work_read, e, l2)
    else:
        written = _written_back(t.read, issued.write, l2)
    t.add("y + workspace", 0, written)
    return t


# =============================================================================== backward
def compulsory_attention_bwd(shape: AttentionShape) -> Traffic:
    """Read Q, K, V, O, dO (and the LSE) once; write dQ, dK, dV once."""
    b = shape.itemsize
    q = shape.batch * shape.heads * shape.seq_q * shape.head_dim * b
    kv = shape.batch * shape.hkv * shape.nk * shape.head_dim * b
    t = Traffic()
    t.add("q, o, dO", 3 * q, 0)
    t.add("k, v", 2 * kv, 0)
    t.add("lse", shape.batch * shape.heads * shape.seq_q * 4, 0)
    t.add("dq", 0, q)
    t.add("dk, dv", 0, 2 * kv)
    return t


def counted_bwd_config(shape: AttentionShape) -> BwdConfig:
    """The backward config the model and the count use: the H200's for this shape."""
    return bwd_config(shape.itemsize, shape.head_dim, shape.causal, (9, 0))


def model_flashlite_attention_bwd(
    shape: AttentionShape,
    config: BwdConfig | None = None,
    *,
    with_lse_grad: bool = False,
) -> Traffic:
    """Bytes the three backward kernels issue (in-bounds lanes only, as they are counted).

    With ``b`` the element size, per (batch, head) and the fp32 statistics at 4 bytes a row:

    * preprocess: read O and dO (``Nq·D·b`` each) and dlse if given; write delta (``4·Nq``);
      for 16-bit inputs also read Q and write Qs, the prescaled Q (``Nq·D·b`` each);
    * dK/dV, per block of ``kv_block_n`` keys of a K/V head: read its K and V tiles once, then
      for each of the ``G`` query heads of its group the ``Nq − lo`` query rows that can see it
      (``lo`` from :func:`flashlite.masks.torch_query_range`): Qs (Q for fp32) and dO (``D·b``
      a row) and LSE and delta (4 bytes each); write the dK and dV tiles;
    * dQ, per block of ``q_block_m`` query rows: read Qs, dO, LSE, delta once and the K and V
      tiles up to the forward's ``hi`` (:func:`flashlite.masks.torch_key_range`); write dQ.
    """
    cfg = config or counted_bwd_config(shape)
    b, D = shape.itemsize, shape.head_dim
    B, H, Hkv, Nq, Nk = shape.batch, shape.heads, shape.hkv, shape.seq_q, shape.nk
    G = H // Hkv
    t = Traffic(info=bwd_info(cfg))
    rows = B * H * Nq
    t.add("preprocess", 2 * rows * D * b + (4 * rows if with_lse_grad else 0), 4 * rows)
    if b < 4:
        t.add("preprocess: q -> qs", rows * D * b, rows * D * b)
    q_rows = 0  # query rows the dK/dV programs of one K/V head read, over its key blocks
    for n0 in range(0, Nk, cfg.kv_block_n):
        lo = masks.torch_query_range(n0, cfg.kv_block_m, cfg.kv_block_n, Nq, Nk, shape.causal)[0]
        q_rows += Nq - lo
    t.add("dk/dv: k, v", 2 * B * Hkv * Nk * D * b, 0)
    t.add("dk/dv: q, dO, lse, delta", B * Hkv * G * q_rows * (2 * D * b + 8), 0)
    t.add("dk/dv: dk, dv", 0, 2 * B * Hkv * Nk * D * b)
    keys = 0  # keys each query head's dQ programs read
    bm, bn = cfg.q_block_m, cfg.q_block_n
    for m0 in range(0, Nq, bm):
        hi = masks.torch_key_range(m0, bm, bn, Nq, Nk, shape.causal)[3]
        keys += min(Nk, bn * triton.cdiv(hi, bn))
    t.add("dq: q, dO, lse, delta", rows * (2 * D * b + 8), 0)
    t.add("dq: k, v", B * H * keys * 2 * D * b, 0)
    t.add("dq: dq", 0, rows * D * b)
    return t


def bwd_info(cfg: BwdConfig) -> dict[str, object]:
    """How a table or JSON names a backward config."""
    return {
        "config": f"dkdv {cfg.kv_block_m}x{cfg.kv_block_n}, dq {cfg.q_block_m}x{cfg.q_block_n}",
        **cfg._asdict(),
    }


def decode_rows_per_head(shape: AttentionShape) -> int:
    """Packed query rows per KV head in the decode kernel: ``Nq·Hq/Hkv``."""
    return shape.seq_q * (shape.heads // shape.hkv)


def decode_splits(shape: AttentionShape, block_m: int, sms: int = 132) -> int:
    """The key chunks :func:`flashlite.ops.attention.attention_decode_fwd` picks on a GPU of
    ``sms`` SMs (the H200 has 132) for ``shape``."""
    from flashlite.ops.attention import splits_for

    rows = decode_rows_per_head(shape)
    return splits_for(shape.batch * shape.hkv, rows, shape.nk, sms, block_m)


def model_flashlite_decode(
    shape: AttentionShape, block_m: int, block_n: int, splits: int
) -> Traffic:
    """Bytes the decode kernel issues (:func:`flashlite.attention_kvcache` without new tokens: a
    full contiguous cache of ``Nk`` keys per batch).

    The ``G = Hq/Hkv`` query heads of a KV head are packed into one tile of ``R = Nq·G`` rows,
    so every K/V tile is read once per KV head, not once per query head. Program ``(row block,
    batch·KV head, chunk)`` loads its batch's length (4 bytes), its Q rows and the K and V
    lanes of the key tiles its chunk of ``key_range`` visits (lanes past ``Nk`` masked), then
    stores its rows' output and LSE: in the inputs' dtype without a split, else fp32 partials
    that the combine kernel reads back (``S`` partials a row) before writing O and LSE::

        read  = programs·4 + S·B·Hq·Nq·D·b + 2·B·Hkv·D·b·Σ lanes  [+ B·Hq·Nq·S·(4·D + 4)]
        write = B·Hq·Nq·(D·b + 4)                                  [or S·B·Hq·Nq·(4·D + 4) + that]

    ``Σ lanes`` runs over row blocks and chunks; a row block's key range is that of the query
    positions its rows may hold (``BLOCK_M`` of them from its first row's position).
    """
    b = shape.itemsize
    B, Hq, Hkv = shape.batch, shape.heads, shape.hkv
    Nq, Nk, D = shape.seq_q, shape.nk, shape.head_dim
    group, rows = Hq // Hkv, decode_rows_per_head(shape)
    split_len = block_n * triton.cdiv(triton.cdiv(Nk, block_n), splits)
    splits = triton.cdiv(Nk, split_len)
    lanes = 0
    for r0 in range(0, rows, block_m):
        lo, full_lo, full_hi, hi = masks.torch_key_range(r0 // group, block_m, block_n, Nq, Nk,
                                                         True)  # fmt: skip
        for c in range(splits):
            c0, c1 = c * split_len, (c + 1) * split_len
            start, end = min(max(full_lo, c0), c1), min(max(hi, c0), c1)
            lanes += sum(min(block_n, Nk - j) for j in range(start, end, block_n))
    programs = triton.cdiv(rows, block_m) * B * Hkv * splits
    t = Traffic()
    t.add("lengths", programs * 4, 0)
    t.add("q", splits * B * Hq * Nq * D * b, 0)
    t.add("k", B * Hkv * lanes * D * b, 0)
    t.add("v", B * Hkv * lanes * D * b, 0)
    if splits > 1:
        t.add("partials", 0, splits * B * Hq * Nq * (4 * D + 4))
        t.add("combine", splits * B * Hq * Nq * (4 * D + 4), 0)
    t.add("o", 0, B * Hq * Nq * D * b)
    t.add("lse", 0, B * Hq * Nq * 4)
    t.info = {"config": f"{block_m}x{block_n}", "splits": splits}
    return t


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
    from flashlite.kernels.cross_entropy import ce_config
    from flashlite.ops.cross_entropy import BWD_BLOCK, BWD_PROGRAMS, BWD_TILES

    b = torch.empty((), dtype=dtype).element_size()
    if prefetch and weight_bytes:
        raise ValueError("the prefetch kernel takes no class weights")
    passes = 1 if prefetch or ce_config(n)["SINGLE"] else 2
    chunks = softmax_gluon.prefetch_config(n, b)["n_chunks"] if prefetch else 1
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
        block = min(BWD_BLOCK, 1 << max(4, (n - 1).bit_length()))
        span = block * min(BWD_TILES, triton.cdiv(n, block))
        # one read per program of a scalar (mean, sum), one per row of per-row gradients
        reads = min(rows, BWD_PROGRAMS) if scalar_grad else rows
        t.add("backward: incoming gradient", reads * 4 * triton.cdiv(n, span), 0)
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
