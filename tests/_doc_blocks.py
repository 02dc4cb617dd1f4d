"""Fenced code blocks of the README and the docs pages, with the marker comment that precedes each one.

A block is ``Block(path, index, lang, code, line, mark)``: ``path`` relative to the repository, ``index`` its
position among the fenced blocks with a language in that file, ``line`` the 1-based line of its opening fence, and
``mark`` the text of an HTML comment ``<!-- ... -->`` on the line just above the fence (``""`` if none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXECUTABLE = {"bash", "sh", "shell", "console", "python", "py"}
_FENCE = re.compile(r"^```([A-Za-z0-9_-]*)\s*$")
_MARK = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str
    index: int
    lang: str
    code: str
    line: int
    mark: str


def doc_files() -> list[Path]:
    """README.md, CONTRIBUTING.md and every page under docs/."""
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` that name a language, in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1):
            above = _MARK.match(lines[i - 1]) if i > 0 else None
            out.append(
                Block(
                    str(path.relative_to(REPO)),
                    len(out),
                    m.group(1),
                    "\n".join(lines[i + 1 : end]) + "\n",
                    i + 1,
                    above.group(1) if above else "",
                )
            )
        i = end + 1
    return out


def section_blocks(path: Path, start: str, end: str) -> list[Block]:
    """The blocks of ``path`` between the heading line ``start`` and the next line ``end`` (both exact lines)."""
    lines = path.read_text().splitlines()
    lo, hi = lines.index(start) + 1, lines.index(end) + 1
    return [b for b in blocks(path) if lo < b.line < hi]
