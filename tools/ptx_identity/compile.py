"""Replay recorded launches as offline sm_90 compiles of the tree on ``sys.path``: each
recorded (kernel, arguments) becomes a ``warmup`` compile with stand-in arguments."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

from tools.ptx_identity.driver import compile_ptx
from tools.ptx_identity.record import Key
from tools.ptx_identity.results import Results
from tools.ptx_identity.specs import build, jit_function, lookup


def case_id(key: Key) -> str:
    """A stable name for one record, the same in every tree that replays it."""
    return f"{key[0]}.{key[1]} #{hashlib.sha1(repr(key).encode()).hexdigest()[:10]}"


def choose(records: Iterable[Key], max_per_kernel: int, only: list[str]) -> list[Key]:
    """Up to ``max_per_kernel`` records of each kernel (0: all), spread over its sorted records
    so different constexpr sets are picked, the same ones in every run."""
    by_kernel: dict[tuple[str, str], list[Key]] = {}
    for key in sorted(records, key=repr):
        by_kernel.setdefault((key[0], key[1]), []).append(key)
    chosen = []
    for (module, name), keys in sorted(by_kernel.items()):
        if only and not any(o in f"{module}.{name}" for o in only):
            continue
        if max_per_kernel > 0:
            keys = keys[:: max(1, len(keys) // max_per_kernel)][:max_per_kernel]
        chosen.extend(keys)
    return chosen


def replay(keys: list[Key], results: Results, verbose: bool = True) -> None:
    """Compile every record in ``keys`` into ``results`` (a failure is kept as an error)."""
    for key in keys:
        start = time.time()
        case = case_id(key)
        try:
            fn = jit_function(lookup(key[0], key[1]))
            args = [build(s) for s in key[2]]
            kwargs = {k: build(s) for k, s in key[3]}
            h = results.add(case, key[1], compile_ptx(fn, *args, **kwargs))
        except Exception as e:  # noqa: BLE001  (a record that no longer fits the kernel)
            h = results.error(case, e)
        if verbose:
            print(f"{case:70s} {h:24s} {time.time() - start:5.1f}s", flush=True)
