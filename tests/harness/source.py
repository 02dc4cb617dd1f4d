"""The packages' source read as text, never imported: their folders (``pyproject.toml``'s ``package-dir``), their
modules and each module's imports (used by the layering, structure and import-cycle tests)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``module`` is absolute (``livelora.adapters.store``, ``torch.nn``)."""

    module: str
    line: int
    module_level: bool  # executed when the module is imported (not in a function, not under TYPE_CHECKING)
    type_only: bool = False  # under ``if TYPE_CHECKING:`` (never executed)


def package_dirs() -> dict[str, Path]:
    """``{top package name: folder}`` from pyproject's ``package-dir`` (``{"gateway": REPO/"gateway", ...}``)."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {
        name.split(".", 1)[1]: REPO / folder
        for name, folder in mapping.items()
        if name.startswith("livelora.") and name.count(".") == 1
    }


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module_name: str, is_package: bool = False, *, from_names: bool = False) -> list[Import]:
    """Every import in ``source`` (the text of module ``module_name``), relative ones made absolute.

    ``from a.b import c`` gives ``a.b`` and, when relative or with ``from_names``, ``a.b.c`` too (``c`` may be a
    module)."""
    out: list[Import] = []
    package = module_name if is_package else module_name.rpartition(".")[0]

    def visit(node: ast.AST, module_level: bool, type_only: bool = False) -> None:
        def imp(module: str, line: int) -> Import:
            return Import(module, line, module_level, type_only)

        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(imp(a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                out.append(imp(target, child.lineno))
                if from_names or child.module is None or child.level:  # `from . import x`: x may be a module
                    out.extend(imp(f"{target}.{a.name}", child.lineno) for a in child.names)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), module_level, type_only)
            else:
                visit(child, module_level, type_only)

    visit(ast.parse(source), True)
    return out


def modules() -> Iterator[tuple[str, str, str, bool, Path]]:
    """``(rel_path, top package, module name, is_package, path)`` of every module of every package."""
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(["livelora", package, *(parts[:-1] if is_package else parts)])
            yield rel, package, name, is_package, path
