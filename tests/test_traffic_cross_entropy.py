"""HBM traffic of cross-entropy: the byte model equals the interpreter's count on both kernel
paths, the GPU-only prefetch kernel's model reads the logits once, and the CLI's --ce rows.

Counted bytes come from running the real code: Triton kernels in the interpreter (every executed
load/store, active lanes only) and torch ops through a dispatch mode. Shapes are tiny: the
interpreter is slow."""

from __future__ import annotations

import json

import pytest
import torch

from flashlite import traffic


@pytest.mark.parametrize("weight", [False, True], ids=["plain", "weight"])
@pytest.mark.parametrize("path", ["single", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_counted_equals_model(dtype, path, weight, monkeypatch) -> None:  # noqa: ANN001
    # the fused kernel reads each row once (twice on the loop path) and writes its gradient;
    # the backward's scaling kernel reads and writes the gradient again
    from flashlite.kernels import cross_entropy as kce

    if path == "loop":
        monkeypatch.setattr(kce, "SINGLE_READ_MAX", 8)
        monkeypatch.setattr(kce, "LOOP_TILE", 256)
    model = traffic.model_cross_entropy(5, 1000, dtype, weight_bytes=4 if weight else 0)
    counted, torch_ops = traffic.count_cross_entropy(5, 1000, dtype, weight=weight)
    assert (counted.read, counted.write) == (model.read, model.write)
    assert model.info["passes"] == (2 if path == "loop" else 1)
    if not weight:  # (each row re-reads the class weights: more issued bytes at this tiny size)
        assert torch_ops.total > counted.total


@pytest.mark.parametrize("smoothing", [False, True])
def test_cross_entropy_prefetch_model_reads_logits_once(smoothing: bool) -> None:
    # GPU-only Gluon kernel (model only): the Triton loop reads a 128k row twice, the team once,
    # plus the targets and words each of a row's programs reads
    from flashlite.kernels import softmax_gluon

    rows, n = 4, 131072
    loop = traffic.model_cross_entropy(rows, n, torch.bfloat16, backward=False)
    team = traffic.model_cross_entropy(rows, n, torch.bfloat16, backward=False, prefetch=True,
                                       smoothing=smoothing)  # fmt: skip
    chunks = -(-n // (softmax_gluon.CHUNK_BYTES // 2))
    words = chunks * (2 if smoothing else 1)
    assert loop.parts["logits"] == [2 * rows * n * 2, 0] and team.parts["logits"] == [
        rows * n * 2,
        0,
    ]
    assert team.parts["words"] == [8 * rows * chunks * words, 16 * rows * words + 16]
    assert team.parts["target, gradient scale"] == [rows * chunks * 8, 0]
    # the mean's count, the check and the loss sum happen inside the team kernel
    assert (
        team.parts["count, check: targets"] == [rows * 8, 0] and "scale: targets" not in team.parts
    )
    assert team.parts["loss sum"] == [rows * 4, 4]
    assert team.parts["gradient"] == loop.parts["gradient"]
    with pytest.raises(ValueError, match="class weights"):
        traffic.model_cross_entropy(rows, n, torch.bfloat16, weight_bytes=4, prefetch=True)


def test_cross_entropy_traffic_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    assert cli.main(["traffic", "--ce", "--rows", "3", "--n", "500", "--count", "--quiet",
                     "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["flashlite-ce", "torch-ce"]
    assert rows[0]["model_bytes"] == rows[0]["counted_bytes"]
