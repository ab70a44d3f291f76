"""How kernels are launched: ``kernel[grid](*args)`` with Triton's per-call work done once per
kind of call; and every use of Triton's private API in flashlite but the traffic counter's
interpreter hooks (:mod:`flashlite.traffic.hooks`), each guarded by the Triton versions it was
tested with, falling back or failing loudly with the version.

Triton's ``JITFunction.run`` binds and specialises every argument on every call, and its
compiled-kernel launch builds metadata and closures in Python: together tens of µs of host time,
more than a small kernel's whole GPU time. :class:`Launcher` looks the compiled kernel up by a key
that pins what Triton specialises on and, on the Triton version it was written against, calls the
CUDA launcher's C function directly. ``FLASHLITE_LAUNCH=triton`` (read at import) makes every
launch take Triton's own path, ``kernel[grid](...)``, as the interpreter always does; ``direct``
(the default) allows the bound launch. Also here: a compiled kernel's resources (team launches),
what a jit function is, the late interpreter switch, Gluon's TMA reduce-add.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import triton

# (the module, not its names: _backend imports this module while it starts, for
# interpret_from_now_on, before those names exist)
from flashlite import _backend
from flashlite._caches import Cache, memo

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
    """``kernel[grid](*args, **options)``, with Triton's per-call argument binding (about 15 µs
    for the attention kernel's 30 arguments) done once: the compiled kernel is looked up by a key
    that pins all Triton specialises on — each tensor's dtype and 16-byte alignment, each tensor
    descriptor's dtype, block shape and layout, each int's class (:func:`_int_class`), each
    float's and bool's type, each constexpr's value, the options and the device — and launched
    directly (descriptors through the compiled kernel's own launch, which builds their TMA
    maps). Interpreted kernels, untested Tritons and ``FLASHLITE_LAUNCH=triton`` take Triton's
    own path."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        low, high = _DIRECT_LAUNCH_TESTED
        tested = low <= _backend.TRITON_VERSION <= high
        self.direct = not _backend.INTERPRETED and tested and LAUNCH_MODE == "direct"
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
        ``args`` do (tensor dtypes and 16-byte alignment, int classes: :func:`_int_class`); a
        caller that keeps it pins all that in its own key (the plans do)."""
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
        compiled = compile_for(self.kernel, args, options)
        try:  # private: the compiled kernel's launch and the kernel's parameters
            defaults = {p.name: p.default for p in self.kernel.params}
            constants = [options.get(n, defaults[n]) for n in self.kernel.arg_names[len(args) :]]
            compiled.__getitem__  # noqa: B018
        except (AttributeError, KeyError, TypeError) as err:
            raise _backend.private_api_error("CompiledKernel launch", err) from err
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
        """:meth:`bind` for a plan that passes the tensors where ``args`` hold descriptors (of
        the template's shape, strides, dtype and alignment: the caller's key pins them). Where
        :func:`_raw_launch` works, TMA maps are encoded as the launcher would (:func:`_tma_args`)
        and kept per address; elsewhere a descriptor like the template is built per call."""
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
    """``launch(grid, *args)``: Triton's own ``kernel[grid](*args, **options)``; in the
    interpreter with numpy's floating-point warnings off inside it (masked rows use −inf)."""
    if not _backend.INTERPRETED:
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
    launcher with, skipping Triton's per-call Python (20 µs a launch on the H200's host): on the
    Triton version it was written for, without global or profile scratch; else None."""
    if _backend.TRITON_VERSION != _RAW_LAUNCH_TESTED or _backend.INTERPRETED:
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


#: What Triton 3.6's ``make_tensordesc_arg`` reads of a descriptor (a plan's differ in base only)
_Described = collections.namedtuple("_Described", "base shape strides padding")


def _described(base: torch.Tensor, template: Any) -> Any:
    return _Described(base, template.shape, template.strides, template.padding)


#: TMA maps kept per descriptor slot of a plan: at most this many addresses each.
_MAPS_PER_SLOT = 16


def _tma_args(compiled: Any, templates: list[tuple[int, Any]]) -> tuple[Any, ...] | None:
    """``(launch, function, cooperative, pdl, packed, fill)`` for :meth:`Launcher.bind_tensors`:
    :func:`_raw_launch`'s fields with the C launch the descriptor wrapper calls, and ``fill(a)``,
    the arguments with each template's tensor expanded as the wrapper would (TMA map, shape,
    strides), maps kept per address. None where :func:`_raw_launch` is."""
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
                out.extend(make_tensordesc_arg(_described(t, template), meta))
            else:
                ptr = t.data_ptr()
                found = kept.get(ptr)
                if found is None:
                    if len(kept) >= _MAPS_PER_SLOT:
                        kept.clear()
                    found = kept[ptr] = make_tensordesc_arg(_described(t, template), meta)
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
    profiler such as Proton adds to it), or a user's function. (Every bound launch asks.)"""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


try:  # the raw stream handle without a Stream object (what Triton's own launch reads)
    from torch._C import _cuda_getCurrentRawStream as _current_stream
    from torch._C import _cuda_getDevice as _current_device
