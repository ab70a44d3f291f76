"""The command line: ``record`` launches, ``compile`` a tree from them, ``compare`` two results.

python -m tools.ptx_identity record [--out DIR] [--no-gpu-variants] [-- PYTEST ARGS]
python -m tools.ptx_identity compile OUT [--tree DIR] [--records DIR] [--max-per-kernel N]
                                         [--only NAME,...] [--no-gluon]
python -m tools.ptx_identity compare BASE NEW
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: where records and results go unless told: never the repository
HOME = Path(tempfile.gettempdir()) / "ptx_identity"
ROOT = Path(__file__).resolve().parents[2]  # the checkout holding this tool


def _outside_repository(path: Path) -> Path:
    path = path.resolve()
    if path == ROOT or ROOT in path.parents:
        sys.exit(f"{path} is inside the repository: write records and results elsewhere")
    return path


def _env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this checkout first on the path (its tool, its
    flashlite), plus ``extra``."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def record(args: argparse.Namespace) -> int:
    """Record the launches of the tests named (and the GPU variants) under the interpreter."""
    out = _outside_repository(Path(args.out))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("records-*.pkl"):  # a new recording replaces the old one
        old.unlink()
    env = _env(TRITON_INTERPRET="1", PTX_IDENTITY_RECORDS=str(out))
    pytest_args = [a for a in args.pytest if a != "--"] or ["tests", "-k", "not gpu"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "tools.ptx_identity.record", *pytest_args]
    print("recording:", " ".join(command), flush=True)
    tests = subprocess.call(command, env=env, cwd=ROOT)
    if tests:  # a failing test still records what it launched before failing
        print(f"(pytest exited {tests}; the launches it made are recorded)")
    if not args.no_gpu_variants:
        command = [sys.executable, "-m", "tools.ptx_identity.gpu_variants", str(out)]
        if subprocess.call(command, env=env, cwd=ROOT):
            print("(some GPU-variant cases failed: see FAIL lines)")
    files = sorted(out.glob("records-*.pkl"))
    print(f"{len(files)} record files in {out}")
    return 0 if files else 1


def compile_tree(args: argparse.Namespace) -> int:
    """Compile the tree's kernels offline for sm_90 from the records and the Gluon cases."""
    from tools.ptx_identity.driver import ARCH, use_offline_target

    use_offline_target()  # before flashlite: its kernels must be compiled ones
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    import triton

    import flashlite

    if tree not in Path(flashlite.__file__).resolve().parents:
        sys.exit(f"flashlite imported from {flashlite.__file__}, not from {tree}")
    from tools.ptx_identity import compile as replay
    from tools.ptx_identity import gluon, record
    from tools.ptx_identity.results import Results

    out = _outside_repository(Path(args.out))
    shutil.rmtree(out / "ptx", ignore_errors=True)  # no stale texts from an earlier run
    records = record.load(args.records)
    only = [s for s in args.only.split(",") if s]
    meta = {
        "triton": triton.__version__,
        "target": f"cuda sm_{ARCH}",
        "tree": str(tree),
        "commit": _commit(tree),
        "python": platform.python_version(),
        "records": str(Path(args.records).resolve()),
        "max_per_kernel": args.max_per_kernel,
        "only": only,
    }
    results = Results(out, meta)
    print(f"compiling {tree} (flashlite {flashlite.__file__}) with Triton {triton.__version__}")
    replay.replay(replay.choose(records, args.max_per_kernel, only), results)
    if not args.no_gluon:
        cases = [*gluon.dense_cases(), *gluon.flex_cases(records), *gluon.cross_entropy_cases()]
        cases = [c for c in cases if not only or any(o in c[0] for o in only)]
        gluon.run_cases(cases, results)
    print("written:", results.save())
    errors = sum(1 for hs in results.cases.values() if any(h.startswith("ERROR") for h in hs))
    print(f"{len(results.cases)} cases, {errors} errors")
    return 1 if errors else 0


def _commit(tree: Path) -> str:
    """The tree's git commit, ``+dirty`` with uncommitted changes (or ``?`` outside git)."""
    try:
        run = {"cwd": tree, "capture_output": True, "text": True, "check": True}
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "flashlite"], **run).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty.strip() else "")


def compare(args: argparse.Namespace) -> int:
    """Compare two result folders; exit status 1 when anything differs."""
    from tools.ptx_identity.compare import compare as run

    return 1 if run(args.base, args.new) else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.ptx_identity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="record kernel launches (tests + GPU variants)")
    r.add_argument("--out", default=str(HOME / "records"), help="records folder (%(default)s)")
    r.add_argument("--no-gpu-variants", action="store_true", help="only the tests' launches")
    r.add_argument("pytest", nargs=argparse.REMAINDER, help="pytest arguments, after --")
    r.set_defaults(run=record)
    c = sub.add_parser("compile", help="compile a tree offline for sm_90")
    c.add_argument("out", help="result folder (outside the repository)")
    c.add_argument("--tree", default=".", help="checkout whose flashlite to compile (.)")
    c.add_argument("--records", default=str(HOME / "records"), help="(%(default)s)")
    c.add_argument("--max-per-kernel", type=int, default=4, help="records per kernel, 0: all")
    c.add_argument("--only", default="", help="comma-separated substrings of the case names")
    c.add_argument("--no-gluon", action="store_true", help="skip the Gluon (Hopper) cases")
    c.set_defaults(run=compile_tree)
    d = sub.add_parser("compare", help="compare two result folders")
    d.add_argument("base")
    d.add_argument("new")
    d.set_defaults(run=compare)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
