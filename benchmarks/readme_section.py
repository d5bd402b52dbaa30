"""Replace a benchmark's generated section, between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``.

The section lives in README.md or in one of the pages under docs/ (the long tables moved there);
:func:`write_readme_section` finds the one file that holds the markers and rewrites it there.
:func:`github_table` writes the Markdown tables those sections hold, the same way for every benchmark.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def github_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """``rows`` under ``headers`` as a GitHub Markdown table, its columns padded to line up.

    Each cell is written as the benchmark formatted it: number parsing is off, or tabulate would
    print "1.50" as "1.5". A pipe inside a cell is escaped, since it would end the cell.
    """
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return tabulate(cells, headers=list(headers), tablefmt="github", disable_numparse=True)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def documents(root: Path = ROOT) -> list[Path]:
    """README.md, then every Markdown page under docs/, in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def section_file(name: str, root: Path = ROOT) -> Path:
    """The one document that holds section ``name``'s markers."""
    begin, end = markers(name)
    found = [p for p in documents(root) if p.exists() and begin in (text := p.read_text()) and end in text]
    if len(found) != 1:
        where = ", ".join(str(p.relative_to(root)) for p in found) or "none of them"
        searched = ", ".join(str(p.relative_to(root)) for p in documents(root))
        raise SystemExit(
            f"section {name!r}: the markers {begin} ... {end} must be in exactly one of {searched}; "
            f"found in {where}. Put them once where the table goes"
        )
    return found[0]


def replace_section(body: str, name: str, text: str) -> str:
    """``body`` with section ``name``'s content replaced by ``text``."""
    begin, end = markers(name)
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{text}\n{end}{tail}"


def read_section(body: str, name: str) -> str:
    """Section ``name``'s content in ``body`` (without the marker lines)."""
    begin, end = markers(name)
    return body.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def write_readme_section(name: str, text: str, readme: Path | None = None) -> None:
    """Write ``text`` between section ``name``'s markers, in ``readme`` if given, else in the one
    document (README.md or docs/*.md) that holds them."""
    path = readme or section_file(name)
    body = path.read_text()
    begin, end = markers(name)
    if begin not in body or end not in body:
        raise SystemExit(f"{path} lacks the markers {begin} ... {end}; add them where the table goes")
    path.write_text(replace_section(body, name, text))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"section {name!r} written to {shown}", file=sys.stderr)
