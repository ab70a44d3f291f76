"""Nsight Compute's side of the measurement: where ``ncu`` is (:func:`find_ncu`), the command
line that profiles the DRAM bytes of the kernels in given NVTX ranges (:func:`ncu_command`),
and its CSV read back as bytes per kernel (:func:`parse_ncu_csv`)."""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass


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


def ncu_command(ncu: str, ranges: Sequence[str], rename: bool) -> list[str]:
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
