"""The architecture of ../shared/DESIGN.md, checked: imports point down the floors, floors 3-4
use no private names of other modules, and no module shares a public function's name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import flashlite

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "flashlite"

#: floor of each module (by dotted-name prefix; the longest prefix wins)
FLOORS = {
    "flashlite.stats": 0,
    "flashlite.stats_gluon": 0,
    "flashlite.masking": 0,
    "flashlite.masks": 0,  # (the four faces of flashlite.masking's modules)
    "flashlite.mods": 0,
    "flashlite.block_mask": 0,
    "flashlite.gallery": 0,
    "flashlite._backend": 0,
    "flashlite._launch": 0,
    "flashlite._teams": 0,
    "flashlite._caches": 0,
    "flashlite.reference": 0,
    "flashlite.kernels": 1,
    "flashlite.ops": 2,
    "flashlite.traffic": 3,
    "flashlite.distributed": 3,
    "flashlite.integrations": 3,
    "flashlite.nn": 3,
    "flashlite.plotting": 3,
    "flashlite.cli": 4,
    "flashlite.__main__": 4,  # `python -m flashlite`: the command
}


def _floor(module: str) -> int | None:
    if module == "flashlite":  # the package: its public functions are the front-ends'
        return 2
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len,
               default=None)  # fmt: skip
    return None if best is None else FLOORS[best]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _flashlite_imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import of a flashlite module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashlite"):
            names = [a.name for a in node.names]
            # `from flashlite import stats` imports a module: resolve to it
            subs = [f"{node.module}.{n}" for n in names if _is_module(f"{node.module}.{n}")]
            if subs:
                found += [(s, [], node.lineno) for s in subs]
            else:
                found.append((node.module, names, node.lineno))
        elif isinstance(node, ast.Import):
            found += [
                (a.name, [], node.lineno) for a in node.names if a.name.startswith("flashlite")
            ]
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


SOURCES = [
    p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent != PACKAGE
]


def test_every_module_has_a_floor() -> None:
    missing = [_module_name(p) for p in SOURCES if _floor(_module_name(p)) is None]
    missing = [m for m in missing if m not in ("flashlite.kernels", "flashlite.ops")]
    assert not missing, f"add these modules to FLOORS (and DESIGN.md): {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path) -> None:
    here = _module_name(path)
    floor = _floor(here)
    assert floor is not None
    for target, _, line in _flashlite_imports(ast.parse(path.read_text())):
        there = _floor(target)
        assert there is not None and there <= floor, (
            f"{path.name}:{line} imports {target} (floor {there}) from floor {floor}"
        )


UPPER = [p for p in SOURCES if (_floor(_module_name(p)) or 0) >= 3]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", UPPER + BENCHMARKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_upper_floors_use_public_names_only(path: Path) -> None:
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    for target, names, line in _flashlite_imports(tree):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{path.name}:{line} imports private {private} from {target}"
    for node in ast.walk(tree):  # names bound to flashlite modules
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            for a in node.names:
                full = a.name if isinstance(node, ast.Import) else f"{module}.{a.name}"
                if full.startswith("flashlite") and _is_module(full):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr != "_backend"  # the floor-0 module that holds device facts
        ):
            raise AssertionError(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")


def test_no_module_shares_a_public_function_name() -> None:
    for name in flashlite.__all__:
        if callable(getattr(flashlite, name)):
            assert not _is_module(f"flashlite.{name}"), f"flashlite/{name}.py shadows a function"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flashlite.attention")


def test_import_flashlite_loads_distributed_and_nn_lazily() -> None:
    # `import flashlite` imports what the kernels need; the ring and the module classes load on
    # first use, through the package's attributes
    import subprocess
    import sys

    code = (
        "import sys, flashlite\n"
        "assert 'flashlite.distributed' not in sys.modules, 'distributed imported'\n"
        "assert 'flashlite.nn' not in sys.modules, 'nn imported'\n"
        "assert flashlite.nn.MultiheadAttention and flashlite.distributed.ring_attention\n"
        "assert 'flashlite.nn' in sys.modules and 'distributed' in dir(flashlite)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_traffic_reads_plans_not_kernel_modules() -> None:
    # the traffic model takes its decisions from the front-ends' plan functions (softmax's
    # row_plan, cross-entropy's fwd_reads and bwd_tiling, attention's bwd_tiles and
    # decode_tiles, ...): it imports no kernel module, the config tables included
    for path in sorted((PACKAGE / "traffic").rglob("*.py")):
        for target, _, line in _flashlite_imports(ast.parse(path.read_text())):
            where = f"{path.name}:{line} imports {target}"
            assert not target.startswith("flashlite.kernels"), where
