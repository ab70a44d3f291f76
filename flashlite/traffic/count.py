"""HBM traffic of one attention or softmax call: modelled, counted, measured.

Three independent ways to get the bytes a call moves between DRAM (HBM) and the chip:

* **model** — closed-form bytes read and written. For the naive reference it is the sum over the
  ops :func:`flashlite.reference.attention` runs, each reading its inputs once and writing its
  output once. For flashlite it is what the kernel issues: Q once, K and V once per query block
  (only the tiles with a visible key when causal), O and LSE once — counting only unmasked lanes
  of partial tiles, with the block sizes the kernel really used.
* **counted** — run the real code and add up bytes. Triton kernels are run in Triton's
  interpreter with its load/store entry points wrapped (:func:`count_kernels`); torch ops are seen
  by a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (:func:`count_torch_ops`).
* **measured** — DRAM bytes of the kernels of one call on a GPU, from Nsight Compute
  (``dram__bytes_read.sum``, ``dram__bytes_write.sum``) run on a child process
  (:func:`measure_attention`).

Counted equals the model exactly for flashlite kernels; measured differs from both (L2 reuse of
K/V across query blocks, caches, ECC, prefetch): ``docs/hbm-traffic.md`` explains.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from flashlite import _backend, masks, reference
from flashlite.kernels import softmax as softmax_kernels
from flashlite.ops import attention as attention_ops
from flashlite.ops import softmax as softmax_ops

__all__ = [
    "ATTENTION_METHODS",
    "SOFTMAX_ALGORITHMS",
    "SOFTMAX_GPU_ALGORITHMS",
    "AttentionShape",
    "Traffic",
    "KernelCounter",
    "OpCounter",
    "compulsory_attention",
    "compulsory_softmax",
    "model_naive_attention",
    "model_flashlite_attention",
    "model_attention",
    "model_softmax",
    "count_kernels",
    "count_torch_ops",
    "count_attention",
    "make_inputs",
    "flashlite_config",
    "Measurement",
    "KernelMetrics",
    "count_softmax",
    "parse_ncu_csv",
    "find_ncu",
    "measure_attention",
    "l2_note",
    "tensor_bytes",
]

#: Methods every traffic function accepts; the sdpa-* ones can only be measured on a GPU.
ATTENTION_METHODS = ("naive", "flashlite", "sdpa-flash", "sdpa-cudnn")
#: Softmax kernels of :mod:`flashlite.kernels.softmax` (``auto`` resolves to one of the last two).
SOFTMAX_ALGORITHMS = ("three_pass", "online", "single_read", "split")
#: GPU-only (its programs wait for each other, which the interpreter cannot run): modelled only
SOFTMAX_GPU_ALGORITHMS = ("team",)
#: L2 size used in notes when no GPU says otherwise (an H200 has 60 MiB).
DEFAULT_L2_BYTES = 60 * 2**20
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# =============================================================================== shapes, results
@dataclass(frozen=True)
class AttentionShape:
    """One attention call: ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)``.

    ``kv_heads=None`` means ``Hkv = H`` (no GQA); ``seq_k=None`` means ``Nk = Nq``.
    """

    batch: int
    heads: int
    seq_q: int
    head_dim: int
    seq_k: int | None = None
    kv_heads: int | None = None
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_q", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.heads % self.hkv:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.hkv}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype={self.dtype} is not one of {list(_DTYPES)}")

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def nk(self) -> int:
        return self.seq_q if self.seq_k is None else self.seq_k

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> AttentionShape:
        return AttentionShape(**{**d, "dtype": _DTYPES[d["dtype"]]})


@dataclass
class Traffic:
    """Bytes read and written by one call; ``parts[name] = [read, write]`` breaks them down."""

    read: int = 0
    write: int = 0
    parts: dict[str, list[int]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.read + self.write

    def add(self, name: str, read: int, write: int) -> None:
        self.read += read
        self.write += write
        part = self.parts.setdefault(name, [0, 0])
        part[0] += read
        part[1] += write


def byte_fields(**figures: Traffic | None) -> dict[str, int | None]:
    """``{name}_bytes`` / ``_read`` / ``_write`` entries for JSON rows; None where absent."""
    out: dict[str, int | None] = {}
    for name, t in figures.items():
        out[f"{name}_bytes"] = t.total if t is not None else None
        out[f"{name}_read"] = t.read if t is not None else None
        out[f"{name}_write"] = t.write if t is not None else None
    return out


# =============================================================================== model
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
        _, hi = masks.torch_key_range(m0, block_m, block_n, Nq, Nk, shape.causal)
        keys += min(Nk, block_n * triton.cdiv(hi, block_n))
    bh = B * H
    t = Traffic()
    t.add("q", bh * Nq * D * b, 0)
    t.add("k", bh * keys * D * b, 0)
    t.add("v", bh * keys * D * b, 0)
    t.add("o", 0, bh * Nq * D * b)
    t.add("lse", 0, bh * Nq * 4)
    return t


def flashlite_config(shape: AttentionShape, device: str = "cpu") -> dict[str, Any]:
    """The launch config flashlite's attention kernel uses for ``shape`` on ``device``.

    Interpreted (CPU): the pinned config (``$FLASHLITE_ATTENTION_CONFIG``) or the kernel module's
    ``CPU_CONFIG``, as the front-end picks them. CUDA: one call of the host launcher, which reports
    the autotuner's choice for the shape (tuning once if it has not yet).
    """
    fixed = attention_ops.fixed_config(torch.device(device))
    if fixed is not None:  # interpreted or pinned: no launch needed to know it
        return {**fixed.constexprs(), "num_warps": fixed.num_warps, "num_stages": fixed.num_stages}
    q, k, v = make_inputs(shape, device)
    _, _, info = attention_ops.attention_fwd(q, k, v, shape.causal, shape.head_dim**-0.5)
    if info is None:  # empty problem: nothing launched
        return {"BLOCK_M": 1, "BLOCK_N": 1}
    cfg = info.config
    return {**cfg.constexprs(), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "USE_DESC": info.use_desc}  # fmt: skip


def model_attention(method: str, shape: AttentionShape, **config: int) -> Traffic | None:
    """Model bytes of ``method`` (``naive`` or ``flashlite``); None for the sdpa-* methods."""
    if method == "naive":
        return model_naive_attention(shape)
    if method == "flashlite":
        return model_flashlite_attention(shape, config.get("BLOCK_M"), config.get("BLOCK_N"))
    if method in ATTENTION_METHODS:
        return None
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def _resolve_softmax(algorithm: str, n: int, elem_bytes: int) -> str:
    # mirrors the front-end's "auto" on a CPU: one read when the row fits on chip, split
    # otherwise (a GPU runs long rows with the team kernel: one read, see kernels/softmax.py)
    if algorithm == "auto":
        fits = softmax_kernels.fits_single_read(n, elem_bytes)
        return "single_read" if fits else "split"
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
    modelled.
    """
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    algorithm = _resolve_softmax(algorithm, n, elem_bytes)
    e = rows * n * elem_bytes
    t = Traffic()
    passes = {"three_pass": 3, "online": 2, "single_read": 1, "split": 2, "team": 1}[algorithm]
    t.add("x", passes * e, 0)
    t.add("y", 0, e)
    if algorithm == "split":
        chunks = softmax_kernels.split_config(n)["n_chunks"]
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
    elif algorithm == "team":
        chunks = softmax_kernels.team_config(n, elem_bytes)["n_chunks"]
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
        t.add("counters", 0, 4 * rows)
    return t


