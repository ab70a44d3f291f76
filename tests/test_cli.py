"""The ``flashlite`` command, run in-process: JSON schemas, plots, exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flashlite import cli
from flashlite.cli import commands

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
    argv = ["traffic", "--seq", "16", "24", "--heads", "2", "--kv-heads", "1", "--causal"]
    assert cli.main([*argv, "--count", "--json", "--quiet", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)  # the plot's path goes to stderr: stdout stays pure JSON
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
    assert f"wrote plot: {plot.resolve()}" in captured.err


def test_traffic_table_model_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["traffic", "--seq", "1024", "4096", "--head-dim", "64", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["method", "config", "seq", "model"]
    assert "vs compulsory" in out and "flashlite" in out and "naive" in out


def test_traffic_measure_that_measured_nothing_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # past the usage checks, ncu can still fail (no permission to read the counters): then a
    # table and a note, and exit status 2, as --measure was the whole job and measured nothing
    from flashlite.cli import checks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(checks, "_check_measure", lambda table: None)
    assert cli.main(["traffic", "--seq", "64", "--measure", "--json", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "no CUDA device" in captured.err
    rows = json.loads(captured.out)
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
    assert r["tolerance"] == {"atol": 1e-5, "rtol": 1e-5, "rule": commands.TOLERANCE_RULE}


def test_attention_json(capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(capsys, ["attention", "--seq", "20", "--seq-k", "30", "--causal", "--json"])
    assert isinstance(r, dict) and r["max_abs_error"] < 1e-4 and r["seq_k"] == 30
    tol = r["tolerance"]  # the shape softmax's has: the bound is atol (2x torch's + a floor)
    assert set(tol) == {"atol", "rtol", "rule"} and tol["rtol"] == 0.0 and "tolerance_rule" not in r
    assert tol["rule"].startswith(commands.TOLERANCE_RULE) and "torch's own" in tol["rule"]
    assert r["ok"] is True and r["max_abs_error"] <= tol["atol"]
    # defaults are printed as the values they stand for, not null
    r = _json(capsys, ["attention", "--seq", "12", "--heads", "4", "--json"])
    assert r["seq_k"] == 12 and r["kv_heads"] == 4 and None not in r.values()


def test_accuracy_verdicts_set_the_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each accuracy line states its tolerance and a verdict; a FAIL exits 1
    assert cli.main(["softmax", "--rows", "2", "--n", "40", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "tolerance atol 0.008 + rtol 0.016" in out and out.rstrip().split(": ")[-1].startswith(
        "ok"
    )
    assert cli.main(["attention", "--seq", "9", "--dtype", "float16"]) == 0
    assert "tolerance atol " in (out := capsys.readouterr().out)
    assert "(2x torch's own error + floor): ok" in out
    monkeypatch.setitem(commands.SOFTMAX_TOL, torch.float32, (0.0, 0.0))
    monkeypatch.setitem(commands.ATTENTION_FLOOR, torch.float32, -1.0)
    assert cli.main(["softmax", "--rows", "3", "--n", "333"]) == 1
    assert ": FAIL" in capsys.readouterr().out
    assert cli.main(["attention", "--seq", "9"]) == 1
    assert ": FAIL" in capsys.readouterr().out


@pytest.mark.interpreter
def test_demo_writes_plot_where_asked_and_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    plot = tmp_path / "x.png"
    assert cli.main(["demo", "--out", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT" not in out and plot.stat().st_size > 0
    assert f"wrote plot: {plot.resolve()}" in out.splitlines()
    assert not any(cwd.iterdir())  # nothing left in the current folder


def test_demo_out_default_and_alias_are_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashlite.cli import commands

    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).out is None  # (the default is chosen when it runs)
    assert commands._default_plot() == tmp_path.resolve() / "flashlite-traffic.png"
    assert parser.parse_args(["demo", "--plot", "a.svg"]).out == tmp_path.resolve() / "a.svg"
    assert parser.parse_args(["traffic"]).plot is None


def test_demo_runs_without_matplotlib(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a bare install has no matplotlib: the demo runs its checks and says there is no plot
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib raises)
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "no plot: matplotlib is not installed" in out and "ok" in out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("name", "message"), [("missing/x.png", "does not exist"), ("x.txt", "must end in one of")]
)
def test_bad_plot_path_fails_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, message: str
) -> None:
    for argv in (["demo", "--out"], ["traffic", "--count", "--plot"]):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, str(tmp_path / name)])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    import triton

    import flashlite

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"flashlite {flashlite.__version__} ")
    assert f"torch {torch.__version__}" in out and f"triton {triton.__version__}" in out


COMMANDS = ["demo", "softmax", "attention", "traffic", "bench", "ring"]
NO_DEFAULT = {"-h, --help", "--version"}  # actions, not settings


def _option_entries(help_text: str) -> dict[str, str]:
    """The "options:" section of argparse's help as {flags: whole entry, wrapped lines joined}."""
    entries: dict[str, str] = {}
    section = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    flags = ""
    for line in section.splitlines():
        if line.startswith("  -"):
            flags = line.strip().split("  ")[0]
            entries[flags] = line.strip()
        else:
            entries[flags] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text_and_states_every_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str | None
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exc:
        cli.main([*([command] if command else []), "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":class:", ":mod:", "**"):
        assert markup not in text
    if command is None:
        assert all(c in text for c in COMMANDS) and "examples:" in text
    entries = _option_entries(text)
    assert "-h, --help" in entries
    for flags, entry in entries.items():
        if flags not in NO_DEFAULT:
            assert "(default: " in entry or "; default: " in entry, entry
            assert "None" not in entry and "False" not in entry, entry
    for flags, entry in entries.items():  # choices are listed
        if flags.startswith("--dtype"):
            assert all(d in entry for d in ("float16", "bfloat16", "float32"))
        if flags.startswith("--algorithm"):
            assert all(a in entry for a in ("auto", "three_pass", "online"))
        if flags.startswith("--methods"):
            assert all(m in entry for m in ("naive", "flashlite", "sdpa-flash", "sdpa-cudnn"))


def test_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 0
    assert "bench_traffic.py" in capsys.readouterr().out


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


@pytest.mark.interpreter
def test_traffic_names_the_counted_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["traffic", "--seq", "64", "--heads", "1", "--head-dim", "16", "--count", "--quiet"]
    assert cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    flash = [r for r in rows if r["method"] == "flashlite"]
    assert flash and all(r["config"] == "64x64x4x2" and r["gpu"] == "h200" for r in flash)
    assert cli.main([*argv, "--config", "32x16"]) == 0
    assert "32x16x4x2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--config", "48x64"])
    assert exit_info.value.code == 2
    assert "powers of two" in capsys.readouterr().err


