"""Where kernels run, and the facts about this process's Triton that the kernels depend on.

This is the only module that knows about ``TRITON_INTERPRET`` and the interpreter's quirks.
Running kernels patches nothing in Triton; the one exception is byte counting
(:func:`interpreter_memory_hooks`), which wraps the interpreter's memory entry points only inside
its ``with`` block, always restores them, and checks the Triton version it was written for.

* **CUDA tensors** run compiled kernels.
* **A process without CUDA** interprets: before ``triton`` is first imported we set
  ``TRITON_INTERPRET=1``, so every ``@triton.jit`` function (our kernels, the ``stats``/``masks``
  helpers and Triton's own ``tl.*`` library) is created as an interpreted function. Triton
  decides this once per function, when it is decorated, so a ``triton`` imported *before*
  flashlite without that variable leaves compiled functions nothing can run:
  :func:`compute_device` then raises and says how to fix it.
* **CPU tensors on a CUDA machine** are moved to the GPU once per op call by the front-end
  (:func:`compute_device` says where to run, the op copies the results back).
* The interpreter computes ``tl.dot`` on bf16 operands wrongly and converts fp32 to bf16 by
  truncation (Triton 3.9): :func:`dot_upcast` asks kernels for fp32 dot operands, and
  :func:`round_bf16` for the round-to-nearest-even cast of ``kernels/common.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

_HAS_CUDA = torch.cuda.is_available()
_TRITON_FIRST = "triton" in sys.modules
if not _HAS_CUDA and not _TRITON_FIRST:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

#: The oldest Triton flashlite runs on: host ``TensorDescriptor`` (``triton.tools.
#: tensor_descriptor``) and ``tl.range(warp_specialize=)`` arrived in 3.4. CI tests it.
MIN_TRITON = (3, 4)
TRITON_VERSION: tuple[int, int] = tuple(int(p) for p in triton.__version__.split(".")[:2])  # type: ignore[assignment]
if TRITON_VERSION < MIN_TRITON:
    raise ImportError(
        f"flashlite needs triton >= {'.'.join(map(str, MIN_TRITON))}, found {triton.__version__}"
    )

#: Whether this process's ``@triton.jit`` functions are interpreted (read once: Triton decides
#: when each function is decorated, which for flashlite's kernels is at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run flashlite's kernels here, if it cannot."""
    import numpy

    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    # Before 3.7 the interpreter turns 1-element arrays into loop bounds with int(array), which
    # numpy 2.3 made an error (tl.range over runtime sizes fails in every kernel).
    if TRITON_VERSION < (3, 7) and numpy_version >= (2, 3):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run with numpy "
            f"{numpy.__version__}: install numpy<2.3, or triton>=3.7"
        )
    return None


INTERPRETER_PROBLEM = _interpreter_problem() if INTERPRETED else None

_CUDA0 = torch.device("cuda", torch.cuda.current_device()) if _HAS_CUDA else None


def kernels_interpreted() -> bool:
    """Whether kernels run in Triton's interpreter in this process (machines without CUDA, or
    ``TRITON_INTERPRET=1`` set before triton was imported)."""
    return INTERPRETED


