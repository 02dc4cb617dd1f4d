"""The gateway's inner walls and every package's size budget, checked by parsing the source (nothing is run).

* Routes reach the gateway's services only through the typed dependencies of ``gateway/api/deps.py``: no other
  module of ``gateway/`` reads ``app.state`` (``request.app.state``, ``self.app.state``, ``fastapi_app.state``)
  or the per-request ``request.state`` (the principal and caller that auth sets).
* ``gateway/services/`` never imports ``gateway/api/`` (routes call services, not the other way round), and
  ``gateway/engines/`` imports neither.
* No file over 600 lines and no class over 300 lines in the packages (``gateway/``, ``trainer/``, ``adapters/``,
  ``clients/``, ``cli/``: the folders of ``pyproject.toml``'s ``package-dir``); an exception needs an entry in
  :data:`KNOWN_OVERSIZE` (empty today), which must still be oversize, so the list cannot go stale.
"""

from __future__ import annotations

import ast

import pytest
from harness.source import REPO, imports_of, package_dirs

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
#: ``path::Class`` (or ``path`` for a file) → why it is still over budget. Remove an entry when it is split.
KNOWN_OVERSIZE: dict[str, str] = {}
DEPS = "gateway/api/deps.py"


def _gateway_modules():
    folder = package_dirs()["gateway"]
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        parts = path.relative_to(folder).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(["livelora", "gateway", *(parts[:-1] if is_package else parts)])
        yield rel, name, is_package, path


# ------------------------------------------------------------------------------------------------ app.state
def _names_an_app(node: ast.expr) -> bool:
    """``app``, ``fastapi_app``, ``request.app``, ``self.app``, ..."""
    if isinstance(node, ast.Name):
        return node.id == "app" or node.id.endswith("_app")
    if isinstance(node, ast.Attribute):
        return node.attr == "app" or node.attr.endswith("_app")
    return False


def _names_a_request(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "request") or (
        isinstance(node, ast.Attribute) and node.attr == "request"
    )


def state_reads(source: str, rel_path: str) -> list[str]:
    """Every ``<app>.state`` / ``request.state`` access in ``source`` (also through ``getattr``), one message each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Attribute) and node.attr == "state":
            target = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "state"
        ):
            target = node.args[0]
        if target is not None and (_names_an_app(target) or _names_a_request(target)):
            found.append(
                f"{rel_path}:{node.lineno}: reads {ast.unparse(target)}.state; take a typed dependency "
                f"from {DEPS} instead"
            )
    return found


def test_only_api_deps_knows_where_the_services_live():
    found = []
    for rel, _, _, path in _gateway_modules():
        if rel != DEPS:
            found += state_reads(path.read_text(), rel)
    assert not found, "app.state / request.state outside api/deps.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "def f(request):\n    return request.app.state.registry\n",
        "def f(request):\n    return getattr(request.app.state, 'registry', None)\n",
        "class M:\n    def f(self):\n        return self.fastapi_app.state.keys\n",
        "def f(app):\n    app.state.sessions = 1\n",
        "def f(request):\n    return request.state.caller\n",
        "def f(request):\n    return getattr(request, 'state')\n",
    ],
)
def test_a_deliberate_app_state_read_is_reported(source):
    found = state_reads(source, "gateway/api/x.py")
    assert len(found) == 1 and found[0].startswith("gateway/api/x.py:"), found


def test_state_dicts_that_are_not_the_apps_are_not_reported():
    assert (
        state_reads(
            "def f(scope):\n    state = scope.setdefault('state', {})\n    state['x'] = 1\n"
            "    return self.worker.state\n",
            "gateway/middleware/auth.py",
        )
        == []
    )


# ------------------------------------------------------------------------------------------------ directions
def test_services_never_import_the_routes_and_engines_import_neither():
    found = []
    for rel, name, is_package, path in _gateway_modules():
        forbidden = ()
        if rel.startswith("gateway/services/"):
            forbidden = ("livelora.gateway.api",)
        elif rel.startswith("gateway/engines/"):
            forbidden = ("livelora.gateway.api", "livelora.gateway.services")
        for imp in imports_of(path.read_text(), name, is_package):
            if imp.module.startswith(forbidden):
                found.append(f"{rel}:{imp.line}: imports {imp.module}")
    assert not found, "gateway layers: api → services → engines\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------------ sizes
def oversize(source: str, rel_path: str) -> list[str]:
    """``path`` when the file has more than :data:`MAX_FILE_LINES` lines, ``path::Class`` for each class (nested
    ones too) longer than :data:`MAX_CLASS_LINES` lines (decorators included)."""
    out = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        out.append(f"{rel_path} ({lines} lines)")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            size = node.end_lineno - start + 1
            if size > MAX_CLASS_LINES:
                out.append(f"{rel_path}::{node.name} ({size} lines)")
    return out


def _all_package_files():
    for folder in package_dirs().values():
        for path in sorted(folder.rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path


def test_every_package_file_and_class_keeps_the_size_budget():
    found = []
    for rel, path in _all_package_files():
        found += oversize(path.read_text(), rel)
    keys = {f.split(" (")[0] for f in found}
    unexpected = [f for f in found if f.split(" (")[0] not in KNOWN_OVERSIZE]
    assert not unexpected, (
        f"over the budget (files <= {MAX_FILE_LINES} lines, classes <= {MAX_CLASS_LINES}); "
        "split by concern:\n" + "\n".join(unexpected)
    )
    stale = sorted(set(KNOWN_OVERSIZE) - keys)
    assert not stale, f"no longer over the budget: remove from KNOWN_OVERSIZE: {stale}"


def test_the_size_check_sees_every_package():
    seen = {rel.split("/")[0] for rel, _ in _all_package_files()}
    assert {"gateway", "trainer", "adapters", "clients", "cli"} <= seen


def test_a_deliberately_long_file_and_class_are_reported():
    long_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n"
    assert oversize(long_class, "gateway/x.py") == [f"gateway/x.py::Big ({MAX_CLASS_LINES + 1} lines)"]
    long_file = "x = 1\n" * (MAX_FILE_LINES + 1)
    assert oversize(long_file, "adapters/x.py") == [f"adapters/x.py ({MAX_FILE_LINES + 1} lines)"]
    assert oversize("class Small:\n    x = 1\n" + "y = 2\n" * (MAX_FILE_LINES - 2), "cli/x.py") == []
