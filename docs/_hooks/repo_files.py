"""mkdocs hooks: publish the repository files that pages link to outside ``docs/``, and show
the docstrings' Sphinx roles as plain code.

Pages link to benchmark results, plots and examples with relative paths that work in the
repository's file view (``../benchmarks/results/softmax-nvidia-h200.png``). Those files are not
under ``docs/``, so the site would not have them and ``mkdocs build --strict`` would fail on the
links. This hook copies each such file into the site under ``_repo/`` and points the link there.
Markdown files outside ``docs/`` are left alone: a page should link to a page of the site.

The docstrings cross-reference with Sphinx roles (``:func:`splits_for```), which Markdown shows
as ``:func:`` before the code; the role is dropped and the code kept (``~`` too, which in Sphinx
shortens the shown name).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
_PREFIX = "_repo"
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):<code>~?")


def _outside(page_uri: str, target: str, docs: Path) -> str | None:
    """The repository path of a link's target when it is a file outside ``docs/``, else None."""
    if "://" in target or target.startswith(("/", "mailto:")) or target.endswith(".md"):
        return None
    path = (docs / posixpath.dirname(page_uri) / target).resolve()
    root = docs.parent
    if path.is_relative_to(docs) or not path.is_relative_to(root) or not path.is_file():
        return None
    return path.relative_to(root).as_posix()


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config.docs_dir).resolve()
    for page in list(files.documentation_pages()):
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for match in _LINK.finditer(text):
            rel = _outside(page.src_uri, match.group(2), docs)
            if rel and files.get_file_from_path(f"{_PREFIX}/{rel}") is None:
                src = str(docs.parent / rel)
                files.append(File.generated(config, f"{_PREFIX}/{rel}", abs_src_path=src))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs = Path(config.docs_dir).resolve()
    here = posixpath.dirname(page.file.src_uri) or "."

    def point(match: re.Match[str]) -> str:
        rel = _outside(page.file.src_uri, match.group(2), docs)
        if rel is None:
            return match.group(0)
        new = posixpath.relpath(f"{_PREFIX}/{rel}", here)
        return f"{match.group(1)}{new}{match.group(3) or ''}{match.group(4)}"

    return _LINK.sub(point, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub("<code>", html)
