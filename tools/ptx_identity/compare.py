"""Compare two result folders: every case checked in both must have the same PTX hashes."""

from __future__ import annotations

from pathlib import Path

from tools.ptx_identity.results import load


def _ptx_files(folder: Path, hashes: list[str]) -> list[str]:
    """The PTX files of ``hashes`` in ``folder`` (to hand to ``diff``)."""
    return [str(p) for h in hashes for p in sorted((folder / "ptx").glob(f"*.{h}.ptx"))]


def compare(base: str | Path, new: str | Path) -> int:
    """Print each differing case and a summary; returns the number of problems (differing
    cases, cases only one side checked, errors on the new side)."""
    a, b = load(base), load(new)
    for key in ("triton", "target"):
        if a["meta"].get(key) != b["meta"].get(key):
            print(f"WARNING: {key} differs: {a['meta'].get(key)} vs {b['meta'].get(key)}")
    cases_a, cases_b = a["cases"], b["cases"]
    differ = [c for c in sorted(set(cases_a) & set(cases_b)) if cases_a[c] != cases_b[c]]
    for case in differ:
        print(f"DIFF {case}\n  base {cases_a[case]}\n  new  {cases_b[case]}")
        fa = _ptx_files(Path(base), cases_a[case])
        fb = _ptx_files(Path(new), cases_b[case])
        if fa and fb:
            print(f"  diff {fa[0]} {fb[0]}")
    only = sorted(set(cases_a) ^ set(cases_b))
    for case in only:
        print(f"ONLY IN {'base' if case in cases_a else 'new'}: {case}")
    errors = [c for c, hs in cases_b.items() if any(h.startswith("ERROR") for h in hs)]
    for case in errors:
        print(f"ERROR in new: {case}: {cases_b[case]}")
    same = len(set(cases_a) & set(cases_b)) - len(differ)
    print(
        f"{len(cases_a)} cases in base, {len(cases_b)} in new: {same} identical, "
        f"{len(differ)} differ, {len(only)} on one side only, {len(errors)} errors in new"
    )
    return len(differ) + len(only) + len(errors)
