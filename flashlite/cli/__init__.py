"""The `flashlite` command: demo | softmax | attention | traffic | bench | ring.

Everything runs on a CPU (Triton's interpreter) unless `--device cuda` is given; `traffic
--measure` needs a GPU and Nsight Compute. `--json` prints machine-readable results on stdout
(notes and progress go to stderr). The help texts shown to users are the plain-text constants of
:mod:`flashlite.cli.texts` (`DESCRIPTION`, `EXAMPLES`, ...), not this docstring; the argument
tree is :mod:`flashlite.cli.parser`, what each sub-command runs :mod:`flashlite.cli.commands`,
and the checks of options that do not go together :mod:`flashlite.cli.checks` (every usage error
exits 2 under its sub-command's usage). `python -m flashlite` runs the same command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence

from flashlite.cli.checks import check_usage
from flashlite.cli.commands import UsageError, cmd_demo, cmd_traffic
from flashlite.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flashlite` console script (and of `python -m flashlite`): runs the
    sub-command and returns its exit status; usage errors exit 2 through argparse."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()  # a bare `flashlite`: what it can do
        return 0
    # the sub-command's own parser reports its usage errors: its usage, not the top level's
    command = parser.commands[args.command]
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_usage(args)
        return _run(args, argv)
    except UsageError as err:
        command.error(str(err))


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
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
