"""The maintainer tools agree with each other: pre-commit's ruff is the dev extra's ruff, its structural hook runs
what ``make structure`` runs, CI lints and type-checks before the suite, and ``.ci/typecheck`` lets mypy resolve
``livelora.*`` (the folders install under other names). CONTRIBUTING.md ("Tasks") lists the commands."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shlex
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEV = PYPROJECT["project"]["optional-dependencies"]["dev"]


def _pin(name: str) -> str:
    (pin,) = [d.split("==", 1)[1] for d in DEV if d.startswith(f"{name}==")]
    return pin


def _hooks() -> dict[str, dict]:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return {
        hook["id"]: {**hook, "repo": repo["repo"], "rev": repo.get("rev")}
        for repo in config["repos"]
        for hook in repo["hooks"]
    }


def _make_targets() -> dict[str, list[str]]:
    """``{target: its recipe lines}`` of the Makefile, ``$(STRUCTURE)`` and ``$(PYTHON)`` expanded."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    structure = re.search(r"^STRUCTURE = (.*)$", text, re.M).group(1).split()
    targets: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^([\w-]+):", line):
            current = targets.setdefault(m.group(1), [])
        elif line.startswith("\t") and current is not None:
            current.append(line.strip().replace("$(STRUCTURE)", " ".join(structure)).replace("$(PYTHON)", "python"))
    return targets


def test_pre_commit_runs_the_dev_extras_ruff_check_and_format():
    hooks = _hooks()
    assert {"ruff-check", "ruff-format"} <= set(hooks)
    for hook in ("ruff-check", "ruff-format"):
        assert hooks[hook]["repo"] == "https://github.com/astral-sh/ruff-pre-commit"
        assert hooks[hook]["rev"] == f"v{_pin('ruff')}", "pin ruff-pre-commit to the dev extra's ruff"


def test_the_structural_hook_runs_what_make_structure_runs_and_the_files_exist():
    hook = _hooks()["structure"]
    assert hook["repo"] == "local" and hook["language"] == "system" and hook["pass_filenames"] is False
    (recipe,) = _make_targets()["structure"]
    assert shlex.split(hook["entry"]) == shlex.split(recipe)
    files = [a for a in shlex.split(recipe) if a.startswith("tests/")]
    assert "tests/test_layering.py" in files and "tests/test_code_budgets.py" in files
    assert all((REPO / f).is_file() for f in files), files


def test_the_make_targets_the_docs_name_exist():
    targets = _make_targets()
    assert {"lint", "format", "typecheck", "structure", "test-fast", "test", "docs", "budgets"} <= set(targets)
    assert targets["lint"] == ["python -m ruff check .", "python -m ruff format --check ."]
    assert targets["typecheck"] == ["python .ci/typecheck"]
    assert targets["test"] == ["python -m pytest -x -q"]
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    for name in ("lint", "format", "typecheck", "structure", "test-fast", "test", "docs", "budgets"):
        assert f"make {name}" in contributing, f"CONTRIBUTING.md does not name `make {name}`"


def test_ci_lints_and_type_checks_before_the_test_suite():
    lines = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    suite = len(lines) - 1  # the README's test line, last (tests/test_readme_commands.py)
    assert lines[suite].endswith("pytest -x -q")

    def first(command: str) -> int:
        return next(i for i, line in enumerate(lines) if command in line)

    assert first("ruff check .") < suite and first("ruff format --check .") < suite
    assert first("python .ci/typecheck") < suite
    assert first('startswith("ruff==")') < first("ruff check .")  # the pinned ruff, installed first
    assert first("pip install -q -e '.[dev]'") < first("python .ci/typecheck")  # mypy and the imported libraries


def test_mypy_is_pinned_and_configured_for_the_clean_packages():
    assert re.fullmatch(r"\d+\.\d+\.\d+", _pin("mypy"))
    mypy = PYPROJECT["tool"]["mypy"]
    assert {"livelora.core", "livelora.clients", "livelora.adapters"} <= set(mypy["packages"])
    assert "livelora.gateway.engines.base" in mypy["modules"]
    assert mypy["mypy_path"] == "build/typecheck"
    skipped = {m for o in mypy["overrides"] if o.get("ignore_errors") for m in o["module"]}
    checked = ("livelora.core", "livelora.clients", "livelora.adapters", "livelora.gateway.engines.base")
    assert not [m for m in skipped if m.startswith(checked)]  # no part of them left out (the recipes included)


def _typecheck_module():
    loader = importlib.machinery.SourceFileLoader("ci_typecheck", str(REPO / ".ci" / "typecheck"))
    spec = importlib.util.spec_from_loader("ci_typecheck", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_typecheck_links_each_package_folder_under_its_installed_name():
    typecheck = _typecheck_module()
    typecheck.link_packages()
    links = REPO / PYPROJECT["tool"]["mypy"]["mypy_path"] / "livelora"
    assert typecheck.LINKS == links
    for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        link = links / name.removeprefix("livelora.")
        assert link.is_symlink() and link.resolve() == (REPO / folder).resolve(), link
        assert not os.path.isabs(os.readlink(link))  # relative: the checkout may move
    assert (links / "core" / "settings.py").read_text() == (REPO / "core" / "settings.py").read_text()
