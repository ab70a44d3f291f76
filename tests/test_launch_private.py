"""Triton's private API: only in flashlite/_launch.py (and the traffic counter's interpreter
hooks), each use behind a function there that is version-guarded and says the version when it
fails."""

from __future__ import annotations

import importlib
import io
import os
import re
import tokenize
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import triton
import triton.language as tl

from flashlite import _backend, _caches, _launch

PACKAGE = Path(__file__).parents[1] / "flashlite"
#: The files allowed to reach into Triton's internals.
ALLOWED = {"_launch.py", "traffic/hooks.py"}
#: What private Triton use looks like in code (strings and comments aside).
PRIVATE = re.compile(
    r"triton\s*\.\s*(_C|runtime|backends|compiler)\b|\bknobs\b|\bJITFunction\b"
    r"|\bInterpretedFunction\b|\b_init_handles\b|\.\s*warmup\s*\(|\bdevice_caches\b"
    r"|\.\s*n_regs\b|\.\s*packed_metadata\b|\blibtriton\b|\._core\b"
)
#: Private attributes that code may name in a string (``getattr(k, "device_caches", {})``).
PRIVATE_ATTRS = {"device_caches", "_init_handles", "n_regs", "packed_metadata"}
FAKE_VERSION = "9.8.7"


def _code(path: Path) -> str:
    """``path``'s source with strings and comments blanked (docstrings may name anything)."""
    lines = path.read_text().splitlines(keepends=True)
    quiet = {tokenize.STRING, tokenize.COMMENT}
    quiet |= {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    tokens = tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
    for tok in reversed([t for t in tokens if t.type in quiet]):
        (r0, c0), (r1, c1) = tok.start, tok.end
        if r0 == r1:
            lines[r0 - 1] = lines[r0 - 1][:c0] + " " * (c1 - c0) + lines[r0 - 1][c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
            lines[r1 - 1] = lines[r1 - 1][c1:]
    return "".join(lines)


def _attr_strings(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each string literal that is exactly a private attribute's name."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    strings = [(t.start[0], t.string) for t in tokens if t.type == tokenize.STRING]
    return [(i, s.strip("'\"")) for i, s in strings if s.strip("'\"") in PRIVATE_ATTRS]


def test_private_triton_names_appear_only_in_launch_and_the_traffic_hooks() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        for i, line in enumerate(_code(path).splitlines(), 1):
            if PRIVATE.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
        found += [f"{rel}:{i}: the string {name!r}" for i, name in _attr_strings(path)]
    assert not found, "private Triton API outside _launch.py:\n" + "\n".join(found)


def test_the_scan_sees_private_names_in_code_but_not_in_strings(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""JITFunction in a docstring."""\nx = 1  # triton._C in a comment\n')
    assert not PRIVATE.search(_code(f))
    f.write_text("from triton.runtime.jit import JITFunction\n")
    assert PRIVATE.search(_code(f))
    f.write_text("k.warmup(1, grid=(1,))\n")
    assert PRIVATE.search(_code(f))
    f.write_text('n = getattr(k, "device_caches", {})\n')
    assert _attr_strings(f) == [(1, "device_caches")]


@pytest.fixture
def fake_version(monkeypatch: pytest.MonkeyPatch) -> str:
    """A Triton version no test could mistake for another number in a message."""
    monkeypatch.setattr(triton, "__version__", FAKE_VERSION)
    return FAKE_VERSION


# --------------------------------------------------------------------------- compiled kernels
class _Compiled:
    """A compiled kernel whose handles (n_regs) load on first use, as Triton's do."""

    metadata = SimpleNamespace(num_warps=4, shared=1024)

    def _init_handles(self) -> None:
        self.n_regs = 40


def test_compile_for_and_compiled_resources(fake_version: str) -> None:
    seen = []
    kernel = SimpleNamespace(warmup=lambda *a, **kw: seen.append((a, kw)) or _Compiled())
    compiled = _launch.compile_for(kernel, (1, 2), {"BLOCK": 64})
    assert seen == [((1, 2), {"grid": (1,), "BLOCK": 64})]
    assert _launch.compiled_resources(compiled) == (40, 4, 1024)
    with pytest.raises(RuntimeError, match=f"JITFunction.warmup.*triton {fake_version}"):
        _launch.compile_for(object(), (), {})
    with pytest.raises(RuntimeError, match=f"n_regs / metadata.*triton {fake_version}"):
        _launch.compiled_resources(object())


def test_compiled_variants(monkeypatch: pytest.MonkeyPatch, fake_version: str) -> None:
    if _backend.INTERPRETED:  # (nothing compiles in the interpreter)
        assert _launch.compiled_variants([_jit]) == 0
    monkeypatch.setattr(_backend, "INTERPRETED", False)
    kernel = SimpleNamespace(device_caches={0: ({"a": 1, "b": 2}, {}), 1: ({"c": 3}, {})})
    assert _launch.compiled_variants([kernel, kernel]) == 6
    with pytest.raises(RuntimeError, match=f"device_caches.*triton {fake_version}"):
        _launch.compiled_variants([object()])


def test_cooperative_launch_supported_is_a_registered_memo() -> None:
    assert isinstance(_launch.cooperative_launch_supported(), bool)
    assert _caches.state()["launch.cooperative"] is _launch.cooperative_launch_supported


# --------------------------------------------------------------------------- jit functions
@triton.jit
def _jit(x):
    return x + 1


def _plain(x: Any) -> Any:
    return x + 1


def test_is_jit_and_python_fn(fake_version: str) -> None:
    assert _launch.is_jit(_jit) and not _launch.is_jit(_plain) and not _launch.is_jit(1)
    assert _launch.python_fn(_jit)(1) == 2
    with pytest.raises(RuntimeError, match=f"JITFunction.fn.*triton {fake_version}"):
        _launch.python_fn(_plain)


def test_interpret_from_now_on_refuses_an_untested_triton(fake_version: str) -> None:
    before = os.environ.get("TRITON_INTERPRET")
    why = _launch.interpret_from_now_on()
    assert why is not None and f"triton {fake_version}" in why
    assert os.environ.get("TRITON_INTERPRET") == before  # (nothing was touched)


@pytest.mark.skipif(not _backend.INTERPRETED, reason="turns the interpreter knob on")
def test_interpret_from_now_on_says_the_version_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the switch itself runs in a fresh Python: test_backend's triton-imported-first tests)
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", knobs.runtime.interpret)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sum_before = tl.sum

    def broken(module: Any) -> Any:
        raise ImportError("no reload today")

    monkeypatch.setattr(importlib, "reload", broken)
    why = _launch.interpret_from_now_on()
    assert why == f"triton {triton.__version__}: ImportError: no reload today"
    assert "TRITON_INTERPRET" not in os.environ  # (the failed switch leaves it unset)
    assert tl.sum is sum_before


# --------------------------------------------------------------------------- Gluon
def test_gluon_tma_add_is_guarded_by_version(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _launch.gluon_tma_add()
    try:  # (this Triton has the pieces: a Gluon builtin comes back)
        from triton.experimental.gluon.language import _core  # noqa: F401

        assert made is not None and callable(made)
    except ImportError:
        assert made is None
    monkeypatch.setattr(_backend, "TRITON_VERSION", (3, 99))
    assert _launch.gluon_tma_add() is None


def test_private_api_error_names_the_version(fake_version: str) -> None:
    err = _backend.private_api_error("Something.private", KeyError("x"))
    assert f"triton {fake_version}" in str(err) and "Something.private" in str(err)
