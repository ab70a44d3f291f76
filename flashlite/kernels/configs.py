"""Tile configs of the attention kernels: one ``Config`` type, one measured table per GPU family,
the autotuner's list for shapes without an entry, and the filter that drops configs a shape
cannot fit. Host-side only (no ``@triton.jit`` here); the front-end picks (the Triton kernels'
tiles in ``ops/attention/backends/triton/config.py``, the decode kernel's in
``ops/attention/backends/split_kv/splits.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from flashlite import _backend


class Config(NamedTuple):
    """One launch config: tile sizes, Triton's ``num_warps``/``num_stages``, and the loop
    variants (all give the same results; which is fastest depends on the tile and head dim)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: ``tl.range(warp_specialize=True)`` on the unmasked loop (TMA loads only)
    warp_specialize: bool = False
    #: rescale the accumulator only on tiles that move a row's reference maximum
    lazy_rescale: bool = False
    #: leave each tile's ``p·v`` running on the tensor cores under the next tile's softmax
    overlap: bool = False

    def constexprs(self) -> dict[str, object]:
        """The kernel constexprs this config sets (warps and stages are launch options)."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "WARP_SPECIALIZE": self.warp_specialize,
            "LAZY_RESCALE": self.lazy_rescale,
            "OVERLAP": self.overlap,
        }

    @classmethod
    def of(cls, c: triton.Config) -> Config:
        """The config an autotuner's ``triton.Config`` (from :func:`as_triton_config`) holds."""
        kw = c.kwargs
        return cls(
            kw["BLOCK_M"],
            kw["BLOCK_N"],
            c.num_warps,
            c.num_stages,
            kw["WARP_SPECIALIZE"],
            kw["LAZY_RESCALE"],
            kw["OVERLAP"],
        )


#: Configs the GPU autotuner tries for shapes without a measured entry below; ``keep_config``
#: drops the ones that cannot fit a shape. The last ones are small fallbacks for fp32 and head
#: dims up to 256. Warp specialisation is supported but left out: with Triton 3.6 on the H200 it
#: was no faster than the same config without it, and two such configs crashed the compiler.
GPU_CONFIGS = [
    Config(128, 128, 8, 3, lazy_rescale=True),
    Config(128, 128, 8, 2, lazy_rescale=True),
    Config(128, 64, 4, 3),
    Config(64, 64, 4, 2, overlap=True),
    Config(64, 64, 4, 3),
    Config(64, 128, 4, 2, overlap=True),
    Config(64, 64, 4, 2),
    Config(64, 32, 4, 2),
]
#: The config Hopper (sm_90) runs for 16-bit inputs at these ``(BLOCK_D, causal)``, without
#: autotuning: the fastest in three sweeps on an H200 (bf16, B·N = 16k tokens, N = 4k and
#: 16k; ``benchmarks/NOTES.md``). Autotuning over ``GPU_CONFIGS`` picks between configs a few
#: percent apart from one timing each, so its choice moved between runs; a table does not.
HOPPER_CONFIGS = {
    (64, False): Config(128, 64, 4, 3),
    (64, True): Config(64, 64, 4, 3),
    (128, False): Config(64, 64, 4, 2, overlap=True),
    (128, True): Config(64, 64, 4, 2, overlap=True),
}
#: Hopper's config with a soft cap, per ``(BLOCK_D, causal)``: the overlapped loop loses most
#: to the extra ``tanh`` (1.48x the uncapped time against 1.20x for this one; H200, bf16,
#: N = 16k causal, ``benchmarks/NOTES.md``). Only D=128 was measured.
HOPPER_SOFTCAP_CONFIGS = {(128, False): Config(64, 64, 4, 3), (128, True): Config(64, 64, 4, 3)}
#: The config the interpreter (CPU) runs: small tiles keep it quick; several tiles per sequence
#: in the tests exercise the loop bounds.
CPU_CONFIG = Config(16, 16, 4, 1)
#: ``FLASHLITE_ATTENTION_CONFIG="BM,BN,warps,stages[,ws[,lazy[,overlap]]]"`` (0/1 flags) pins
#: one config (tests, benchmarks).
PIN_ENV = "FLASHLITE_ATTENTION_CONFIG"
#: Shared memory a config may plan for (Hopper gives a block 227 KB).
SMEM_BUDGET = 224 * 1024


