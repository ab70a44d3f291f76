"""The Gluon (Hopper) kernels build with this Triton: one case of each family compiled offline
for sm_90 through flashlite's own plans (tools/ptx_identity), so a Gluon API that moves under a
new Triton fails here, on a CPU, and not first on a GPU. The compiles run in a child process:
this one has Triton's interpreter on, and the offline target replaces the active driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashlite.kernels.attention import hopper as KH

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile
from tools.ptx_identity.driver import use_offline_target
use_offline_target()
from tools.ptx_identity.gluon import cross_entropy_cases, dense_cases, run_cases
from tools.ptx_identity.results import Results
wanted = sys.argv[1:]
cases = [c for c in (*dense_cases(), *cross_entropy_cases()) if c[0] in wanted]
results = Results(tempfile.mkdtemp(), {})
run_cases(cases, results, verbose=False)
print(json.dumps(results.cases))
"""

#: one forward (causal, sinks), one backward (both masks), one cross-entropy (smoothing, z-loss)
CASES = [
    "gluon fwd d128 torch.bfloat16 causal=True sinks=True",
    "gluon bwd d64 torch.float16",
    "gluon ce bfloat16 V=40000 eps=0.1 z=0.0001 mode=(True, True, 2)",
]


@pytest.mark.skipif(
    not KH.available(),
    reason=f"this Triton lacks the Gluon pieces flashlite uses ({KH.GLUON_IMPORT_ERROR}): "
    "its Triton kernels run instead",
)
def test_each_gluon_kernel_family_builds_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *CASES], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(built) == sorted(CASES), "a case name changed in tools/ptx_identity/gluon.py"
    for case, hashes in built.items():
        assert hashes, case
        assert not any(h.startswith("ERROR") for h in hashes), (case, hashes)
    assert len(built[CASES[1]]) == 2  # (the backward's two masks)