def check_device(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for tensors on devices flashlite cannot run on."""
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{name} is on device {t.device}; flashlite runs on 'cuda' (compiled Triton) "
            "and 'cpu' (Triton interpreter, or the GPU when there is one) tensors"
        )


def compute_device(device: torch.device) -> torch.device:
    """Where kernels for tensors on ``device`` run: the device itself, except CPU tensors in a
    process that compiles its kernels, which run on the current CUDA device (the front-end
    moves them there once per call and the results back)."""
    if INTERPRETER_PROBLEM is not None:
        raise RuntimeError(f"flashlite cannot run kernels in this process: {INTERPRETER_PROBLEM}")
    if device.type == "cuda" or INTERPRETED:
        return device
    if _CUDA0 is not None:
        return _CUDA0
    raise RuntimeError(
        "flashlite cannot run kernels in this process: there is no CUDA device, and `triton` "
        "was imported before flashlite without TRITON_INTERPRET=1, so its functions were "
        "created for compilation, not for the interpreter. Import flashlite before triton, "
        "or set TRITON_INTERPRET=1 in the environment before starting Python."
    )


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 (bf16 in the interpreter is wrong)."""
    return dtype == torch.bfloat16 and INTERPRETED


def round_bf16(dtype: torch.dtype) -> bool:
    """Whether kernels must round fp32 → bf16 themselves (the interpreter truncates)."""
    return dtype == torch.bfloat16 and INTERPRETED


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _private_api_error(what: str, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"flashlite uses Triton's {what}, which triton {triton.__version__} does not provide "
        f"as expected ({type(err).__name__}: {err}); flashlite is tested with triton "
        f"{'.'.join(map(str, MIN_TRITON))} to 3.9"
    )


@functools.cache
def cooperative_launch_supported() -> bool:
    """Whether this Triton can launch a cooperative grid (all programs resident at once)."""
    try:  # private: the CUDA backend's option list
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


_resident: dict[tuple[int, Any], int] = {}


def resident_programs(compiled: Any, index: int) -> int:
    """How many programs of a compiled kernel fit on CUDA device ``index`` at once (cached per
    compiled kernel: registers and shared memory do not change)."""
    key = (index, compiled.hash if hasattr(compiled, "hash") else id(compiled))
    if key in _resident:
        return _resident[key]
    try:  # private: the compiled kernel's resource usage
        if not hasattr(compiled, "n_regs"):  # loaded lazily
            compiled._init_handles()
        n_regs, meta = compiled.n_regs, compiled.metadata
        num_warps, shared = meta.num_warps, meta.shared
    except AttributeError as err:
        raise _private_api_error("CompiledKernel.n_regs / metadata", err) from err
    props = torch.cuda.get_device_properties(index)
    threads = 32 * num_warps
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256  # allocated per warp, by 256
    per_sm = min(
        getattr(props, "max_threads_per_multi_processor", 2048) // threads,
        getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * threads // 32),
        32,
    )
    if shared:  # the driver reserves 1 KB of each block's shared memory for itself (sm_80+)
        smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
        per_sm = min(per_sm, smem // (shared + 1024))
    _resident[key] = per_sm * props.multi_processor_count
    return _resident[key]


# ----------------------------------------------------------------------------- launching
#: Triton versions whose compiled-kernel launch (``JITFunction.warmup`` returning a
#: ``CompiledKernel``, ``CompiledKernel[grid](*all_args)``) :class:`Launcher` was written against.
_DIRECT_LAUNCH_TESTED = ((3, 4), (3, 9))
_LAUNCH_CACHE_LIMIT = 4096


class Launcher:
    """``kernel[grid](*args, **options)``, with Triton's per-call argument binding done once.

    ``JITFunction.run`` binds and specialises every argument on every call (about 15 µs of host
    time for the attention kernel's 30 arguments, more than its whole GPU time at small shapes).
    Here the compiled kernel is looked up by a key that pins everything Triton specialises on —
    each tensor's dtype and 16-byte alignment, the exact value of every other argument, the
    options and the device — and launched directly. Keys beyond the cache's limit start it
    afresh. Interpreted kernels, tensor-descriptor arguments and untested Triton versions take
    Triton's own path.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, tuple[Any, list[Any]]] = {}
        low, high = _DIRECT_LAUNCH_TESTED
        self.direct = not INTERPRETED and low <= TRITON_VERSION <= high

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.bind(args, options)(grid3, *args)

    def bind(self, args: tuple, options: dict) -> Callable[..., None]:
        """``launch(grid, *args)`` (``grid`` of three) for calls whose arguments specialise as
        ``args`` do (the same tensor dtypes and 16-byte alignment, the same value of every other
        argument): the compiled kernel looked up once. A caller that keeps the result must pin
        all that in its own key (a decode loop's plan does:
        :class:`flashlite.ops.attention.DecodePlan`)."""
        key = self._key(args, options) if self.direct else None
        if key is None:
            kernel = self.kernel
            return lambda grid, *a: kernel[grid](*a, **options)
        entry = self.compiled.get(key)
        if entry is None:
            if len(self.compiled) >= _LAUNCH_CACHE_LIMIT:
                self.compiled.clear()
            entry = self.compiled[key] = self._compile(args, options)
        compiled, constants = entry
        raw = _raw_launch(compiled)
        if raw is None:
            return lambda grid, *a: compiled[grid](*a, *constants)
        launch, function, coop, pdl, packed = raw
        hooks = _launch_hooks()

        def run(grid: tuple[int, int, int], *a: Any) -> None:
            if _listening(hooks.launch_enter_hook) or _listening(hooks.launch_exit_hook):
                compiled[grid](*a, *constants)
                return
            stream = _current_stream(_current_device())
            launch(*grid, stream, function, coop, pdl, None, None, packed, None, None, None, *a,
                   *constants)  # fmt: skip

        return run

    @staticmethod
    def _key(args: tuple, options: dict) -> tuple | None:
        key: list[Any] = []
        device = None
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
                device = a.device.index
            elif isinstance(a, (int, float)):  # bool is an int: its value is kept too
                key.append((type(a), a))
            else:  # tensor descriptors and anything else: Triton's own path
                return None
        key.append(device)
        key.append(tuple(options.items()))
        return tuple(key)

    def _compile(self, args: tuple, options: dict) -> tuple[Any, list]:
        try:  # private: warmup's return value and the compiled kernel's launch
            compiled = self.kernel.warmup(*args, grid=(1,), **options)
            defaults = {p.name: p.default for p in self.kernel.params}
            constants = [options.get(n, defaults[n]) for n in self.kernel.arg_names[len(args) :]]
            compiled.__getitem__  # noqa: B018
        except (AttributeError, KeyError, TypeError) as err:
            raise _private_api_error("JITFunction.warmup / CompiledKernel launch", err) from err
        return compiled, constants


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


def _launch_hooks() -> Any:
    """Triton's runtime knobs, whose launch hooks are empty (falsy) unless a profiler listens."""
    from triton import knobs

    return knobs.runtime


def _listening(hook: Any) -> bool:
    """Whether a launch hook is set: 3.6's default is an empty ``HookChain`` (a profiler such as
    Proton adds to it), or a user's function."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


try:  # the raw stream handle without a Stream object (what Triton's own launch reads)
    from torch._C import _cuda_getCurrentRawStream as _current_stream  # noqa: F811
    from torch._C import _cuda_getDevice as _current_device  # noqa: F811
except ImportError:  # pragma: no cover - a CPU-only torch
    pass


_launchers: dict[int, Launcher] = {}


def teams_fit(n_chunks: int, device: torch.device) -> bool:
    """Whether :func:`launch_teams` can run teams of ``n_chunks`` programs on ``device``: on a
    GPU with cooperative launches and no more programs to a team than SMs; in the interpreter
    only single-program teams."""
    if device.type != "cuda":
        return n_chunks == 1
    return cooperative_launch_supported() and n_chunks <= num_sms(device.index or 0)


def launch_teams(kernel: Any, args: list[Any], options: dict[str, Any], n_chunks: int,
                 n_rows: int, device: torch.device) -> int:  # fmt: skip
    """Launch a kernel whose programs work in teams of ``n_chunks`` that wait for each other
    (the team softmax), over ``n_rows`` rows; its last argument is the number of
    teams, which this picks and returns.

    On a GPU every program must be resident at once, or a wait never ends: the grid is sized
    from the compiled kernel's registers and shared memory, and launched as a cooperative grid,
    which the driver refuses (rather than hangs) should that ever fall short. The interpreter
    runs programs one after another, so there teams must be single programs; three of them take
    turns over the rows."""
    if device.type != "cuda":
        if not teams_fit(n_chunks, device):
            raise ValueError(f"teams of {n_chunks} programs need a CUDA device")
        n_teams = min(n_rows, 3)
        kernel[(n_teams,)](*args, n_teams, **options)
        return n_teams
    options, n_teams = _cooperative_teams(kernel, args, options, n_chunks, n_rows, device)
    launcher(kernel)[(n_teams * n_chunks,)](*args, n_teams, **options)
    return n_teams


def bind_teams(kernel: Any, args: list[Any], options: dict[str, Any], n_chunks: int,
               n_rows: int, device: torch.device) -> Callable[..., None]:  # fmt: skip
    """:func:`launch_teams`, planned once: ``launch(*args)`` for calls whose arguments
    specialise as ``args`` do (the same tensor dtypes and 16-byte alignment, the same value of
    every other argument: the caller keeps it under a key that pins all that), without the
    per-call planning and argument binding."""
    if device.type != "cuda":
        return lambda *a: launch_teams(kernel, list(a), options, n_chunks, n_rows, device)
    options, n_teams = _cooperative_teams(kernel, args, options, n_chunks, n_rows, device)
    bound = launcher(kernel).bind((*args, n_teams), options)
    grid = (n_teams * n_chunks, 1, 1)
    return lambda *a: bound(grid, *a, n_teams)


def _cooperative_teams(
    kernel: Any,
    args: list[Any],
    options: dict[str, Any],
    n_chunks: int,
    n_rows: int,
    device: torch.device,
) -> tuple[dict[str, Any], int]:
    """The options of a cooperative launch, and how many teams of ``n_chunks`` programs fit on
    ``device`` at once (at most one per row): from the compiled kernel's resources, which the
    options and the tensors' dtypes and alignment fix, so found once per such key (a warmup
    costs as much host time as a launch)."""
    options = dict(options, launch_cooperative_grid=True)
    tensors = tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor))
    key = (id(kernel), device.index, n_chunks, n_rows, tuple(options.items()), tensors)
    n_teams = _team_counts.get(key)
    if n_teams is None:
        compiled = kernel.warmup(*args, n_rows, grid=(1,), **options)
        capacity = resident_programs(compiled, device.index or 0)
        n_teams = max(1, min(n_rows, capacity // n_chunks))
        if len(_team_counts) >= _LAUNCH_CACHE_LIMIT:
            _team_counts.clear()
        _team_counts[key] = n_teams
    return options, n_teams


_team_counts: dict[tuple, int] = {}


def launcher(kernel: Any) -> Launcher:
    """The :class:`Launcher` of ``kernel`` (one per kernel object, made on first use)."""
    found = _launchers.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _launchers[id(kernel)] = Launcher(kernel)
    return found


# ----------------------------------------------------------------------------- interpreter hooks
#: Triton versions whose interpreter :func:`interpreter_memory_hooks` was written against:
#: ``interpreter_builder.create_masked_load(ptrs, mask, ...)``, ``create_masked_store(ptrs,
#: value, mask, ...)`` (every load and store path ends in one of them) and
#: ``GridExecutor.__call__(self, *args)`` (one kernel launch, ``self.fn`` the kernel).
_MEMORY_HOOKS_TESTED = ((3, 4), (3, 9))

#: ``hook(addresses, mask, itemsize)``: one interpreted load or store, as numpy arrays of int64
#: addresses and of the mask (broadcastable to the addresses), and the bytes of one element.
AccessHook = Callable[["np.ndarray", "np.ndarray", int], None]
#: ``hook(kernel_name)``: a context manager the whole launch runs inside (the interpreter's own
#: torch ops that move arguments to and from the host included).
LaunchHook = Callable[[str], AbstractContextManager[Any]]


def _memory_hook_points() -> tuple[Any, Any]:
    """The interpreter's builder instance and launch class, checked where Triton is untested."""
    try:  # private: the interpreter's module-level builder and its grid executor
        from triton.runtime import interpreter as interp

        builder, executor = interp.interpreter_builder, interp.GridExecutor
        load, store = builder.create_masked_load, builder.create_masked_store
        call = executor.__call__
        low, high = _MEMORY_HOOKS_TESTED
        if not low <= TRITON_VERSION <= high:
            # the wrappers pass ptrs/value/mask by position: an untested Triton must agree
            params = [list(inspect.signature(f).parameters) for f in (load, store, call)]
            if params[0][:2] != ["ptrs", "mask"] or params[1][:3] != ["ptrs", "value", "mask"]:
                raise TypeError(f"unexpected parameters {params[0]}, {params[1]}")
            if params[2][:1] != ["self"]:
                raise TypeError(f"unexpected GridExecutor.__call__ parameters {params[2]}")
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise _private_api_error(
            "interpreter hook points (interpreter_builder.create_masked_load / "
            "create_masked_store, GridExecutor.__call__)",
            err,
        ) from err
    return builder, executor


def _itemsize(ptrs: Any) -> int:
    # int1 tensors live in memory as one byte per element
    return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)


