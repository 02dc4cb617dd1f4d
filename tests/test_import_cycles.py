"""No import cycle between the modules of ``gateway/`` and ``cli/``, found by parsing their source (nothing is
imported): an arrow is an import that runs, at module level or inside a function (a lazy import used to step
around a cycle still ties the two modules together); imports under ``if TYPE_CHECKING:`` are not arrows, and
neither is a module's import of a package it lies in (Python initialises that package first in any case)."""

from __future__ import annotations

import pytest
from harness.source import imports_of, modules

PACKAGES = ("gateway", "cli")


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    """``{module: the modules of ``packages`` it imports}``; ``from a import b`` points at module ``a.b`` when
    there is one, else at ``a``."""
    paths = {name: (path, is_pkg) for _rel, pkg, name, is_pkg, path in modules() if pkg in packages}
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in paths.items():
        targets = set()
        for imp in imports_of(path.read_text(), name, is_pkg, from_names=True):
            target = imp.module
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if imp.type_only or not target or target == name or name.startswith(f"{target}."):
                continue
            targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm, iterative),
    each sorted; sorted by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_module_of_gateway_or_cli_is_in_an_import_cycle():
    graph = import_graph()
    assert len(graph) > 100  # the packages were read
    assert cycles(graph) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_cycle_finder_reports_each_cycle_once(graph, expected):
    assert cycles(graph) == expected


def test_no_test_module_imports_another_test_module():
    """Shared test code lives in ``tests/harness/``; a test file importing another couples their fixtures."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [f"{path.relative_to(tests)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not found, found
