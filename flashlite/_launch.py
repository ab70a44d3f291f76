"""How kernels are launched: ``kernel[grid](*args)`` with Triton's per-call work done once per
kind of call.

Triton's ``JITFunction.run`` binds and specialises every argument on every call, and its
compiled-kernel launch builds metadata and closures in Python: together tens of µs of host time,
more than a small kernel's whole GPU time. :class:`Launcher` looks the compiled kernel up by a key
that pins what Triton specialises on and, on the Triton version it was written against, calls the
CUDA launcher's C function directly. Cooperative "team" launches (programs of one row that wait
for each other) size their grid from the compiled kernel's resources.

Everything private is guarded by the Triton versions it was tested with, and fails loudly naming
the version. ``FLASHLITE_LAUNCH=triton`` in the environment (read at import) makes every launch
take Triton's own path, ``kernel[grid](...)``, with no private API at all; ``direct`` (the
default) allows the bound launch. The interpreter always takes Triton's own path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from flashlite._backend import (
    INTERPRETED,
    TRITON_VERSION,
    private_api_error,
)
from flashlite._caches import Cache

#: The environment switch, and its values: ``direct`` (bound launches where tested) or
#: ``triton`` (Triton's own launch path for every kernel).
LAUNCH_ENV = "FLASHLITE_LAUNCH"
LAUNCH_MODES = ("direct", "triton")
LAUNCH_MODE = os.environ.get(LAUNCH_ENV, "direct")
if LAUNCH_MODE not in LAUNCH_MODES:
    raise ValueError(
        f"{LAUNCH_ENV}={LAUNCH_MODE!r} is not one of {', '.join(LAUNCH_MODES)} (direct: bound "
        "launches where this Triton was tested; triton: Triton's own launch path)"
    )

# ----------------------------------------------------------------------------- launching
#: Triton versions whose compiled-kernel launch (``JITFunction.warmup`` returning a
#: ``CompiledKernel``, ``CompiledKernel[grid](*all_args)``) :class:`Launcher` was written against.
_DIRECT_LAUNCH_TESTED = ((3, 4), (3, 9))

#: Bound launches per kind of call, all kernels together (one :class:`~flashlite._caches.Cache`).
_bound = Cache("launch.bound", 4096)


class Launcher:
    """``kernel[grid](*args, **options)``, with Triton's per-call argument binding done once.

    ``JITFunction.run`` binds and specialises every argument on every call (about 15 µs of host
    time for the attention kernel's 30 arguments, more than its whole GPU time at small shapes).
    Here the compiled kernel is looked up by a key that pins everything Triton specialises on —
    each tensor's dtype and 16-byte alignment, each tensor descriptor's dtype, block shape and
    layout, each int's class (:func:`_int_class`), each float's and bool's type, each constexpr's
    value, the options and the device — and launched
    directly (tensor descriptors through the compiled kernel's own launch, which builds their
    TMA maps). Interpreted kernels, untested Triton versions and ``FLASHLITE_LAUNCH=triton``
    take Triton's own path.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        low, high = _DIRECT_LAUNCH_TESTED
        self.direct = not INTERPRETED and low <= TRITON_VERSION <= high and LAUNCH_MODE == "direct"
        # positions of constexpr parameters: their exact values make the compiled kernel
        params = getattr(kernel, "params", None)
        self.exact = (frozenset(i for i, p in enumerate(params) if getattr(p, "is_constexpr", True))
                      if params is not None else None)  # fmt: skip

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.bind(args, options)(grid3, *args)

    def bind(self, args: tuple, options: dict) -> Callable[..., None]:
        """``launch(grid, *args)`` (``grid`` of three) for calls whose arguments specialise as
        ``args`` do (the same tensor dtypes and 16-byte alignment, ints of the same class,
        :func:`_int_class`): the compiled kernel looked up once. A caller that keeps the result
        must pin all that in its own key (the plans do, by shapes, strides, dtypes and
        alignment)."""
        key = self._key(args, options) if self.direct else None
        if key is None:
            return triton_launch(self.kernel, options)
        run = _bound.get(key)
        if run is None:
            run = _bound.put(key, self._bound_run(args, options))
        return run

    def _key(self, args: tuple, options: dict) -> tuple | None:
        key: list[Any] = [id(self.kernel)]
        device = None
        exact = self.exact
        for i, a in enumerate(args):
            kind = type(a)
            if kind is torch.Tensor or isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
                device = a.device.index
            elif kind is int or kind is float or kind is bool:
                if exact is None or i in exact:  # a constexpr: the value itself is kept
                    key.append((kind, a))
                elif kind is int:  # what Triton specialises an int on, not its value
                    key.append(_int_class(a))
                else:  # (fp32 / u1 whatever the value)
                    key.append(kind)
            elif _is_descriptor(a):
                # a host tensor descriptor: Triton specialises on its dtype, block and layout
                base = a.base
                key.append((kind, base.dtype, base.data_ptr() % 16 == 0, tuple(a.block_shape),
                            getattr(a, "layout", None), getattr(a, "padding", None)))  # fmt: skip
                device = base.device.index
            else:  # anything else: Triton's own path
                return None
        key.append(device)
        key.append(tuple(options.items()))
        try:
            hash(key[-1])
        except TypeError:  # an option Triton takes that is not hashable
            return None
        return tuple(key)

    def _bound_run(self, args: tuple, options: dict) -> Callable[..., None]:
        """The launch of the compiled kernel for ``args``: the CUDA launcher's C function called
        directly where :func:`_raw_launch` allows it, else the compiled kernel's own launch."""
        try:  # private: warmup's return value and the compiled kernel's launch
            compiled = self.kernel.warmup(*args, grid=(1,), **options)
            defaults = {p.name: p.default for p in self.kernel.params}
            constants = [options.get(n, defaults[n]) for n in self.kernel.arg_names[len(args) :]]
            compiled.__getitem__  # noqa: B018
        except (AttributeError, KeyError, TypeError) as err:
            raise private_api_error("JITFunction.warmup / CompiledKernel launch", err) from err
        has_desc = any(_is_descriptor(a) for a in args)
        raw = None if has_desc else _raw_launch(compiled)
        if raw is None:

            def run(grid: tuple[int, int, int], *a: Any) -> None:
                compiled[grid](*a, *constants)

            run.compiled = compiled  # type: ignore[attr-defined]  # (what the tests inspect)
            run.constants = constants  # type: ignore[attr-defined]
            return run
        launch, function, coop, pdl, packed = raw
        hooks = _launch_hooks()

        def run(grid: tuple[int, int, int], *a: Any) -> None:
            if _listening(hooks):
                compiled[grid](*a, *constants)
                return
            stream = _current_stream(_current_device())
            launch(*grid, stream, function, coop, pdl, None, None, packed, None, None, None, *a,
                   *constants)  # fmt: skip

        run.compiled = compiled  # type: ignore[attr-defined]
        run.constants = constants  # type: ignore[attr-defined]
        return run

    def bind_tensors(self, args: tuple, options: dict) -> Callable[..., None]:
        """:meth:`bind` for a plan that passes, where ``args`` hold tensor descriptors, the
        tensors they describe: ``launch(grid, *a)`` with each such ``a[i]`` a tensor of the
        template descriptor's shape, strides, dtype and alignment (the caller's key pins them).

        A descriptor holds its tensor's address, so it is made per call; here nothing else is.
        On the Triton version :func:`_raw_launch` was written against, each TMA map is encoded by
        the launcher's own function (:func:`_tma_args`) and kept per address, so a training
        loop, whose tensors come back at the same few addresses, encodes none after its first
        steps; elsewhere a descriptor like the template is built per call."""
        templates = [(i, a) for i, a in enumerate(args) if _is_descriptor(a)]
        bound = self.bind(args, options)
        if not templates:
            return bound

        def rebuilt(a: tuple) -> list:
            out = list(a)
            for i, template in templates:
                out[i] = dataclasses.replace(template, base=a[i])
            return out

        compiled = getattr(bound, "compiled", None)
        expand = _tma_args(compiled, templates) if compiled is not None else None
        if expand is None:  # Triton's own launch of rebuilt descriptors
            return lambda grid, *a: bound(grid, *rebuilt(a))
        launch, function, coop, pdl, packed, fill = expand
        constants = bound.constants  # type: ignore[attr-defined]
        hooks = _launch_hooks()

        def run(grid: tuple[int, int, int], *a: Any) -> None:
            if _listening(hooks):
                compiled[grid](*rebuilt(a), *constants)
                return
            stream = _current_stream(_current_device())
            launch(*grid, stream, function, coop, pdl, None, None, packed, None, None, None,
                   *fill(a), *constants)  # fmt: skip

        return run


def triton_launch(kernel: Any, options: dict) -> Callable[..., None]:
    """``launch(grid, *args)``: Triton's own ``kernel[grid](*args, **options)``. In the
    interpreter numpy's floating-point warnings are off inside it: masked rows compute with −inf
    on purpose (``exp(−inf) = 0``, ``log(0) = −inf``), and numpy would warn about each such
    operation on every call. Only flashlite's own launches are quieted; the caller's numpy
    settings are left as they were."""
    if not INTERPRETED:
        return lambda grid, *a: kernel[grid](*a, **options)
    import numpy as np

    def run(grid: Any, *a: Any) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            kernel[grid](*a, **options)

    return run


#: The one Triton version whose compiled-kernel launcher :func:`_raw_launch` calls directly.
_RAW_LAUNCH_TESTED = (3, 6)


def _raw_launch(compiled: Any) -> tuple[Any, ...] | None:
    """``(launch, function, cooperative, pdl, packed metadata)`` to call a compiled kernel's C
    launcher with, skipping Triton's per-call Python (``CompiledKernel.__getitem__``'s runner,
    launch metadata, the launcher's scratch closures): about 20 µs of host time per launch on
    the H200's host, more than a small kernel's whole time. Only on the Triton version it was
    written against, for kernels without global or profile scratch; None otherwise."""
    if TRITON_VERSION != _RAW_LAUNCH_TESTED or INTERPRETED:
        return None
    try:  # private: the CUDA launcher's fields and its C launch function's argument order
        run = compiled.run
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        raw = (run.launch, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
               compiled.packed_metadata)  # fmt: skip
    except AttributeError:
        return None
    return raw


def _int_class(a: int) -> tuple[int, bool, bool]:
    """What Triton's launch specialises an int argument on: 1 becomes a constant, a multiple of
    16 gets the divisibility hint, and the range sets its type (i32, i64, u64). A bound launch
    keyed by this (not the value) serves every value of the class: a decode loop whose cache
    grows by a key per step binds a few launches, not one per step."""
    width = 0 if -(2**31) <= a < 2**31 else 1 if -(2**63) <= a < 2**63 else 2
    return (width, a == 1, a % 16 == 0)


def _is_descriptor(a: Any) -> bool:
    """Whether a launch argument is a host tensor descriptor (Triton's or Gluon's)."""
    return hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor)


