"""HBM traffic of softmax: every algorithm's byte model equals the interpreter's count, the
GPU-only kernels' models read x once, and the DRAM estimate re-reads rows that outgrow L2.

Counted bytes come from running the real code: Triton kernels in the interpreter (every executed
load/store, active lanes only) and torch ops through a dispatch mode. Shapes are tiny: the
interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from flashlite import traffic
from flashlite.kernels import softmax as softmax_kernels


@pytest.mark.interpreter
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize(
    ("algorithm", "rows", "n"),
    [
        ("three_pass", 3, 100),
        ("three_pass", 2, 4100),  # two tiles, the second partial
        ("online", 3, 37),
        ("online", 2, 4100),
        ("single_read", 5, 37),  # several rows per program, the last program partial
        ("single_read", 2, 1000),
        ("auto", 3, 513),
        ("split", 2, 9000),  # two chunks per row, the workspace read C times per row
        ("split", 3, 17000),
    ],
)
def test_softmax_counted_equals_model(algorithm: str, rows: int, n: int, log: bool) -> None:
    dtype = torch.float16
    counted = traffic.count_softmax(rows, n, dtype, algorithm, log=log)
    model = traffic.model_softmax(rows, n, dtype, algorithm)
    assert (counted.read, counted.write) == (model.read, model.write)


def test_softmax_model_ratios() -> None:
    # the byte table of flashlite.kernels.softmax: 4b, 3b, 2b per element
    comp = traffic.compulsory_softmax(64, 1024, torch.bfloat16).total
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "three_pass").total == 2 * comp
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "online").total * 2 == 3 * comp
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "single_read").total == comp
    with pytest.raises(ValueError, match="algorithm"):
        traffic.model_softmax(1, 8, torch.float32, "fast")


def test_team_softmax_model_reads_once() -> None:
    # GPU-only kernel (model only): one read and one write of x plus the (m, s) workspace
    rows, n = 8, 262144
    t = traffic.model_softmax(rows, n, torch.bfloat16, "team")
    e = rows * n * 2
    chunks = -(-n // (softmax_kernels.TEAM_CHUNK_BYTES[2] // 2))  # chunks of bf16
    assert t.parts["x"] == [e, 0] and t.parts["y"] == [0, e]
    assert t.parts["workspace"] == [8 * rows * chunks**2, 8 * rows * chunks]
    assert t.parts["counters"] == [0, 4 * rows]


def test_prefetch_softmax_model_reads_once() -> None:
    # GPU-only Gluon kernel (model only): one read and one write of x plus one word per chunk
    from flashlite.kernels import softmax_gluon

    rows, n = 8, 262144
    t = traffic.model_softmax(rows, n, torch.bfloat16, "prefetch")
    e = rows * n * 2
    chunks = -(-n // (softmax_gluon.CHUNK_BYTES // 2))
    assert t.parts["x"] == [e, 0] and t.parts["y"] == [0, e]
    assert t.parts["workspace"] == [8 * rows * chunks**2, 2 * 8 * rows * chunks]
    d = traffic.dram_softmax(rows, n, torch.bfloat16, "prefetch")
    assert d.parts["x"] == [e, 0]


@pytest.mark.interpreter
def test_softmax_rows_issued_counted_and_dram() -> None:
    rows, notes = traffic.softmax_rows(8, 3000, torch.float16, count=True)
    by = {r["method"]: r for r in rows}
    e = 8 * 3000 * 2
    # the lesson in bytes: three passes read x three times, the online form twice, single-read once
    assert by["flashlite-three_pass"]["model_read"] == 3 * e
    assert by["flashlite-online"]["model_read"] == 2 * e
    assert by["flashlite-single_read"]["model_read"] == e
    for name in ("flashlite-three_pass", "flashlite-online", "flashlite-single_read"):
        assert by[name]["counted_bytes"] == by[name]["model_bytes"]
        assert by[name]["dram_read"] == e  # small rows stay in L2 between the passes
    assert by["flashlite-team"]["counted_bytes"] is None  # GPU-only: modelled
    assert by["flashlite-prefetch"]["counted_bytes"] is None
    assert not notes


def test_softmax_dram_rereads_when_rows_outgrow_l2() -> None:
    for algorithm, passes in (("three_pass", 3), ("online", 2), ("single_read", 1)):
        fits = traffic.dram_softmax(1024, 4096, torch.float32, algorithm)
        tight = traffic.dram_softmax(1024, 4096, torch.float32, algorithm, l2_bytes=2**20)
        assert fits.info["x_reads"] == 1 and tight.info["x_reads"] == passes
    split = traffic.dram_softmax(64, 262144, torch.float32, "split")
    assert split.info["x_reads"] == 2  # two kernels, each from a cold L2