class DecodeConfig(NamedTuple):
    """Launch config of the decode kernel (:mod:`flashlite.kernels.attention.decode`): rows of
    packed queries per program, keys per tile, Triton's options, and TMA descriptor loads for
    contiguous caches."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_desc: bool = False


#: The decode tiles on a GPU (H200, bf16, D=128, ``benchmarks/NOTES.md``): up to 16 packed rows
#: (``Nq·Hq/Hkv``) with few KV heads in the batch (128-key tiles stream a long cache fastest;
#: pointer loads were as fast as TMA, without its per-call host cost), the same with 64 or more
#: KV heads in the batch (64-key tiles: steadier across split counts), and more rows (untuned).
GPU_DECODE_CONFIGS = (
    DecodeConfig(16, 128, 4, 3),
    DecodeConfig(16, 64, 4, 3),
    DecodeConfig(64, 64, 4, 3),
)
#: The interpreter's decode tile (several tiles per chunk in small tests).
CPU_DECODE_CONFIG = DecodeConfig(16, 16, 4, 1)


def decode_config(
    rows: int, interpreted: bool, kv_heads: int = 1, block_d: int = 128, elem_bytes: int = 2
) -> DecodeConfig:
    """The decode kernel's config for ``rows`` packed query rows per KV head and ``kv_heads``
    (batch × KV heads) of them, its key tile halved (then its stages and rows cut) until it
    fits ``block_d`` and the element size (the table's tiles are for 16-bit inputs and
    D <= 128)."""
    if interpreted:
        return CPU_DECODE_CONFIG
    if rows > 16:
        cfg = GPU_DECODE_CONFIGS[2]
    else:
        cfg = GPU_DECODE_CONFIGS[0] if kv_heads < 64 else GPU_DECODE_CONFIGS[1]
    while not keep_config(Config(*cfg[:4]), block_d, elem_bytes, cfg.use_desc):
        if cfg.block_n > 16:
            cfg = cfg._replace(block_n=cfg.block_n // 2)
        elif cfg.num_stages > 1:
            cfg = cfg._replace(num_stages=cfg.num_stages - 1)
        elif cfg.block_m > 16:
            cfg = cfg._replace(block_m=cfg.block_m // 2)
        else:
            break
    return cfg


class BwdConfig(NamedTuple):
    """Launch config of the backward's two main kernels. dK/dV: one program per ``kv_block_n``
    keys, stepping through ``kv_block_m`` query rows at a time; dQ: one program per
    ``q_block_m`` queries, stepping through ``q_block_n`` keys at a time."""

    kv_block_m: int
    kv_block_n: int
    kv_warps: int
    kv_stages: int
    q_block_m: int
    q_block_n: int
    q_warps: int
    q_stages: int
    #: load the loops' tiles (dK/dV: Qs and dO; dQ: K and V) through TMA descriptors where the
    #: tensors allow it
    use_desc: bool = False

    def dkdv(self) -> dict[str, int]:
        """The dK/dV kernel's tile constexprs and launch options."""
        return {
            "BLOCK_M": self.kv_block_m,
            "BLOCK_N": self.kv_block_n,
            "num_warps": self.kv_warps,
            "num_stages": self.kv_stages,
        }

    def dq(self) -> dict[str, int]:
        """The dQ kernel's tile constexprs and launch options."""
        return {
            "BLOCK_M": self.q_block_m,
            "BLOCK_N": self.q_block_n,
            "num_warps": self.q_warps,
            "num_stages": self.q_stages,
        }


#: The backward on the interpreter: small tiles (fast in Python, several blocks per test).
CPU_BWD_CONFIG = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1)
#: The backward for 16-bit inputs with a head of up to 128 on a GPU, and the small fallback for
#: fp32 (its three-pass dots double the operands) and wider heads (the dK and dV accumulators are
#: ``2·BLOCK_N·BLOCK_D`` fp32 registers). See ``HOPPER_BWD_CONFIGS`` for the measured table.
GPU_BWD_CONFIG = BwdConfig(32, 64, 4, 3, 64, 64, 4, 2)
GPU_BWD_SMALL_CONFIG = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)
#: Hopper (sm_90), 16-bit inputs, by ``(BLOCK_D, causal)``: the fastest of four sweeps on an
#: H200 (``benchmarks/NOTES.md``); TMA descriptor loads won 2–10% in both kernels. At D = 128
#: dK/dV takes 64 keys and one warpgroup: two programs fit an SM and hide each other's waits.
HOPPER_BWD_CONFIGS: dict[tuple[int, bool], BwdConfig] = {
    (64, False): BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, use_desc=True),
    (64, True): BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, use_desc=True),
    (128, False): BwdConfig(64, 64, 4, 2, 128, 64, 8, 4, use_desc=True),
    (128, True): BwdConfig(64, 64, 4, 2, 128, 64, 8, 4, use_desc=True),
}


