"""A result folder: ``hashes.json`` (each checked case's normalised-PTX hashes, plus what
compiled them) and ``ptx/KERNEL.HASH.ptx`` (the texts, for ``diff``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tools.ptx_identity.driver import digest


class Results:
    """Hashes by case, written as they come; ``save`` writes ``hashes.json``."""

    def __init__(self, folder: str | Path, meta: dict[str, Any]) -> None:
        self.folder = Path(folder)
        (self.folder / "ptx").mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.cases: dict[str, list[str]] = {}

    def add(self, case: str, kernel: str, ptx: str) -> str:
        """Keep one compiled kernel of ``case``; returns its hash."""
        h = digest(ptx)
        (self.folder / "ptx" / f"{kernel}.{h}.ptx").write_text(ptx)
        self.cases.setdefault(case, []).append(h)
        return h

    def error(self, case: str, e: BaseException) -> str:
        """Note a case that did not compile (compare reports it; it never counts as equal)."""
        first = str(e).splitlines()[0][:200] if str(e) else ""
        text = f"ERROR {type(e).__name__}: {first}"
        self.cases.setdefault(case, []).append(text)
        return text

    def save(self) -> Path:
        path = self.folder / "hashes.json"
        data = {"meta": {**self.meta, "written": time.strftime("%F %T")}, "cases": self.cases}
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
        return path


def load(path: str | Path) -> dict[str, Any]:
    """A result folder's (or its ``hashes.json``'s) content."""
    path = Path(path)
    if path.is_dir():
        path = path / "hashes.json"
    return json.loads(path.read_text())
