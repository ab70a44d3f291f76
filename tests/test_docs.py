"""The lists in the README and docs that can drift from the code: the commands, the benchmark
scripts, the custom ops and the public signatures the manual states."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import flashlite
import flashlite.distributed
from flashlite import cli
from flashlite.cli.commands import BENCHMARKS
from flashlite.cli.parser import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _manual() -> str:
    return README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def test_readme_lists_every_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = set(sub.choices)
    listed = re.search(r"Commands: `flashlite ([^`]+)`", README.replace("\n", " "))
    assert listed, "the README's command list is missing"
    assert {c.strip() for c in listed.group(1).split("|")} == commands


def test_bench_lists_every_script(capsys: pytest.CaptureFixture[str]) -> None:
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert {name for name, _ in BENCHMARKS} == scripts
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert all(f"benchmarks/{name}" in out for name in scripts)


def test_readme_names_every_custom_op() -> None:
    registered = {n for n in dir(torch.ops.flashlite) if not n.startswith("_") and n != "name"}
    registered = {n for n in registered if hasattr(getattr(torch.ops.flashlite, n), "default")}
    named = set(re.findall(r"`flashlite::(\w+)`", README))
    assert registered and registered == named


PUBLIC = {
    "softmax": flashlite.softmax,
    "log_softmax": flashlite.log_softmax,
    "attention": flashlite.attention,
    "attention_varlen": flashlite.attention_varlen,
    "attention_kvcache": flashlite.attention_kvcache,
    "attention_shared_prefix": flashlite.attention_shared_prefix,
    "flex_attention": flashlite.flex_attention,
    "create_block_mask": flashlite.create_block_mask,
    "cross_entropy": flashlite.cross_entropy,
    "linear_cross_entropy": flashlite.linear_cross_entropy,
    "distributed.ring_attention": flashlite.distributed.ring_attention,
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_stated_signatures_match_the_code(name: str) -> None:
    """Every ``flashlite.NAME(...)`` signature the manual states in full (one ending in ``)``,
    not ``...``) names the function's parameters, in order."""
    params = list(inspect.signature(PUBLIC[name]).parameters)
    pattern = re.compile(r"`flashlite\." + re.escape(name) + r"\(([^`]*)\)`")
    stated = [m.group(1) for m in pattern.finditer(_manual().replace("\n", " "))]
    full = [s for s in stated if "..." not in s and "…" not in s and "=" in s]
    assert full, f"the manual states no full signature of flashlite.{name}"
    for text in full:
        names = [a.split("=")[0].strip() for a in text.split(",")]
        names = [n for n in names if n and n not in ("*", "/")]
        assert names == params, f"flashlite.{name}({text}) against {params}"