# =============================================================================== counting
def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of distinct memory a tensor addresses: broadcast (stride-0) dims count once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


class OpCounter(TorchDispatchMode):
    """Counts bytes of every torch op: each tensor input read once, each output written once.

    Rules (the "reads its inputs once" model of an op):

    * views and metadata-only ops move nothing: ``func.is_view`` ops, and non-mutating ops whose
      every output shares storage with an input (``_unsafe_view``, ``alias``, ``detach``);
    * allocation (``empty*``, ``new_empty*``, ``set_``, ``resize_``) moves nothing;
    * a broadcast input (stride 0) counts its distinct elements (:func:`tensor_bytes`);
    * a mutated argument is read and written (``masked_fill_``), except that ``copy_``, ``fill_``,
      ``zero_`` and ``out=`` arguments are only written.

    Bytes are attributed to ``parts[<op name>]``. Counting is paused while a Triton kernel runs
    (the interpreter moves arguments with torch ops of its own).
    """

    _NO_DATA = (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "resize_",
        "lift_fresh",
    )
    _WRITE_ONLY = ("copy_", "fill_", "zero_")

    def __init__(self) -> None:
        super().__init__()
        self.traffic = Traffic()
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            read, write = self._bytes(func, args, kwargs, out)
            if read or write:
                self.traffic.add(func.overloadpacket.__name__, read, write)
        return out

    @classmethod
    def _bytes(cls, func: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int]:
        name = func.overloadpacket.__name__
        if func.is_view or name in cls._NO_DATA or func.namespace == "flashlite":
            return 0, 0  # (flashlite's own custom ops: their kernels are counted, not the op)
        schema = func._schema
        mutated: set[int] = set()
        write_only: set[int] = set()
        values = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in _tensors(values.get(arg.name)):
                    mutated.add(id(t))
                    if arg.kwarg_only or name in cls._WRITE_ONLY:
                        write_only.add(id(t))
        inputs = [t for v in values.values() for t in _tensors(v)]
        outputs = _tensors(out)
        if not mutated:
            storages = {_storage_key(t) for t in inputs}
            if outputs and all(_storage_key(t) in storages for t in outputs):
                return 0, 0  # an aliasing op such as _unsafe_view: metadata only
        read = sum(tensor_bytes(t) for t in inputs if id(t) not in write_only)
        if mutated:
            write = sum(tensor_bytes(t) for t in inputs if id(t) in mutated)
        else:
            write = sum(tensor_bytes(t) for t in outputs)
        return read, write


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class KernelCounter:
    """Bytes of the loads and stores Triton's interpreter executes, active lanes only.

    ``traffic.parts`` has one entry per kernel name and, for each tensor registered with
    :meth:`watch`, one entry ``"@<name>"`` with the bytes that touched that tensor's memory.
    """

    traffic: Traffic = field(default_factory=Traffic)
    kernel: str = "?"
    regions: list[tuple[str, int, int]] = field(default_factory=list)

    def watch(self, **tensors: torch.Tensor) -> None:
        """Attribute bytes to named tensors by address (their whole storage span)."""
        for name, t in tensors.items():
            start = t.untyped_storage().data_ptr()
            self.regions.append((name, start, start + t.untyped_storage().nbytes()))

    def _record(self, ptrs: np.ndarray, mask: np.ndarray, itemsize: int, is_store: bool) -> None:
        active = np.broadcast_to(mask, ptrs.shape).astype(bool)
        n = int(active.sum())
        if n == 0:
            return
        nbytes = n * itemsize
        read, write = (0, nbytes) if is_store else (nbytes, 0)
        self.traffic.add(self.kernel, read, write)
        if self.regions:
            addr = ptrs[active]
            for name, lo, hi in self.regions:
                k = int(((addr >= lo) & (addr < hi)).sum()) * itemsize
                if k:
                    part = self.traffic.parts.setdefault("@" + name, [0, 0])
                    part[1 if is_store else 0] += k


