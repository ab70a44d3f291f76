"""The PTX-identity tool (tools/ptx_identity): a kernel and its refactored twin (a helper
extracted, the same operations in the same order) compile offline for sm_90 to the same
normalised PTX; a twin with an operation changed does not. The compiles run in a child process:
this one has Triton's interpreter on, and the offline target replaces the active driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.ptx_identity.driver import normalise

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
from tools.ptx_identity.driver import compile_ptx, use_offline_target
use_offline_target()
import torch
import ptx_identity_helpers as k
x, y = torch.empty(256), torch.empty(256)
print(json.dumps({name: compile_ptx(getattr(k, name), x, y, 256, 0.5, BLOCK=128)
                  for name in ("scale_rows", "scale_rows_helper", "scale_rows_changed")}))
"""


def test_refactor_keeps_ptx_and_a_change_does_not() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the kernel's own name is in its PTX (entry, parameters); the tool compares a kernel with
    # itself under one name, so the twins' names are made one here
    ptx = {
        name: text.replace(name, "K")
        for name, text in json.loads(done.stdout.splitlines()[-1]).items()
    }
    assert ".target sm_90" in ptx["scale_rows"]
    assert ptx["scale_rows"] == ptx["scale_rows_helper"]
    assert ptx["scale_rows"] != ptx["scale_rows_changed"]


def test_normalise_drops_debug_lines_only() -> None:
    ptx = '.file 1 "a.py"\n\t.loc 1 3 0\n// comment\n$L__tmp0:\n\tadd.f32 %f1, %f2, %f3;\n'
    moved = ptx.replace(".loc 1 3 0", ".loc 1 9 4").replace('"a.py"', '"b.py"')
    assert normalise(ptx) == normalise(moved) == "add.f32 %f1, %f2, %f3;"
    assert normalise(ptx) != normalise(ptx.replace("add.f32", "sub.f32"))
