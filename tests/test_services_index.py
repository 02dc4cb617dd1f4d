"""The module index of ``gateway/services/__init__.py`` names every module and package of ``gateway/services``."""

from __future__ import annotations

import ast

from test_layering import package_dirs


def test_the_services_index_names_every_module():
    folder = package_dirs()["gateway"] / "services"
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    missing = sorted(n for n in names if f":mod:`.{n}`" not in doc)
    assert len(names) > 15 and not missing, f"gateway/services/__init__.py does not name: {missing}"