class _Described:
    """What Triton 3.6's ``make_tensordesc_arg`` reads of a descriptor: base, shape, strides,
    padding (a plan's descriptors differ only in their base)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: torch.Tensor, template: Any) -> None:
        self.base, self.shape, self.strides = base, template.shape, template.strides
        self.padding = template.padding


#: TMA maps kept per descriptor slot of a plan: at most this many addresses each.
_MAPS_PER_SLOT = 16


def _tma_args(compiled: Any, templates: list[tuple[int, Any]]) -> tuple[Any, ...] | None:
    """``(launch, function, cooperative, pdl, packed, fill)`` for
    :meth:`Launcher.bind_tensors`: :func:`_raw_launch`'s fields with the C launch that the
    compiled kernel's descriptor wrapper calls, and ``fill(a)``, the flat argument list with
    the tensor of each ``(index, template descriptor)`` expanded as the wrapper would (its TMA
    map, shape, strides), maps kept per address. None where :func:`_raw_launch` is."""
    raw = _raw_launch(compiled)
    if raw is None:
        return None
    wrapper, *fields = raw
    try:  # private: the wrapper's closure (the C launch) and the driver's descriptor expansion
        cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True))
        c_launch = cells["launcher"].cell_contents
        metas = cells["tensordesc_meta"].cell_contents or [None] * len(templates)
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except (AttributeError, KeyError, ImportError, ValueError):
        return None
    # per slot: (index, template, its launcher metadata, its TMA maps by address)
    slots = [(i, t, meta, {}) for (i, t), meta in zip(templates, metas, strict=True)]

    def fill(a: tuple) -> list:
        out: list = []
        start = 0
        for i, template, meta, kept in slots:
            out.extend(a[start:i])
            t = a[i]
            if meta is None:  # (no map: the launcher reads the tensor itself)
                out.extend(make_tensordesc_arg(_Described(t, template), meta))
            else:
                ptr = t.data_ptr()
                found = kept.get(ptr)
                if found is None:
                    if len(kept) >= _MAPS_PER_SLOT:
                        kept.clear()
                    found = kept[ptr] = make_tensordesc_arg(_Described(t, template), meta)
                out.extend(found)
            start = i + 1
        out.extend(a[start:])
        return out

    return (c_launch, *fields, fill)


def _launch_hooks() -> Any:
    """Triton's runtime knobs, whose launch hooks are empty (falsy) unless a profiler listens."""
    from triton import knobs

    return knobs.runtime


def _listening(hooks: Any) -> bool:
    """Whether a launch enter or exit hook is set: 3.6's default is an empty ``HookChain`` (a
    profiler such as Proton adds to it), or a user's function. (One call for both: every bound
    launch asks.)"""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


try:  # the raw stream handle without a Stream object (what Triton's own launch reads)
    from torch._C import _cuda_getCurrentRawStream as _current_stream  # noqa: F811
    from torch._C import _cuda_getDevice as _current_device  # noqa: F811
except ImportError:  # pragma: no cover - a CPU-only torch
    pass


_launchers = Cache("launch.launchers", 256)


def launcher(kernel: Any) -> Launcher:
    """The :class:`Launcher` of ``kernel`` (one per kernel object, made on first use)."""
    found = _launchers.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _launchers.put(id(kernel), Launcher(kernel))
    return found
