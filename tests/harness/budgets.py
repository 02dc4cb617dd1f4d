"""Size measures of the package code, parsed (nothing is imported): files, classes, functions, module docstrings.

The caps are the ones the tests enforce (files and classes: ``tests/test_gateway_structure.py``; functions:
``tests/test_code_budgets.py``; module docstrings: ``tests/test_code_text.py``). Run as a script, it prints
every measure within 10 % of its cap, so that splits are planned before a cap is reached::

    python tests/harness/budgets.py
"""

from __future__ import annotations

import ast
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: make the harness package importable
    sys.path.insert(0, str(REPO / "tests"))
from harness.source import package_dirs  # noqa: E402

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
MAX_MODULE_DOC_LINES = 15
#: a measure this close to its cap (a fraction of the cap) is reported, and a class needs a split plan
NEAR_CAP = 0.10
#: where the split plans of classes near their cap are written: rows naming ``path::Class`` in backquotes
PLAN_PAGE = REPO / "docs" / "architecture.md"
PLAN_HEADING = "## Size budgets and split plans"


@dataclass(frozen=True)
class Measure:
    """One measured thing: ``kind`` is ``file``, ``class``, ``function`` or ``docstring``; ``name`` is ``path``
    (file, docstring) or ``path::Qualified.name``; ``lines`` is its size against ``cap``."""

    kind: str
    name: str
    lines: int
    cap: int


def package_files() -> Iterator[tuple[str, Path]]:
    """``(path relative to the repository, path)`` of every ``.py`` file of the six packages."""
    for folder in package_dirs().values():
        for path in sorted(folder.rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path


def _docstring(body: list[ast.stmt]) -> ast.Expr | None:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Body lines of a function: from its first statement after the docstring to its last line (nested
    functions and blank lines inside included; the signature, decorators and docstring not)."""
    body = node.body[1:] if _docstring(node.body) else node.body
    return node.end_lineno - body[0].lineno + 1 if body else 0


def measures(source: str, rel_path: str) -> list[Measure]:
    """Every measure of one file: the file, its module docstring, each class (decorators included; nested
    classes too) and each function or method (nested ones too, named by their qualified name)."""
    tree = ast.parse(source)
    out = [Measure("file", rel_path, len(source.splitlines()), MAX_FILE_LINES)]
    if (doc := _docstring(tree.body)) is not None:
        out.append(Measure("docstring", rel_path, doc.end_lineno - doc.lineno + 1, MAX_MODULE_DOC_LINES))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = f"{prefix}{child.name}"
                out.append(Measure("class", f"{rel_path}::{name}", child.end_lineno - start + 1, MAX_CLASS_LINES))
                visit(child, f"{name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                out.append(Measure("function", f"{rel_path}::{name}", function_lines(child), MAX_FUNCTION_LINES))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def all_measures() -> list[Measure]:
    return [m for rel, path in package_files() for m in measures(path.read_text(), rel)]


def near_cap(measure: Measure) -> bool:
    """Within :data:`NEAR_CAP` of the cap, or over it (a 300-line cap: 270 lines and more)."""
    return measure.lines >= math.ceil(measure.cap * (1 - NEAR_CAP))


def planned_classes(text: str | None = None) -> dict[str, str]:
    """``{path::Class: seam}`` from the split-plan table of :data:`PLAN_PAGE` (the section under
    :data:`PLAN_HEADING`; a row's first cell names the class in backquotes, its last cell the seam)."""
    text = PLAN_PAGE.read_text() if text is None else text
    start = text.index(PLAN_HEADING)
    end = text.find("\n## ", start + 1)
    plans = {}
    for line in text[start : end if end != -1 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and (m := re.fullmatch(r"`([\w/.]+\.py::[\w.]+)`", cells[0])):
            plans[m.group(1)] = cells[-1]
    return plans


def report(found: list[Measure]) -> str:
    """The measures within 10 % of their caps, largest share of the cap first, one line each; a class
    without a plan in :data:`PLAN_PAGE` is marked."""
    plans = planned_classes()
    near = sorted((m for m in found if near_cap(m)), key=lambda m: (-m.lines / m.cap, m.name))
    lines = [
        f"within {NEAR_CAP:.0%} of their caps (files {MAX_FILE_LINES}, classes {MAX_CLASS_LINES}, "
        f"functions {MAX_FUNCTION_LINES} body lines, module docstrings {MAX_MODULE_DOC_LINES}):"
    ]
    for m in near:
        note = ""
        if m.kind == "class":
            note = f"  plan: {plans[m.name]}" if m.name in plans else "  NO PLAN (add a row to docs/architecture.md)"
        lines.append(f"  {m.kind:9} {m.lines:4}/{m.cap:<4} {m.name}{note}")
    plural = {"file": "files", "class": "classes", "function": "functions", "docstring": "module docstrings"}
    lines.append("  " + ", ".join(f"{sum(m.kind == kind for m in near)} {many}" for kind, many in plural.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(report(all_measures()) + "\n")
