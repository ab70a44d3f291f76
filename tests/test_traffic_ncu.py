"""Measuring with ncu: its CSV parsed, kernels attributed to ranges through a stand-in ncu, the
child that runs inside it, no GPU or no ncu said plainly, and one measured config on a GPU."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from traffic_helpers import _shape

from flashlite import traffic
from flashlite.traffic import AttentionShape, measure, ncu

DATA = Path(__file__).parent / "data"


def test_parse_ncu_csv_units_and_separators() -> None:
    kernels = traffic.parse_ncu_csv((DATA / "ncu_sample.csv").read_text())
    assert [k.id for k in kernels] == [0, 1, 2]
    assert kernels[0].name == "flt_0000_"
    assert kernels[0].read == pytest.approx(8.42e6)
    assert kernels[0].write == pytest.approx(1234.56e3)  # "1,234.56" Kbyte
    assert (kernels[1].read, kernels[1].write) == (2048, 512)
    assert kernels[2].read == pytest.approx(1.07e9)
    assert kernels[2].write == pytest.approx(268.44e6)


def test_parse_ncu_csv_quoted_kernel_names() -> None:
    kernels = traffic.parse_ncu_csv((DATA / "ncu_sample_kernels.csv").read_text())
    assert len(kernels) == 2
    assert kernels[0].name.startswith("void at::native::") and "BFloat16, float" in kernels[0].name
    assert kernels[1].read == pytest.approx(3145.73e3)


def test_parse_ncu_csv_without_table() -> None:
    assert traffic.parse_ncu_csv("==PROF== No kernels were profiled.\n") == []
    with pytest.raises(ValueError, match="unit"):
        ncu._ncu_value("1", "furlong")


def _fake_ncu(tmp_path: Path) -> Path:
    """A stand-in ncu: writes the child's report and prints the stored sample CSV."""
    script = tmp_path / "ncu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "spec = json.load(open(sys.argv[-1]))\n"
        "json.dump({'errors': {}, 'configs': {}}, open(spec['report'], 'w'))\n"
        f"print(open({str(DATA / 'ncu_sample.csv')!r}).read())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_measure_attributes_kernels_to_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(_fake_ncu(tmp_path)))
    shapes = [AttentionShape(1, 1, 64, 16), AttentionShape(1, 1, 128, 16)]
    m = traffic.measure_attention("naive", shapes)
    assert m.message == ""
    assert m.traffic[0] is not None and m.traffic[1] is not None
    assert m.traffic[0].read == round(8.42e6) + 2048  # two kernels in range 0
    assert m.traffic[1].write == round(268.44e6)


def test_measure_child_runs_compiled_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # TRITON_INTERPRET=1 (set for counting) must not reach the measured child
    seen = tmp_path / "interpret.txt"
    script = _fake_ncu(tmp_path)
    script.write_text(
        script.read_text()
        + f"open({str(seen)!r}, 'w').write(__import__('os').environ.get('TRITON_INTERPRET', '-'))\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(script))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shapes = [AttentionShape(1, 1, 64, 16), AttentionShape(1, 1, 128, 16)]  # as the sample
    m = traffic.measure_attention("naive", shapes)
    assert m.message == ""
    assert seen.read_text() == "-"


def test_measure_without_gpu_or_ncu(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = AttentionShape(1, 1, 64, 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m = traffic.measure_attention("flashlite", [shape])
    assert m.traffic == [None] and "CUDA" in m.message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "find_ncu", lambda: None)
    m = traffic.measure_attention("flashlite", [shape])
    assert m.traffic == [None] and "ncu" in m.message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_one_config_on_gpu() -> None:
    if traffic.find_ncu() is None:
        pytest.skip("ncu not found")
    shape = AttentionShape(1, 8, 2048, 64, dtype=torch.bfloat16)
    m = traffic.measure_attention("flashlite", [shape], timeout=300)
    if m.traffic[0] is None and "permitted" in m.message:
        pytest.skip(m.message)
    assert m.traffic[0] is not None, m.message
    comp = traffic.compulsory_attention(shape)
    # caches are flushed before the kernel: Q, K, V must come from DRAM at least once
    assert m.traffic[0].read >= 0.9 * comp.read
    assert os.environ.get("FLASHLITE_ATTENTION_CONFIG") or m.configs.get(0)
    # the backward alone: its kernels read Q, K, V, O, dO (and the statistics) at least once,
    # and naive autograd's N x N tensors make it move more
    bwd = {meth: traffic.measure_attention(meth, [shape], timeout=300, backward=True)
           for meth in ("flashlite", "naive")}  # fmt: skip
    flash, naive = bwd["flashlite"].traffic[0], bwd["naive"].traffic[0]
    assert flash is not None, bwd["flashlite"].message
    assert naive is not None, bwd["naive"].message
    assert flash.read >= 0.9 * 5 * comp.read / 3 and naive.total > flash.total


@pytest.mark.interpreter
def test_ncu_child_runs_one_range_per_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # what runs inside ncu, on CPU: warm-up outside the ranges, one range per shape/algorithm
    from flashlite.traffic import measure

    ranges: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", ranges.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    shapes = [_shape(1, 1, 1, 16, 16, 16, torch.float32, False).to_json()] * 2
    for spec in (
        {"method": "naive", "shapes": shapes},
        {"kind": "softmax", "rows": 2, "n": 40, "dtype": "float32",
         "algorithms": ["online", "torch"]},
        {"kind": "attention_bwd", "method": "flashlite", "shapes": shapes},
        {"kind": "attention_bwd", "method": "naive", "shapes": shapes},
    ):  # fmt: skip
        report_path = tmp_path / "report.json"
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({**spec, "device": "cpu", "report": str(report_path)}))
        ranges.clear()
        measure._child_main(str(spec_path))
        assert ranges == ["flt_0000_", "flt_0001_"]
        assert json.loads(report_path.read_text())["errors"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_estimates_against_ncu() -> None:
    """FP8's byte estimates against Nsight Compute at two forward points (plain and causal) and
    one FP8-cache decode: within 30% (the forward's DRAM estimate) and 20% (the decode's model,
    whose cache is read once)."""
    if traffic.find_ncu() is None:
        pytest.skip("ncu not found")
    fp8 = torch.float8_e4m3fn
    shapes = [AttentionShape(1, 16, 4096, 128, dtype=fp8),
              AttentionShape(1, 16, 16384, 128, dtype=fp8, causal=True)]  # fmt: skip
    m = traffic.measure_attention("flashlite", shapes, timeout=300)
    if m.traffic[0] is None and "permitted" in m.message:
        pytest.skip(m.message)
    for shape, got in zip(shapes, m.traffic, strict=True):
        assert got is not None, m.message
        est = traffic.dram_flashlite_attention(shape)
        assert 0.7 * est.total <= got.total <= 1.3 * est.total, (shape, got.total, est.total)
    decode = AttentionShape(1, 32, 1, 128, seq_k=131072, kv_heads=8, dtype=fp8, causal=True)
    rows, notes = traffic.decode_rows([decode], measure=True, show_progress=False)
    row = rows[0]
    assert row["measured_bytes"] is not None, notes
    assert 0.8 <= row["measured_bytes"] / row["model_bytes"] <= 1.25, row
