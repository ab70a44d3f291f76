"""Cooperative "team" launches: kernels whose programs of one row wait for each other (the team
softmax, the Gluon prefetching teams of softmax and cross-entropy), so every program of a grid
must be resident at once. The grid is sized from the compiled kernel's registers and shared
memory (Triton's private metadata, read by :mod:`flashlite._launch`) and launched as
a cooperative grid, which the driver refuses rather than hangs should that ever fall short."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashlite._backend import num_sms
from flashlite._caches import Cache
from flashlite._launch import (
    compile_for,
    compiled_resources,
    cooperative_launch_supported,
    launcher,
    triton_launch,
)

_resident = Cache("launch.resident", 1024)


def resident_programs(compiled: Any, index: int) -> int:
    """How many programs of a compiled kernel fit on CUDA device ``index`` at once (cached per
    compiled kernel: registers and shared memory do not change)."""
    key = (index, compiled.hash if hasattr(compiled, "hash") else id(compiled))
    if key in _resident:
        return _resident[key]
    n_regs, num_warps, shared = compiled_resources(compiled)
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
    return _resident.put(key, per_sm * props.multi_processor_count)


def teams_fit(n_chunks: int, device: torch.device) -> bool:
    """Whether :func:`launch_teams` can run teams of ``n_chunks`` programs on ``device``: on a
    GPU with cooperative launches and no more programs to a team than SMs; in the interpreter
    only single-program teams."""
    if device.type != "cuda":
        return n_chunks == 1
    return cooperative_launch_supported() and n_chunks <= num_sms(device.index or 0)


def launch_teams(
    kernel: Any,
    args: list[Any],
    options: dict[str, Any],
    n_chunks: int,
    n_rows: int,
    device: torch.device,
) -> int:
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
        triton_launch(kernel, options)((n_teams,), *args, n_teams)
        return n_teams
    options, n_teams = _cooperative_teams(kernel, args, options, n_chunks, n_rows, device)
    launcher(kernel)[(n_teams * n_chunks,)](*args, n_teams, **options)
    return n_teams


def bind_teams(
    kernel: Any,
    args: list[Any],
    options: dict[str, Any],
    n_chunks: int,
    n_rows: int,
    device: torch.device,
) -> Callable[..., None]:
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
        compiled = compile_for(kernel, (*args, n_rows), options)
        capacity = resident_programs(compiled, device.index or 0)
        n_teams = max(1, min(n_rows, capacity // n_chunks))
        _team_counts.put(key, n_teams)
    return options, n_teams


_team_counts = Cache("launch.teams", 1024)
