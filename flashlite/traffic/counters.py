"""Counted bytes: run the real code and add up what every load, store and torch op moves.

Triton kernels run in Triton's interpreter, whose loads and stores are reported through
:func:`flashlite.traffic.hooks.interpreter_memory_hooks` (:func:`count_kernels`); torch ops are seen
by a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (:func:`count_torch_ops`). Each
counter is a context manager that yields the object holding its counts: nothing is kept in
module state, so counters nest. Counted equals the flashlite models of
:mod:`flashlite.traffic.model` exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashlite import _backend
from flashlite.traffic import hooks
from flashlite.traffic.shapes import Traffic


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

    @contextlib.contextmanager
    def pause(self, kernel: str = "") -> Iterator[None]:
        """Count nothing inside the block (a kernel launch: its loads and stores are the
        kernel counter's, and the interpreter moves arguments with torch ops of its own)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

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

    def on_load(self, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        """One interpreted load (an :data:`flashlite.traffic.hooks.AccessHook`)."""
        self._record(ptrs, mask, itemsize, False)

    def on_store(self, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        """One interpreted store (an :data:`flashlite.traffic.hooks.AccessHook`)."""
        self._record(ptrs, mask, itemsize, True)

    def on_launch(self, kernel: str) -> contextlib.nullcontext[None]:
        """One kernel launch: the bytes that follow are attributed to ``kernel``."""
        self.kernel = kernel
        return contextlib.nullcontext()

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
    with hooks.interpreter_memory_hooks(counter.on_load, counter.on_store, counter.on_launch):
        yield counter


@contextlib.contextmanager
def count_torch_ops() -> Iterator[OpCounter]:
    """Count bytes of every torch op run inside the block (rules in :class:`OpCounter`).

    Interpreted kernel launches inside the block pause the counter; compiled launches run no
    torch ops, so where kernels compile no interpreter hook is needed.
    """
    counter = OpCounter()
    pause_launches = (
        hooks.interpreter_memory_hooks(on_launch=counter.pause)
        if _backend.kernels_interpreted()
        else contextlib.nullcontext()
    )
    with pause_launches, counter:
        yield counter