def bwd_config(
    elem_bytes: int, head_dim: int, causal: bool, capability: tuple[int, int]
) -> BwdConfig:
    """The backward's config on a GPU of this compute capability."""
    bd = block_d(head_dim)
    if elem_bytes > 2 or bd > 128:
        return GPU_BWD_SMALL_CONFIG
    if capability == (9, 0) and (bd, causal) in HOPPER_BWD_CONFIGS:
        return HOPPER_BWD_CONFIGS[(bd, causal)]
    return GPU_BWD_CONFIG


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (host arithmetic, cheaper than Triton's wrapper)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_d(head_dim: int) -> int:
    """The on-chip width of a head: D rounded up to a power of two, at least 16 (``tl.dot``)."""
    return max(16, next_pow2(head_dim))


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` for positive ``b``."""
    return -(-a // b)


def pinned_text() -> str | None:
    """The raw ``$FLASHLITE_ATTENTION_CONFIG`` (part of the front-end's per-call cache key)."""
    return _backend.getenv(PIN_ENV)


def pinned_config() -> Config | None:
    """The config pinned through the environment, if any."""
    text = _backend.getenv(PIN_ENV)
    if not text:
        return None
    fields = [int(v) for v in text.split(",")]
    if not 4 <= len(fields) <= 7:
        raise ValueError(
            f"{PIN_ENV}={text!r}: expected 4 to 7 comma-separated integers "
            "BM,BN,warps,stages[,ws[,lazy[,overlap]]]"
        )
    bm, bn, w, s, *flags = fields
    return Config(bm, bn, w, s, *(bool(f) for f in flags))


def as_triton_config(cfg: Config, pre_hook: object = None) -> triton.Config:
    return triton.Config(
        cfg.constexprs(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, pre_hook=pre_hook
    )


def set_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: give the host descriptors the block shape of the config being run."""
    if not nargs["USE_DESC"]:
        return
    bm, bn, bd = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
    bdv = nargs.get("BLOCK_DV") or bd  # (V's and O's head dim, where it differs)
    nargs["Q"].block_shape = [1, 1, bm, bd]
    nargs["K"].block_shape = [1, 1, bn, bd]
    nargs["V"].block_shape = [1, 1, bn, bdv]
    if not nargs["VARLEN"]:  # (varlen stores O through pointers)
        nargs["O"].block_shape = [1, 1, bm, bdv]


def keep_config(cfg: Config, block_d: int, elem_bytes: int, use_desc: bool) -> bool:
    """Whether a config fits this shape: ``stages`` K and V tiles (plus room for Q) in shared
    memory, the fp32 accumulator and score tile in registers; warp specialisation only with TMA
    loads. fp32 counts double: its three-pass TF32 dots keep split copies of the operands (the
    H200 refused fp32 configs this estimate now rejects). The overlapped loop loads one more K
    and V tile outside the pipelined loop (its first scores and last values)."""
    if cfg.warp_specialize and not use_desc:
        return False
    threads = 32 * cfg.num_warps
    return (
        smem_bytes(cfg, block_d, elem_bytes) <= SMEM_BUDGET
        and cfg.block_m * block_d <= 128 * threads
        and cfg.block_m * cfg.block_n <= 64 * threads
    )


def smem_bytes(cfg: Config, block_d: int, elem_bytes: int) -> int:
    """Shared memory a config plans for (see :func:`keep_config`)."""
    elem = 2 * elem_bytes if elem_bytes >= 4 else elem_bytes
    kv_tiles = 2 * cfg.num_stages + (2 if cfg.overlap else 0)
    return (kv_tiles * cfg.block_n + cfg.block_m) * block_d * elem


def default_config(block_d: int, elem_bytes: int, use_desc: bool) -> Config:
    """The first config that fits: what runs when nothing is tuned or pinned."""
    for cfg in GPU_CONFIGS:
        if keep_config(cfg, block_d, elem_bytes, use_desc):
            return cfg
    return Config(32, 32, 4, 1)
