"""One tree's side of ``bench_ab.py --jobs pairs``: bench_overhead's cases (this folder's), built
on the flashlite that ``PYTHONPATH`` names, each flashlite output checked against fp64 once, then
timed one host-bound round at a time on request.

The driver starts one worker per tree and asks them in turn, case by case, so the two trees'
rounds of a case run seconds apart instead of minutes: a host whose speed drifts (a loop's time
moved by up to 40% between runs on one machine) drifts for both alike.

Protocol, one JSON object per line: the worker first prints ``{"cases": [names]}``; then for
each line it reads, a case name, it prints ``{"us": t}``, the µs per call of one round of
``LOOP_CALLS`` back-to-back calls and one synchronize (``{"error": text}`` if the case cannot
run); ``quit`` ends it.

    PYTHONPATH=<tree> python benchmarks/bench_ab_worker.py [WORD ...]   # cases naming a word
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import IO


def serve(timers: dict[str, Callable[[], float]], rd: IO[str], wr: IO[str]) -> None:
    """Answer requests from ``rd`` on ``wr``: the case names, then one round per name read."""
    print(json.dumps({"cases": list(timers)}), file=wr, flush=True)
    for line in rd:
        name = line.strip()
        if name == "quit":
            return
        try:
            reply = {"us": timers[name]()}
        except Exception as exc:  # noqa: BLE001  (reported to the driver, which drops the case)
            reply = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(reply), file=wr, flush=True)


def build(words: list[str]) -> dict[str, Callable[[], float]]:
    """A one-round timer of flashlite's call per case whose name holds one of ``words`` (all:
    none given), after its output was checked against fp64 and it was warmed up."""
    import torch
    from _overhead_cases import cases, check
    from bench_overhead import warm_loop

    timers = {}
    for case in cases():
        if words and not any(w in case.name for w in words):
            continue
        fn, args = case.providers["flashlite"], case.inputs
        check(case, fn(*args), "flashlite")  # (a wrong result is never timed: raises)
        torch.cuda.synchronize()
        timers[case.name] = warm_loop(lambda fn=fn, args=args: fn(*args))
    return timers


if __name__ == "__main__":
    protocol, sys.stdout = sys.stdout, sys.stderr  # (what the cases print stays off the protocol)
    serve(build(sys.argv[1:]), sys.stdin, protocol)
