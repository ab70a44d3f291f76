"""examples/: the GPT training example runs a tiny configuration on CPU (issue 10's CI check)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.interpreter
def test_train_gpt_tiny_flashlite_matches_sdpa(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train_gpt = _load("train_gpt")
    out = tmp_path / "gpt.json"
    argv = ["--layers", "2", "--context", "32", "--width", "64", "--heads", "2", "--steps", "3",
            "--batch", "4", "--corpus-mib", "1", "--device", "cpu", "--log-every", "0",
            "--json", str(out)]  # fmt: skip
    assert train_gpt.main(argv) == 0
    # a CPU run says, once, that its tokens/s time the interpreter
    assert capsys.readouterr().out.count("tokens/s measure the interpreter, not speed") == 1
    runs = {r["attention"]: r["losses"] for r in json.loads(out.read_text())["runs"]}
    flash, sdpa = runs["flashlite"], runs["sdpa"]
    assert len(flash) == len(sdpa) == 3
    assert abs(flash[0] - sdpa[0]) < 1e-4  # same weights, same batch: the same first loss
    assert flash[-1] < flash[0]  # it learns
    assert max(abs(a - b) for a, b in zip(flash, sdpa, strict=True)) < 1e-3


@pytest.mark.interpreter
def test_train_gpt_flashlite_loss_matches_torch(tmp_path: Path) -> None:
    # issue 12, must 6: the fused cross-entropy trains the same model along the same curve
    train_gpt = _load("train_gpt")
    out = tmp_path / "gpt.json"
    argv = ["--layers", "1", "--context", "32", "--width", "32", "--heads", "2", "--steps", "4",
            "--batch", "4", "--corpus-mib", "1", "--device", "cpu", "--log-every", "0",
            "--attention", "sdpa", "--loss", "both", "--json", str(out)]  # fmt: skip
    assert train_gpt.main(argv) == 0
    runs = {r["loss"]: r["losses"] for r in json.loads(out.read_text())["runs"]}
    fused, torch_ce = runs["flashlite"], runs["torch"]
    assert abs(fused[0] - torch_ce[0]) < 1e-5  # the same logits: the same first loss
    assert max(abs(a - b) for a, b in zip(fused, torch_ce, strict=True)) < 1e-4
    assert fused[-1] < fused[0]


def test_shared_prefix_decodes_like_copies_of_the_prompt() -> None:
    assert _load("shared_prefix").main(["--steps", "2"]) == 0


def test_hf_generate_matches_sdpa() -> None:
    pytest.importorskip("transformers")
    assert _load("hf_generate").main(["--new-tokens", "8"]) == 0


@pytest.mark.interpreter
def test_train_gpt_llama_through_transformers(tmp_path: Path) -> None:
    # issue 15: --model llama trains transformers' Llama on flashlite's attention, as on SDPA
    pytest.importorskip("transformers")
    train_gpt = _load("train_gpt")
    out = tmp_path / "llama.json"
    argv = ["--model", "llama", "--layers", "1", "--context", "32", "--width", "32", "--heads",
            "2", "--steps", "4", "--batch", "2", "--corpus-mib", "0.2", "--device", "cpu",
            "--log-every", "0", "--json", str(out)]  # fmt: skip
    assert train_gpt.main(argv) == 0
    runs = {r["attention"]: r["losses"] for r in json.loads(out.read_text())["runs"]}
    assert max(abs(a - b) for a, b in zip(runs["flashlite"], runs["sdpa"], strict=True)) < 1e-4


def test_flex_masks_draws_the_gallery_and_checks_the_kernels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "gallery.png"
    assert _load("flex_masks").main(["--out", str(out)]) == 0
    assert out.stat().st_size > 0