_kernel_counters: list[KernelCounter] = []
_op_counters: list[OpCounter] = []
_saved: dict[str, Any] = {}


def _itemsize(ptrs: Any) -> int:
    # int1 tensors live in memory as one byte per element
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


def _install_interpreter_hooks() -> None:
    """Wrap the interpreter's masked load/store (every load and store path ends there)."""
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store
    call = interp.GridExecutor.__call__

    def counted_load(ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        for c in _kernel_counters:
            c._record(ptrs.data, mask.data, _itemsize(ptrs), False)
        return load(ptrs, mask, *args, **kwargs)

    def counted_store(ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        for c in _kernel_counters:
            c._record(ptrs.data, mask.data, _itemsize(ptrs), True)
        return store(ptrs, value, mask, *args, **kwargs)

    def named_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        for c in _kernel_counters:
            c.kernel = self.fn.__name__
        for c in _op_counters:
            c.paused += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            for c in _op_counters:
                c.paused -= 1

    _saved.update(builder=builder, load=load, store=store, call=call, cls=interp.GridExecutor)
    builder.create_masked_load = counted_load
    builder.create_masked_store = counted_store
    interp.GridExecutor.__call__ = named_call


def _remove_interpreter_hooks() -> None:
    builder = _saved["builder"]
    del builder.create_masked_load, builder.create_masked_store  # back to the class methods
    _saved["cls"].__call__ = _saved["call"]
    _saved.clear()


def _hooks_needed() -> bool:
    return bool(_kernel_counters or _op_counters)


@contextlib.contextmanager
def count_kernels() -> Iterator[KernelCounter]:
    """Count bytes of every load/store that Triton kernels run in the interpreter execute.

    Masked-off lanes are excluded; tensor-descriptor loads and stores count in-bounds elements
    only (the interpreter turns them into masked accesses). Kernels must run interpreted, i.e. on
    CPU tensors. Atomics are not counted (no flashlite kernel uses them).

    Example::

        with count_kernels() as c:
            flashlite.softmax(x)
        c.traffic.read, c.traffic.write
    """
    if not _backend.kernels_interpreted():
        raise RuntimeError(
            "counting kernel loads and stores needs Triton's interpreter, which is off in this "
            "process (a CUDA device is present): set TRITON_INTERPRET=1 before flashlite is "
            "imported, e.g. `TRITON_INTERPRET=1 flashlite traffic --count`"
        )
    counter = KernelCounter()
    if not _hooks_needed():
        _install_interpreter_hooks()
    _kernel_counters.append(counter)
    try:
        yield counter
    finally:
        _kernel_counters.remove(counter)
        if not _hooks_needed():
            _remove_interpreter_hooks()


@contextlib.contextmanager
def count_torch_ops() -> Iterator[OpCounter]:
    """Count bytes of every torch op run inside the block (rules in :class:`OpCounter`)."""
    counter = OpCounter()
    if not _hooks_needed():
        _install_interpreter_hooks()
    _op_counters.append(counter)
    try:
        with counter:
            yield counter
    finally:
        _op_counters.remove(counter)
        if not _hooks_needed():
            _remove_interpreter_hooks()


def make_inputs(
    shape: AttentionShape, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)`` for ``shape``."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, D = shape.batch, shape.heads, shape.hkv, shape.head_dim
    q = torch.randn(B, H, shape.seq_q, D, generator=g)
    k = torch.randn(B, Hkv, shape.nk, D, generator=g)
    v = torch.randn(B, Hkv, shape.nk, D, generator=g)
    return tuple(t.to(device=device, dtype=shape.dtype) for t in (q, k, v))  # type: ignore[return-value]


def _attention_fn(method: str, shape: AttentionShape) -> Callable[..., torch.Tensor]:
    """The callable ``f(q, k, v)`` that runs ``method`` on ``shape``."""
    if method == "naive":
        return lambda q, k, v: reference.attention(q, k, v, causal=shape.causal)
    if method == "flashlite":
        import flashlite

        return lambda q, k, v: flashlite.attention(q, k, v, causal=shape.causal)
    if method in ("sdpa-flash", "sdpa-cudnn"):
        backend = method.removeprefix("sdpa-")
        return lambda q, k, v: reference.sdpa(q, k, v, causal=shape.causal, backend=backend)
    raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")


def count_attention(
    method: str, shape: AttentionShape, *, use_desc: bool | None = None
) -> Traffic | None:
    """Counted bytes of one call of ``method`` on CPU tensors of ``shape``.

    ``naive`` counts torch ops; ``flashlite`` counts the kernel's loads and stores in the
    interpreter plus any torch op of the front-end that moves data (``parts["torch ops"]``; zero
    for contiguous ``b h n d`` inputs), and records the block sizes in ``info``. ``use_desc``
    (flashlite only) forces tensor-descriptor (True) or pointer (False) loads through the host
    launcher instead of the public function. Returns None for the sdpa-* methods (GPU kernels).
    """
    if method not in ("naive", "flashlite"):
        if method in ATTENTION_METHODS:
            return None
        raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")
    q, k, v = make_inputs(shape, "cpu")
    if method == "naive":
        with count_torch_ops() as ops:
            _attention_fn(method, shape)(q, k, v)
        return ops.traffic
    if use_desc is None:
        fn = _attention_fn(method, shape)
    else:

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            return attention_ops.attention_fwd(
                q, k, v, shape.causal, shape.head_dim**-0.5, use_desc=use_desc
            )

    with count_kernels() as kern, count_torch_ops() as ops:
        kern.watch(q=q, k=k, v=v)
        fn(q, k, v)
    t = kern.traffic
    if ops.traffic.total:
        t.add("torch ops", ops.traffic.read, ops.traffic.write)
    t.info = flashlite_config(shape, "cpu")
    return t


def count_softmax(
    rows: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    algorithm: str = "auto",
    *,
    log: bool = False,
) -> Traffic:
    """Counted bytes of the softmax forward kernels for a contiguous ``(rows, n)`` input (CPU).

    ``three_pass`` / ``online`` / ``auto`` go through :func:`flashlite.softmax`; ``single_read``
    and ``split`` are launched through the front-end's host launcher, since the public API picks
    between them only by row length.
    """
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    resolved = _resolve_softmax(algorithm, n, x.element_size())
    with count_kernels() as kern:
        if algorithm in ("auto", "three_pass", "online"):
            fn = softmax_ops.log_softmax if log else softmax_ops.softmax
            fn(x, -1, algorithm=algorithm)
        else:
            softmax_ops.softmax_fwd(x, torch.empty_like(x), log, resolved)
    return kern.traffic


# =============================================================================== measuring
@dataclass
class KernelMetrics:
    """DRAM bytes of one profiled kernel (one ncu result ID)."""

    id: int
    name: str
    read: float = math.nan
    write: float = math.nan


_UNITS = {
    "byte": 1,
    "bytes": 1,
    "b": 1,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kibyte": 2**10,
    "mibyte": 2**20,
    "gibyte": 2**30,
    "tibyte": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _ncu_value(value: str, unit: str) -> float:
    """A metric value in bytes from ncu's text: thousands separators and SI/IEC units."""
    scale = _UNITS.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"unknown ncu unit {unit!r} for value {value!r}")
    return float(value.replace(",", "").strip()) * scale


def parse_ncu_csv(text: str) -> list[KernelMetrics]:
    """Per-kernel DRAM bytes from ``ncu --csv`` output (``--page details``, the default).

    Lines before the ``"ID",...`` header (ncu's ``==PROF==`` chatter, the program's own output)
    are skipped. Returns kernels in ID order with ``read``/``write`` in bytes.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[int, KernelMetrics] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        try:
            kid = int(row["ID"])
        except (KeyError, TypeError, ValueError):
            continue  # program output interleaved with the table
        k = kernels.setdefault(kid, KernelMetrics(kid, row.get("Kernel Name", "")))
        metric = row.get("Metric Name", "")
        if metric not in ("dram__bytes_read.sum", "dram__bytes_write.sum"):
            continue
        value = _ncu_value(row["Metric Value"], row.get("Metric Unit", "byte"))
        if metric.endswith("read.sum"):
            k.read = value
        else:
            k.write = value
    return [kernels[i] for i in sorted(kernels)]


def find_ncu() -> str | None:
    """Path of Nsight Compute's CLI: ``$NCU``, ``/usr/local/cuda/bin/ncu``, then ``PATH``."""
    for candidate in (os.environ.get("NCU"), "/usr/local/cuda/bin/ncu", shutil.which("ncu")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _range_name(i: int) -> str:
    # fixed width so no range name is a prefix of another
    return f"flt_{i:04d}_"


_RANGE_RE = re.compile(r"flt_(\d{4})_")


def _child_main(spec_path: str) -> None:
    """Run inside ncu: warm up (autotune) every config, then one measured call per NVTX range."""
    with open(spec_path) as f:
        spec = json.load(f)
    report: dict[str, Any] = {"errors": {}, "configs": {}}
    for i, d in enumerate(spec["shapes"]):
        shape = AttentionShape.from_json(d)
        try:
            q, k, v = make_inputs(shape, "cuda")
            fn = _attention_fn(spec["method"], shape)
            for _ in range(2):  # compile and autotune outside the measured range
                fn(q, k, v)
            torch.cuda.synchronize()
            if spec["method"] == "flashlite":
                with contextlib.suppress(Exception):
                    report["configs"][i] = flashlite_config(shape, "cuda")
            torch.cuda.nvtx.range_push(_range_name(i))
            fn(q, k, v)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            del q, k, v
        except Exception as e:  # unsupported by this backend: recorded, the others go on
            report["errors"][i] = f"{type(e).__name__}: {e}"
    with open(spec["report"], "w") as f:
        json.dump(report, f)


@dataclass
class Measurement:
    """Measured DRAM traffic per shape (None where unavailable) and why any is missing."""

    traffic: list[Traffic | None]
    message: str = ""
    configs: dict[int, dict[str, int]] = field(default_factory=dict)
    kernels: list[list[KernelMetrics]] = field(default_factory=list)


def _ncu_command(ncu: str, ranges: Sequence[str], rename: bool) -> list[str]:
    cmd = [ncu, "--nvtx"]
    for r in ranges:
        cmd += ["--nvtx-include", f"{r}/"]
    cmd += [
        "--metrics",
        "dram__bytes_read.sum,dram__bytes_write.sum",
        "--cache-control",
        "all",
        "--clock-control",
        "none",
        "--csv",
    ]
    if rename:  # kernel names become the enclosing range name: attributes kernels to configs
        cmd += ["--print-nvtx-rename", "kernel"]
    return cmd


def _run_ncu(
    ncu: str, method: str, shapes: Sequence[AttentionShape], rename: bool, timeout: float
) -> tuple[list[KernelMetrics], dict[str, Any], str]:
    """One ncu process over a child that runs every shape; returns (kernels, report, error)."""
    with tempfile.TemporaryDirectory(prefix="flashlite-ncu-") as tmp:
        spec_path, report_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "report.json")
        with open(spec_path, "w") as f:
            json.dump(
                {"method": method, "shapes": [s.to_json() for s in shapes], "report": report_path},
                f,
            )
        child = [
            sys.executable,
            "-c",
            "import sys; from flashlite.traffic import _child_main; _child_main(sys.argv[1])",
            spec_path,
        ]
        cmd = _ncu_command(ncu, [_range_name(i) for i in range(len(shapes))], rename) + child
        try:
            # the child runs compiled kernels even where this process interprets them (counting)
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return [], {}, f"ncu timed out after {timeout:.0f} s"
        except OSError as e:
            return [], {}, f"could not start ncu: {e}"
        out = proc.stdout + "\n" + proc.stderr
        if "ERR_NVGPUCTRPERM" in out:
            return (
                [],
                {},
                (
                    "ncu is not permitted to read GPU performance counters "
                    "(ERR_NVGPUCTRPERM): run as root or enable profiling for all users"
                ),
            )
        report: dict[str, Any] = {}
        if os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)
        kernels = parse_ncu_csv(proc.stdout)
        if proc.returncode != 0 and not kernels:
            tail = "\n".join(out.strip().splitlines()[-8:])
            return [], report, f"ncu exited with status {proc.returncode}:\n{tail}"
        return kernels, report, ""


def measure_attention(
    method: str,
    shapes: Sequence[AttentionShape],
    *,
    timeout: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> Measurement:
    """Measured DRAM bytes of one call of ``method`` for each shape, with Nsight Compute.

    One child process runs every shape (warm-up and autotune first, then the measured call inside
    its own NVTX range); ncu profiles only the kernels inside those ranges, flushing caches
    before each (``--cache-control all``), and the per-kernel bytes are summed per range.

    Never raises for a missing GPU or profiler: the result is None per shape and ``message`` says
    why (no CUDA, ncu missing, counters not permitted, backend unsupported for a shape).
    """
    if method not in ATTENTION_METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(ATTENTION_METHODS)}")
    none = [None] * len(shapes)
    if not torch.cuda.is_available():
        return Measurement(list(none), "measured: no CUDA device, DRAM bytes need a GPU")
    ncu = find_ncu()
    if ncu is None:
        return Measurement(
            list(none),
            "measured: ncu (Nsight Compute CLI) not found; set $NCU "
            "or install it under /usr/local/cuda/bin",
        )
    if progress:
        progress(f"{method}: ncu over {len(shapes)} shape(s)")
    kernels, report, error = _run_ncu(ncu, method, shapes, rename=True, timeout=timeout)
    groups: list[list[KernelMetrics]] = [[] for _ in shapes]
    fatal = ("not permitted", "timed out", "could not start")
    if error and any(f in error for f in fatal):
        return Measurement(list(none), f"measured ({method}): {error}")
    if not error and all(_RANGE_RE.search(k.name) for k in kernels):
        for k in kernels:
            groups[int(_RANGE_RE.search(k.name).group(1))].append(k)  # type: ignore[union-attr]
    elif not error and len(shapes) == 1:
        groups[0] = kernels
    else:
        # this ncu did not rename kernels after their ranges (or refused the option):
        # one ncu process per shape, slower but unambiguous
        report, error = {}, ""
        for i, shape in enumerate(shapes):
            if progress:
                progress(f"{method}: shape {i + 1}/{len(shapes)} (one ncu each)")
            ks, rep, error = _run_ncu(ncu, method, [shape], rename=False, timeout=timeout)
            if error:
                break
            groups[i] = ks
            # the child numbered its only shape 0; renumber to this shape's index
            for key in ("errors", "configs"):
                if "0" in rep.get(key, {}):
                    report.setdefault(key, {})[str(i)] = rep[key]["0"]
    if error:
        return Measurement(list(none), f"measured ({method}): {error}")
    errors = {int(i): e for i, e in report.get("errors", {}).items()}
    traffic: list[Traffic | None] = []
    for i, group in enumerate(groups):
        if i in errors or not group or any(math.isnan(k.read + k.write) for k in group):
            traffic.append(None)
            continue
        t = Traffic()
        for k in group:
            t.add(k.name, round(k.read), round(k.write))
        traffic.append(t)
    message = "; ".join(f"{method} shape {i}: {e}" for i, e in sorted(errors.items()))
    configs = {int(i): c for i, c in report.get("configs", {}).items()}
    return Measurement(traffic, message, configs, groups)


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
