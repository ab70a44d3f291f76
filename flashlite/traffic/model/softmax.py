"""The row softmax's bytes: the compulsory floor, the passes each kernel makes over x, and the
DRAM estimate."""

from __future__ import annotations

import torch

from flashlite.ops import softmax as softmax_ops
from flashlite.traffic.model.common import (
    GPUS,
    effective_l2,
    written_back,
)
from flashlite.traffic.shapes import (
    SOFTMAX_ALGORITHMS,
    SOFTMAX_GPU_ALGORITHMS,
    Traffic,
)


def softmax_plan(algorithm: str, n: int, elem_bytes: int) -> softmax_ops.RowPlan:
    """The front-end's own plan (:func:`flashlite.ops.softmax.row_plan`) for rows of ``n``
    elements of ``elem_bytes``: ``"auto"`` as a CPU decides it (one read when the row fits on
    chip, split otherwise; a GPU runs long rows with the prefetch or team kernel, one read
    each), any other kernel by name."""
    if algorithm != "auto" and algorithm not in SOFTMAX_ALGORITHMS + SOFTMAX_GPU_ALGORITHMS:
        accepted = ", ".join(("auto", *SOFTMAX_ALGORITHMS, *SOFTMAX_GPU_ALGORITHMS))
        raise ValueError(f"algorithm={algorithm!r} is not one of {accepted}")
    return softmax_ops.row_plan(n, elem_bytes, torch.device("cpu"), algorithm)


def resolve_softmax_algorithm(algorithm: str, n: int, elem_bytes: int) -> str:
    """The softmax kernel ``algorithm`` names for rows of ``n`` elements of ``elem_bytes``."""
    return softmax_plan(algorithm, n, elem_bytes).kernel


def compulsory_softmax(rows: int, n: int, dtype: torch.dtype) -> Traffic:
    """Read x once and write y once: ``rows·n·b`` each way."""
    b = torch.empty((), dtype=dtype).element_size()
    t = Traffic()
    t.add("x", rows * n * b, 0)
    t.add("y", 0, rows * n * b)
    return t


#: Reads of x per kernel: passes over each row.
_PASSES = {"three_pass": 3, "online": 2, "single_read": 1, "split": 2, "team": 1, "prefetch": 1}


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
    plan = softmax_plan(algorithm, n, elem_bytes)
    algorithm, chunks = plan.kernel, plan.chunks
    e = rows * n * elem_bytes
    t = Traffic()
    t.add("x", _PASSES[algorithm] * e, 0)
    t.add("y", 0, e)
    if algorithm == "split":
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
    elif algorithm == "team":
        t.add("workspace", 8 * rows * chunks * chunks, 8 * rows * chunks)
        t.add("counters", 0, 4 * rows)
    elif algorithm == "prefetch":
        t.add("workspace", 8 * rows * chunks * chunks, 2 * 8 * rows * chunks)
    return t


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
    :func:`written_back`.
    """
    l2 = effective_l2(gpu, l2_bytes)
    b = dtype.itemsize
    plan = softmax_plan(algorithm, n, b)
    algorithm = plan.kernel
    issued = model_softmax(rows, n, dtype, algorithm)
    e = rows * n * b
    passes = issued.parts["x"][0] // e if e else 1
    if algorithm in ("three_pass", "online") and passes > 1:
        warps = plan.num_warps
        in_flight = min(rows, GPUS[gpu].sms * max(1, 64 // warps))
        if in_flight * n * b <= l2:
            passes = 1
    t = Traffic(info={"algorithm": algorithm, "x_reads": passes})
    t.add("x", passes * e, 0)
    work_read, work_write = issued.parts.get("workspace", [0, 0])
    t.add("workspace", work_read, 0)
    if algorithm == "split":  # stats kernel: x → workspace; write kernel: x + workspace → y
        written = written_back(e, work_write, l2) + written_back(e + work_read, e, l2)
    else:
        written = written_back(t.read, issued.write, l2)
    t.add("y + workspace", 0, written)
    return t
