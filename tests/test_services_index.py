"""Each package of ``gateway/services`` names every module and sub-package it holds in its ``__init__`` docstring."""

from __future__ import annotations

import ast

from harness.source import package_dirs


def test_every_services_package_indexes_its_modules():
    top = package_dirs()["gateway"] / "services"
    packages = [top, *sorted(p for p in top.iterdir() if (p / "__init__.py").is_file())]
    assert len(packages) >= 6
    missing: dict[str, list[str]] = {}
    for folder in packages:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        names += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
        if gone := sorted(n for n in names if f":mod:`.{n}`" not in doc):
            missing[str(folder.relative_to(top.parent.parent))] = gone
    assert not missing, f"services packages whose docstring does not name their modules: {missing}"
