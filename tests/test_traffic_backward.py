"""HBM traffic of the attention backward: the byte model equals the interpreter's count, the
CLI's --backward rows, measuring without a GPU, and the DRAM estimate within 15% of the H200's
measurements.

Counted bytes come from running the real code: Triton kernels in the interpreter (every executed
load/store, active lanes only) and torch ops through a dispatch mode. Shapes are tiny: the
interpreter is slow."""

from __future__ import annotations

import json

import pytest
import torch
from traffic_helpers import ATTENTION_SHAPES, MEASURED

from flashlite import traffic
from flashlite.traffic import AttentionShape


@pytest.mark.interpreter
@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["dO", "dO+dlse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", ATTENTION_SHAPES, ids=lambda d: "x".join(map(str, d)))
def test_backward_counted_equals_model(
    dims: tuple[int, ...], causal: bool, with_lse_grad: bool
) -> None:
    b, h, hkv, nq, nk, d = dims
    shape = AttentionShape(b, h, nq, d, seq_k=nk, kv_heads=hkv, dtype=torch.float16,
                           causal=causal)  # fmt: skip
    flash, naive = traffic.count_attention_bwd(shape, with_lse_grad=with_lse_grad)
    model = traffic.model_flashlite_attention_bwd(shape, with_lse_grad=with_lse_grad)
    assert (flash.read, flash.write) == (model.read, model.write)
    assert naive.total > 0


@pytest.mark.interpreter
def test_backward_rows_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from flashlite import cli

    argv = ["traffic", "--backward", "--seq", "64", "--heads", "2", "--head-dim", "32",
            "--count", "--quiet", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {r["method"]: r for r in rows}
    assert by["flashlite-bwd"]["counted_bytes"] == by["flashlite-bwd"]["model_bytes"]
    assert by["flashlite-bwd"]["counted_bytes"] < by["naive-bwd"]["counted_bytes"]


def test_backward_measure_without_a_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashlite import cli

    with pytest.raises(ValueError, match="method='sdpa-flash'"):
        traffic.measure_attention("sdpa-flash", [], backward=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the library: the model's rows, nothing measured, a note saying why
    shape = AttentionShape(1, 1, 32, 16)
    rows, notes = traffic.backward_rows([shape], measure=True, show_progress=False)
    assert all(r["measured_bytes"] is None for r in rows)
    assert any("no CUDA device" in n for n in notes)
    # the command refuses before it starts, with or without --count
    argv = ["traffic", "--backward", "--seq", "32", "--heads", "1", "--head-dim", "16",
            "--measure", "--quiet", "--json"]  # fmt: skip
    for extra in ([], ["--count"]):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, *extra])
        assert exc.value.code == 2
        assert "flashlite traffic: error: --measure needs a CUDA GPU" in capsys.readouterr().err


BWD_MEASURED = MEASURED.with_name("traffic-bwd-nvidia-h200.json")


def test_backward_dram_estimate_against_the_h200_measurements() -> None:
    # ncu's DRAM bytes of flashlite's three backward kernels (committed H200 run): within 15%
    data = json.loads(BWD_MEASURED.read_text())
    checked = 0
    for r in data["rows"]:
        if r["method"] != "flashlite-bwd" or not r.get("measured_bytes"):
            continue
        shape = AttentionShape.from_json(r["shape"])
        est = traffic.dram_flashlite_attention_bwd(shape, l2_bytes=data["meta"]["l2_bytes"])
        ratio = est.total / r["measured_bytes"]
        assert 0.85 <= ratio <= 1.15, (r["seq_len"], shape.head_dim, shape.causal, ratio)
        # and far below the issued bytes, which count every L2 hit
        assert r["measured_bytes"] < r["model_bytes"] / 4
        checked += 1
    assert checked == 8
