"""The `flashlite` command: demo | softmax | attention | traffic | bench | ring.

Everything runs on a CPU (Triton's interpreter) unless `--device cuda` is given; `traffic
--measure` needs a GPU and Nsight Compute. `--json` prints machine-readable results on stdout
(notes and progress go to stderr). The help texts shown to users are the plain-text constants of
:mod:`flashlite.cli.texts` (`DESCRIPTION`, `EXAMPLES`, ...), not this docstring; the argument
tree is :mod:`flashlite.cli.parser`, and what each sub-command runs :mod:`flashlite.cli.commands`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Sequence

from flashlite.cli.commands import DTYPES, cmd_demo, cmd_traffic
from flashlite.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flashlite` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    heads, kv_heads = getattr(args, "heads", None), getattr(args, "kv_heads", None)
    if heads is not None and kv_heads is not None and heads % kv_heads:
        parser.error(f"--kv-heads={kv_heads} must divide --heads={heads} (grouped-query heads)")
    if getattr(args, "config", None):  # a bad --config fails now, before any slow work
        from flashlite.traffic import parse_config

        head_dim = getattr(args, "head_dim", 16)  # demo: D = 16
        try:
            parse_config(args.config, head_dim, DTYPES[getattr(args, "dtype", "float32")])
        except ValueError as err:
            parser.error(str(err))
    counts = args.func is cmd_demo or (args.func is cmd_traffic and args.count)
    if counts:
        from flashlite import _backend

        if not _backend.kernels_interpreted():
            # Counting runs kernels in Triton's interpreter, which a process that compiles for
            # its GPU cannot switch on: run the same command in one that interprets.
            cmd = [sys.executable, "-m", "flashlite.cli", *(sys.argv[1:] if argv is None else argv)]
            return subprocess.call(cmd, env={**os.environ, "TRITON_INTERPRET": "1"})
    with warnings.catch_warnings():
        # The interpreter evaluates masked-off lanes too (-inf - -inf there) and numpy warns;
        # those lanes are never stored, so the warnings only alarm users (pyproject does the
        # same for the tests).
        warnings.filterwarnings(
            "ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter"
        )
        return int(args.func(args) or 0)
