"""Recording launches: every ``@triton.jit`` launch the interpreter sees becomes a replayable
key (kernel, argument specs), counted, and saved as one pickle per process in a folder.

As a pytest plugin (``-p tools.ptx_identity.record`` with ``TRITON_INTERPRET=1`` and
``PTX_IDENTITY_RECORDS`` naming the folder) it records the launches of the tests it runs.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from tools.ptx_identity.specs import Spec, UnrecordableError, spec

#: (module, qualname, positional specs, sorted keyword specs)
Key = tuple[str, str, tuple[Spec, ...], tuple[tuple[str, Spec], ...]]

ENV = "PTX_IDENTITY_RECORDS"
RECORDS: dict[Key, int] = {}


def key_of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """The record of one launch of the Python function ``fn``."""
    return (
        fn.__module__,
        fn.__qualname__,
        tuple(spec(a) for a in args),
        tuple(sorted((k, spec(v)) for k, v in kwargs.items())),
    )


def _note(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        key = key_of(fn, args, kwargs)
    except UnrecordableError:
        return  # an argument no replay could rebuild: that launch stays unchecked
    RECORDS[key] = RECORDS.get(key, 0) + 1


def install(launch: bool = True) -> None:
    """Record every interpreted launch from now on; with ``launch=False`` record without running
    (the GPU-variant recorder: its inputs are empty stand-ins)."""
    from triton.runtime.interpreter import InterpretedFunction

    if hasattr(InterpretedFunction, "run"):  # Triton 3.5+: fn[grid](...) and autotuners call run
        original = InterpretedFunction.run

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            _note(self.fn, args, kwargs)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs) if launch else None

        InterpretedFunction.run = run
        return
    getitem = InterpretedFunction.__getitem__  # older Triton: fn[grid] is the only way in

    def recording_getitem(self: Any, grid: Any) -> Any:
        runner = getitem(self, grid)

        def call(*args: Any, **kwargs: Any) -> Any:
            _note(self.fn, args, kwargs)
            return runner(*args, **kwargs) if launch else None

        return call

    InterpretedFunction.__getitem__ = recording_getitem


def save(folder: str | os.PathLike[str]) -> Path | None:
    """Write this process's records into ``folder`` (one file per process: pytest-xdist workers
    each write their own)."""
    if not RECORDS:
        return None
    path = Path(folder) / f"records-{os.getpid()}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(dict(RECORDS), f)
    return path


def load(folder: str | os.PathLike[str]) -> dict[Key, int]:
    """Every record in ``folder``, counts summed over the files."""
    records: dict[Key, int] = {}
    files = sorted(Path(folder).glob("records-*.pkl"))
    if not files:
        raise FileNotFoundError(f"no records-*.pkl in {folder}: run the record step first")
    for path in files:
        with open(path, "rb") as f:
            for key, n in pickle.load(f).items():
                records[key] = records.get(key, 0) + n
    return records


# ----- the pytest plugin -----


def pytest_configure(config: Any) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or ENV not in os.environ:
        raise RuntimeError(f"the recorder needs TRITON_INTERPRET=1 and {ENV}=<folder>")
    install(launch=True)


def pytest_unconfigure(config: Any) -> None:
    save(os.environ[ENV])
