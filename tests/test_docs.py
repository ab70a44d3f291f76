"""The manual against the code: every Python block in the README and docs/ runs, and the lists
that can drift from the code (commands, benchmark scripts, custom ops, the reference's pages,
stated signatures) match it.

Code blocks run with sybil (the ``docs`` extra), one test per file: the blocks of a file run in
order in one namespace, in a temporary folder. A block whose line before its fence is
``<!-- gpu -->`` runs only with CUDA; ``<!-- no-run -->`` never runs (pseudo-code, output).
Only ```` ```python ```` blocks run; ```` ```bash ```` and the rest are text.
"""

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

try:
    from sybil import Document
    from sybil.parsers.markdown import PythonCodeBlockParser
except ImportError:  # the docs extra is not installed: the code blocks skip, the rest runs
    Document = None

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
#: the pages with a Python block (the others would only add skips to the report)
CODE_PAGES = [p for p in PAGES if "```python" in p.read_text()]
_MARKER = re.compile(r"<!--\s*(gpu|no-run)\s*-->\s*$")


def _manual() -> str:
    return "".join(p.read_text() for p in PAGES)


def _marker(text: str, start: int) -> str | None:
    """The marker on the last non-blank line before offset ``start`` (a block's fence), if any."""
    before = text[:start].rstrip().rsplit("\n", 1)[-1]
    found = _MARKER.search(before)
    return found.group(1) if found else None


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if Document is None:
        pytest.skip("sybil is not installed (pip install -e '.[docs]')")
    document = Document.parse(str(page), PythonCodeBlockParser())
    examples = list(document)
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    ran = 0
    for example in examples:
        marker = _marker(document.text, example.start)
        if marker == "no-run" or (marker == "gpu" and not torch.cuda.is_available()):
            continue
        example.evaluate()
        ran += 1
    if not ran:
        pytest.skip("every python block is marked gpu or no-run")


def test_markers_are_known() -> None:
    """A misspelt marker would run a block meant to be skipped: only the two agreed ones."""
    for page in PAGES:
        for comment in re.findall(r"<!--\s*([\w-]+)\s*-->", page.read_text()):
            assert comment in ("gpu", "no-run"), f"{page}: unknown marker <!-- {comment} -->"


def test_readme_is_a_front_door() -> None:
    assert len(README.read_text().splitlines()) <= 200


#: Public modules outside ``flashlite.__all__`` that the reference documents
MODULES = ("traffic", "integrations.transformers")


def test_reference_documents_every_public_name() -> None:
    blocks = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        blocks |= set(re.findall(r"^::: flashlite\.([\w.]+)\s*$", page.read_text(), re.M))
    public = {n for n in flashlite.__all__ if n != "__version__"} | set(MODULES)
    assert public <= blocks, f"no reference block for {sorted(public - blocks)}"


def test_manual_lists_every_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    listed = re.search(r"Commands: `flashlite ([^`]+)`", _manual().replace("\n", " "))
    assert listed, "the command line page's list of commands is missing"
    assert {c.strip() for c in listed.group(1).split("|")} == set(sub.choices)


def test_bench_lists_every_script(capsys: pytest.CaptureFixture[str]) -> None:
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert {name for name, _ in BENCHMARKS} == scripts
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert all(f"benchmarks/{name}" in out for name in scripts)


def test_manual_names_every_custom_op() -> None:
    registered = {n for n in dir(torch.ops.flashlite) if not n.startswith("_") and n != "name"}
    registered = {n for n in registered if hasattr(getattr(torch.ops.flashlite, n), "default")}
    named = set(re.findall(r"`flashlite::(\w+)`", _manual()))
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
    with defaults, not ``...``) names the function's parameters, in order. (The reference pages
    take theirs from the code.)"""
    params = list(inspect.signature(PUBLIC[name]).parameters)
    pattern = re.compile(r"`flashlite\." + re.escape(name) + r"\(([^`]*)\)`")
    stated = [m.group(1) for m in pattern.finditer(_manual().replace("\n", " "))]
    for text in (s for s in stated if "..." not in s and "…" not in s and "=" in s):
        names = [a.split("=")[0].strip() for a in text.split(",")]
        names = [n for n in names if n and n not in ("*", "/")]
        assert names == params, f"flashlite.{name}({text}) against {params}"
