"""Every package the ``dev`` extra promises is importable here, so that no test is skipped for lack of one."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
DEV = [re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0] for req in PYPROJECT["project"]["optional-dependencies"]["dev"]]


def _modules(dist: str) -> list[str]:
    """Top-level import names that distribution ``dist`` provides."""
    provided = [
        mod
        for mod, dists in md.packages_distributions().items()
        if any(d.lower().replace("_", "-") == dist.lower().replace("_", "-") for d in dists)
    ]
    return sorted(m for m in provided if not m.startswith("_"))


@pytest.mark.parametrize("dist", DEV)
def test_every_dev_extra_is_installed_and_importable(dist):
    md.distribution(dist)  # PackageNotFoundError when the extra was not installed
    modules = _modules(dist)
    assert modules, f"{dist} provides no importable module"
    for module in modules:
        importlib.import_module(module)
