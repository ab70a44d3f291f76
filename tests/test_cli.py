"""The ``flashlite`` command, run in-process: JSON schemas, plots, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashlite import cli

TRAFFIC_KEYS = {
    "method",
    "seq_len",
    "model_bytes",
    "counted_bytes",
    "measured_bytes",
    "compulsory_bytes",
}


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> object:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.interpreter
def test_traffic_json_schema(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "t.png"
    rows = _json(
        capsys,
        [
            "traffic",
            "--seq",
            "16",
            "24",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--causal",
            "--count",
            "--json",
            "--quiet",
            "--plot",
            str(plot),
        ],
    )
    assert isinstance(rows, list) and len(rows) == 4
    for r in rows:
        assert set(r) >= TRAFFIC_KEYS
        assert r["measured_bytes"] is None
        assert r["method"] in ("naive", "flashlite")
        if r["method"] == "flashlite":
            assert r["counted_bytes"] == r["model_bytes"]
        else:
            assert r["counted_bytes"] == pytest.approx(r["model_bytes"], rel=0.01)
        assert r["model_bytes"] >= r["compulsory_bytes"]
    assert plot.stat().st_size > 0


def test_traffic_table_model_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["traffic", "--seq", "1024", "4096", "--head-dim", "64", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["method", "seq", "model"]
    assert "vs compulsory" in out and "flashlite" in out and "naive" in out


def test_traffic_measure_without_gpu_does_not_crash(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rows = _json(capsys, ["traffic", "--seq", "64", "--measure", "--json", "--quiet"])
    assert isinstance(rows, list) and {r["method"] for r in rows} == {
        "naive",
        "flashlite",
        "sdpa-flash",
        "sdpa-cudnn",
    }
    assert all(r["measured_bytes"] is None for r in rows)
    assert all(set(r) >= TRAFFIC_KEYS for r in rows)


def test_softmax_json(capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(capsys, ["softmax", "--rows", "3", "--n", "50", "--algorithm", "online", "--json"])
    assert isinstance(r, dict) and r["max_abs_error"] < 1e-5 and r["algorithm"] == "online"


def test_attention_json(capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(capsys, ["attention", "--seq", "20", "--seq-k", "30", "--causal", "--json"])
    assert isinstance(r, dict) and r["max_abs_error"] < 1e-4 and r["seq_k"] == 30


@pytest.mark.interpreter
def test_demo_writes_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    assert cli.main(["demo", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT" not in out and plot.stat().st_size > 0


def test_bench_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 0
    assert "bench_traffic.py" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([])


def test_counting_commands_rerun_where_kernels_are_interpreted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a process that compiles for its GPU cannot interpret kernels: the CLI re-runs the command
    # in one that does (TRITON_INTERPRET=1) instead of counting nothing
    from flashlite import _backend

    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(_backend, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    argv = ["traffic", "--seq", "16", "--count", "--json"]
    assert cli.main(argv) == 0
    ((cmd, env),) = calls
    assert cmd[-len(argv) :] == argv and cmd[1:3] == ["-m", "flashlite.cli"]
    assert env["TRITON_INTERPRET"] == "1"
