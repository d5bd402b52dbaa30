"""Replace a benchmark's section of README.md, between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def write_readme_section(name: str, text: str, readme: Path = README) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    body = readme.read_text()
    if begin not in body or end not in body:
        raise SystemExit(f"{readme} lacks the markers {begin} ... {end}; add them where the table goes")
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