@contextlib.contextmanager
def interpreter_memory_hooks(
    on_load: AccessHook | None = None,
    on_store: AccessHook | None = None,
    on_launch: LaunchHook | None = None,
) -> Iterator[None]:
    """Inside the block, report every load and store Triton's interpreter executes, and run
    every interpreted kernel launch inside ``on_launch(kernel_name)``.

    The only place flashlite reaches into the interpreter (for the traffic counters): the
    builder's masked load/store and ``GridExecutor.__call__`` are wrapped for the duration of
    the block and always restored, also when it raises. Blocks may nest (the inner wrappers
    call the outer ones); they must not interleave. Only kernels that run interpreted are seen.

    Raises RuntimeError naming ``triton.__version__`` when this Triton's interpreter lacks the
    hook points (or, outside the tested versions, has them with other parameters).
    """
    builder, executor = _memory_hook_points()
    # what was there before: an instance attribute only if an outer block installed one
    saved = {n: vars(builder).get(n) for n in ("create_masked_load", "create_masked_store")}
    saved_call = vars(executor).get("__call__")
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def hooked_load(ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        on_load(ptrs.data, mask.data, _itemsize(ptrs))  # type: ignore[misc]
        return load(ptrs, mask, *args, **kwargs)

    def hooked_store(ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        on_store(ptrs.data, mask.data, _itemsize(ptrs))  # type: ignore[misc]
        return store(ptrs, value, mask, *args, **kwargs)

    def hooked_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with on_launch(self.fn.__name__):  # type: ignore[misc]
            return call(self, *args, **kwargs)

    try:
        if on_load is not None:
            builder.create_masked_load = hooked_load
        if on_store is not None:
            builder.create_masked_store = hooked_store
        if on_launch is not None:
            executor.__call__ = hooked_call
        yield
    finally:
        for name, before in saved.items():
            if before is not None:
                setattr(builder, name, before)
            elif name in vars(builder):
                delattr(builder, name)  # back to the class's method
        if saved_call is not None:
            executor.__call__ = saved_call
        elif "__call__" in vars(executor):
            del executor.__call__
