"""The attention front-end's shape, checked: its imports stay shallow and without a circle, no
module imports another's private names, and each backend imports kernels, the request and plan
types and what the backends share, never the planner, the front (api, ops) or another backend."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FRONT = ROOT / "flashlite" / "ops" / "attention"
PACKAGE = "flashlite.ops.attention"
#: the longest chain of imports among the front-end's modules (the package's face not counted)
MAX_DEPTH = 6
#: what the backends share (importable by every backend)
SHARED = ("backends.common", "backends.common_bwd", "backends.common_gluon")
BACKENDS = ("backends.triton", "backends.hopper", "backends.tables", "backends.split_kv")


def _name(path: Path) -> str:
    parts = path.relative_to(FRONT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(FRONT.rglob("*.py"))}


def _imports(name: str, private: bool = False) -> set[str] | list[tuple[str, str]]:
    """The front-end modules ``name`` imports anywhere in its file (lazy imports included), or
    with ``private`` the ``(module, name)`` pairs of private names it imports from them."""
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()
    names: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGE):
            continue
        base = node.module[len(PACKAGE) + 1 :] if node.module != PACKAGE else ""
        for alias in node.names:
            sub = f"{base}.{alias.name}".lstrip(".")
            if sub in MODULES:
                found.add(sub)
            elif base in MODULES:
                found.add(base)
                if alias.name.startswith("_"):
                    names.append((base, alias.name))
    found.discard(name)
    return names if private else found


@functools.cache
def _chain(name: str, seen: tuple[str, ...] = ()) -> tuple[str, ...]:
    if name in seen:
        raise AssertionError("import circle: " + " -> ".join((*seen, name)))
    deps = [d for d in _imports(name) if d not in ("", "backends") and not d.endswith("__init__")]
    longest = max((_chain(d, (*seen, name)) for d in deps), key=len, default=())
    return (name, *longest)


def test_imports_are_shallow_and_without_a_circle() -> None:
    chains = [_chain(m) for m in MODULES if m]  # ("": the package's face, which imports all)
    deepest = max(chains, key=len)
    assert len(deepest) <= MAX_DEPTH, " -> ".join(deepest)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_crosses_modules(name: str) -> None:
    assert _imports(name, private=True) == []


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("backends.")))
def test_backends_import_no_planner_front_or_sibling(name: str) -> None:
    own = next((b for b in BACKENDS if name == b or name.startswith(b + ".")), None)
    for dep in _imports(name):
        if dep.startswith("backends."):
            assert dep in SHARED or (own is not None and dep.startswith(own)), (name, dep)
        else:
            assert dep in ("request", "plan", "checks"), (name, dep)