def test_traffic_dram_column_and_l2_option(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["traffic", "--seq", "4096", "--heads", "16", "--head-dim", "128", "--quiet"]
    assert cli.main([*argv, "--dtype", "bfloat16"]) == 0
    assert "DRAM est MB" in capsys.readouterr().out
    rows = _json(capsys, [*argv, "--json", "--l2-mib", "1"])
    assert all(r["dram_bytes"] is not None for r in rows)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--l2-mib", "0"])
    assert exit_info.value.code == 2 and "must be a number > 0" in capsys.readouterr().err


@pytest.mark.interpreter
def test_traffic_softmax_and_measure_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["traffic", "--softmax", "--rows", "8", "--n", "500", "--count"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "flashlite-three_pass" in out and "flashlite-team" in out and "DRAM est MB" in out
    if not torch.cuda.is_available():  # --measure without a GPU: refused before it starts
        for extra in ([], ["--count"]):
            with pytest.raises(SystemExit) as exc:
                cli.main(["traffic", "--softmax", "--rows", "8", "--n", "500", "--measure", *extra])
            assert exc.value.code == 2
            assert "--measure needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["softmax", "--rows", "0"], "argument --rows: must be an integer >= 1, got 0"),
        (["softmax", "--n", "-5"], "argument --n: must be an integer >= 1, got -5"),
        (["softmax", "--rows", "x"], "argument --rows: expected an integer, got 'x'"),
        (["attention", "--head-dim", "300"], "--head-dim: must be an integer from 1 to 256"),
        (["attention", "--seq-k", "0"], "argument --seq-k: must be an integer >= 1"),
        (["attention", "--heads", "4", "--kv-heads", "3"], "--kv-heads=3 must divide --heads=4"),
        (["attention", "--device", "tpu"], "'tpu' is not a device: cpu, cuda or cuda:N"),
        (["traffic", "--seq", "64", "0"], "argument --seq: must be an integer >= 1, got 0"),
        (["traffic", "--l2-mib", "-1"], "argument --l2-mib: must be a number > 0, got -1"),
        (["traffic", "--decode", "--decode-q", "0"], "argument --decode-q: must be an integer"),
        (["ring", "--nproc", "0"], "argument --nproc: must be an integer >= 1, got 0"),
        (["ring", "--head-dim", "0"], "argument --head-dim: must be an integer from 1 to 256"),
    ],
)
def test_bad_numbers_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # every numeric option is checked by argparse: a usage error naming the option and the
    # accepted range (exit 2), never a traceback or a run on nonsense sizes
    _usage_error(capsys, argv, message)


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> str:
    """Run ``argv``, expect a usage error of its sub-command naming ``message``; its stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    command = argv[0]
    # the sub-command's usage, not the top level's, and its name before the error
    assert err.startswith(f"usage: flashlite {command} [-h]"), err
    assert f"\nflashlite {command}: error: " in err and message in err, err
    assert out == "" and "Traceback" not in err
    return err


def test_a_cuda_device_without_cuda_is_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    for command in ("softmax", "attention", "traffic"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--device", "cuda"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --device: 'cuda': this torch" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attention", "--heads", "3", "--kv-heads", "2"], "--kv-heads=2 must divide --heads=3"),
        (["attention", "--bogus"], "unrecognized arguments: --bogus"),
        (["ring", "--seq", "3"], "--seq=3 must be a multiple of 4: 2 ranks hold two zigzag"),
        (["ring", "--contiguous", "--nproc", "3", "--seq", "8"], "--seq=8 must be a multiple of 3"),
        (["ring", "--heads", "4", "--kv-heads", "3"], "--kv-heads=3 must divide --heads=4"),
        (["traffic", "--softmax", "--decode"], "--softmax and --decode show different tables"),
        (["traffic", "--mask", "causal", "--ce", "--backward"], "--ce and --mask and --backward"),
        (["traffic", "--backward", "--plot", "x.png"], "--plot applies to the attention forward"),
        (["traffic", "--decode", "--methods", "naive"], "--methods applies to the attention"),
        (["traffic", "--softmax", "--config", "64x64"], "--config applies to the attention"),
        (["traffic", "--ce-weight"], "--ce-weight needs --ce"),
        (["traffic", "--shared-prefix", "8", "--decode-q", "2"], "--decode-q=2 with --shared-pre"),
        (["traffic", "--ce", "--measure"], "--measure does not cover --ce"),
        (["traffic", "--shared-prefix", "8", "--measure"], "--measure does not cover --shared"),
        (["traffic", "--config", "48x64"], "argument --config: config='48x64': BM and BN must"),
        (["demo", "--config", "1x2"], "argument --config: "),
    ],
)
def test_usage_errors_name_the_option_under_the_commands_usage(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    # options that do not go together or sizes that do not fit: checked before any work, and
    # reported as argparse reports a bad number (exit 2, the sub-command's usage and name)
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, argv, message)


@pytest.mark.parametrize("missing", ["cuda", "ncu"])  # ("gpu" would be the gpu marker)
def test_traffic_measure_refuses_without_a_gpu_or_ncu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    # --measure without what it needs stops before any progress bar or table, saying what is
    # missing (with or without --count: a half-done --measure is not what was asked for)
    import flashlite.traffic

    monkeypatch.setattr(torch.cuda, "is_available", lambda: missing != "cuda")
    monkeypatch.setattr(flashlite.traffic, "find_ncu", lambda: None)
    want = "--measure needs a CUDA GPU" if missing == "cuda" else "--measure needs Nsight Compute"
    for extra in ([], ["--count"], ["--backward"], ["--mask", "causal"], ["--decode"]):
        err = _usage_error(capsys, ["traffic", "--seq", "64", "--measure", *extra], want)
        assert "%" not in err and "note:" not in err  # no progress bar, no notes


def test_bare_flashlite_prints_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: flashlite [-h]") and "commands:" in out and "examples:" in out
    assert err == ""
    with pytest.raises(SystemExit) as exc:  # an unknown top-level option is still an error
        cli.main(["--bogus"])
    assert exc.value.code == 2
    assert "flashlite: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_python_dash_m_flashlite_runs_the_command() -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "flashlite"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: flashlite [-h]")
    done = subprocess.run(
        [sys.executable, "-m", "flashlite", "ring", "--seq", "3"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "flashlite ring: error: --seq=3" in done.stderr


def test_ring_demo_alone_reports_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m flashlite.distributed.demo` (or under torchrun) checks the same way
    from flashlite.distributed import demo

    with pytest.raises(SystemExit) as exc:
        demo.main(["--seq", "6", "--nproc", "2"])
    assert exc.value.code == 2
    assert "flashlite ring: error: --seq=6 must be a multiple of 4" in capsys.readouterr().err