except ImportError:  # pragma: no cover - a CPU-only torch
    _current_device = torch.cuda.current_device

    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


_launchers = Cache("launch.launchers", 256)


def launcher(kernel: Any) -> Launcher:
    """The :class:`Launcher` of ``kernel`` (one per kernel object, made on first use)."""
    found = _launchers.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _launchers.put(id(kernel), Launcher(kernel))
    return found


# ----------------------------------------------------------------------------- the rest
def compile_for(kernel: Any, args: tuple | list, options: dict) -> Any:
    """The compiled kernel for ``args`` and ``options`` (compiled now if new; nothing runs)."""
    try:  # private: JITFunction.warmup, which returns the CompiledKernel
        return kernel.warmup(*args, grid=(1,), **options)
    except (AttributeError, TypeError) as err:
        raise _backend.private_api_error("JITFunction.warmup", err) from err


def compiled_resources(compiled: Any) -> tuple[int, int, int]:
    """A compiled kernel's registers per thread, warps and shared memory bytes."""
    try:  # private: its resource usage (the handles that hold n_regs load lazily)
        if not hasattr(compiled, "n_regs"):
            compiled._init_handles()
        return compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared
    except AttributeError as err:
        raise _backend.private_api_error("CompiledKernel.n_regs / metadata", err) from err


@memo("launch.cooperative")
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a cooperative grid (all programs resident at once)."""
    try:  # private: the CUDA backend's option list (without it: no cooperative launches)
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def compiled_variants(kernels: Iterable[Any]) -> int:
    """How many compiled variants ``kernels`` hold (0 in the interpreter: nothing compiles)."""
    if _backend.INTERPRETED:
        return 0
    try:  # private: JITFunction.device_caches, per device a tuple led by the kernel cache
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())
    except (AttributeError, IndexError, TypeError) as err:
        raise _backend.private_api_error("JITFunction.device_caches", err) from err


try:  # private: the classes @triton.jit makes (compiled, and the interpreter's stand-in)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
except ImportError as err:  # pragma: no cover  (every supported Triton has both)
    raise ImportError(f"triton {triton.__version__} moved JITFunction: {err}") from err


def is_jit(fn: object) -> bool:
    """Whether ``fn`` is a ``@triton.jit`` function (compiled, or interpreted)."""
    return isinstance(fn, (JITFunction, InterpretedFunction))


def python_fn(fn: Any) -> Callable[..., Any]:
    """The undecorated Python function inside a jit function."""
    try:  # private: where both classes keep it
        return fn.fn
    except AttributeError as err:
        raise _backend.private_api_error("JITFunction.fn", err) from err


#: Triton versions whose jit library :func:`interpret_from_now_on` makes again
_LATE_INTERPRETER_TESTED = ((3, 4), (3, 9))


def interpret_from_now_on() -> str | None:
    """Turn the interpreter on after a late ``import triton`` (:mod:`flashlite._backend` says
    when), and make Triton's own jit library again, bound where ``triton.language`` and its
    tensor methods hold it. Why it failed (naming the version), or None. (Runs while
    ``_backend`` starts: none of its names is read here.)"""
    low, high = _LATE_INTERPRETER_TESTED
    if not low <= tuple(int(p) for p in triton.__version__.split(".")[:2]) <= high:
        return f"not tested with triton {triton.__version__} (3.4 to 3.9 are)"
    try:  # private: the runtime knob, and JITFunction objects rebound in triton.language
        import triton.language as tl
        from triton import knobs

        knobs.runtime.interpret = True
        os.environ["TRITON_INTERPRET"] = "1"
        for name in ("triton.language.standard", "triton.language.random"):
            module = sys.modules.get(name) or importlib.import_module(name)
            before = dict(vars(module))
            importlib.reload(module)
            for attr, old in before.items():
                for holder in (tl, tl.tensor) if isinstance(old, JITFunction) else ():
                    if vars(holder).get(attr) is old:
                        setattr(holder, attr, getattr(module, attr))
    except Exception as err:  # noqa: BLE001  (any failure: the clear error at the first call)
        os.environ.pop("TRITON_INTERPRET", None)
        return f"triton {triton.__version__}: {type(err).__name__}: {err}"
    return None


#: Tritons on which :func:`gluon_tma_add` builds it (3.6 has no name for it; 3.9 has one)
_TMA_ADD_TESTED = ((3, 4), (3, 9))


def gluon_tma_add() -> Any | None:
    """Gluon's TMA reduce-add ``add(tensor_desc, coord, src)`` (the shared tile ``src`` added
    into global memory), made from the IR builder's operation; None where untested or absent."""
    low, high = _TMA_ADD_TESTED
    if not low <= _backend.TRITON_VERSION <= high:
        return None
    try:  # private: the IR's reduce kinds and Gluon's builtin decorator
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin

        add = ir.DESCRIPTOR_REDUCE_KIND.ADD
    except (ImportError, AttributeError):
        return None

    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):  # noqa: ANN001, ANN202
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(add, tensor_desc.handle, coord, src.handle)

    return tma_add
