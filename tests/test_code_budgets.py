"""Budgets that keep the package code in pieces a reader can hold, checked by parsing the source (nothing is run).

* No function or method of the six packages has more than 60 body lines (the docstring left out), except the
  few of :data:`LONG_FUNCTIONS`, each with its reason; an exception that no longer needs it must be removed.
* Every class within 10 % of its 300-line cap (270 lines and more) has a split plan: a row in the table of
  ``docs/architecture.md`` ("Size budgets and split plans") naming the seam it will split along.
* pyproject's package list is the package folders on disk: every folder with an ``__init__.py`` under the six
  package folders is listed, nothing listed is missing, and a folder of ``.py`` files that is not a package is
  named in :data:`NOT_PACKAGES`.

``python tests/harness/budgets.py`` prints what is within 10 % of its cap (files, classes, functions, module
docstrings); files and classes over their caps: ``tests/test_gateway_structure.py``.
"""

from __future__ import annotations

import ast
import tomllib

from harness.budgets import (
    MAX_CLASS_LINES,
    MAX_FILE_LINES,
    MAX_FUNCTION_LINES,
    MAX_MODULE_DOC_LINES,
    REPO,
    Measure,
    all_measures,
    measures,
    near_cap,
    package_dirs,
    planned_classes,
    report,
)

#: ``path::function`` → why it may be longer than :data:`MAX_FUNCTION_LINES`. Remove an entry when it is split.
LONG_FUNCTIONS: dict[str, str] = {
    "clients/recipes/gsm8k_rl.py::run": "a recipe's loop read top to bottom (sample, grade, step, evaluate, log)",
    "clients/recipes/distill.py::run": "a recipe's loop read top to bottom (student samples, teacher scores, step)",
    "clients/recipes/kto_ratings.py::run": "a recipe's loop read top to bottom (ratings, reference, KTO step, log)",
    "clients/recipes/code_rl.py::Episodes.run": "a recipe's episode loop in order (sample, tool turn, grade, reply)",
}
#: folders of ``.py`` files under the package folders that are not packages (not installed) → why
NOT_PACKAGES: dict[str, str] = {
    "clients/examples": "scripts run as `python clients/examples/sl_loop.py` (docs/training.md), not installed",
}


def _found() -> list[Measure]:
    return all_measures()


# ------------------------------------------------------------------------------------------------ functions
def test_no_function_is_over_its_budget_outside_the_named_exceptions():
    long = {m.name: m.lines for m in _found() if m.kind == "function" and m.lines > MAX_FUNCTION_LINES}
    unexpected = sorted(f"{name} ({n} body lines)" for name, n in long.items() if name not in LONG_FUNCTIONS)
    assert not unexpected, (
        f"functions over {MAX_FUNCTION_LINES} body lines: split them along their seams (named steps, one job "
        "each):\n" + "\n".join(unexpected)
    )
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"within the budget now (or gone): remove from LONG_FUNCTIONS: {stale}"


def test_the_function_measure_counts_the_body_without_the_docstring():
    source = (
        "def f():\n"
        '    """Doc\n\n    more doc."""\n'
        "    x = 1\n"
        "\n"
        "    def inner():\n"
        "        return x\n"
        "    return inner\n"
        "class C:\n"
        "    async def g(self):\n"
        '        """Only a docstring."""\n'
        "    @property\n"
        "    def h(self):\n"
        "        return 1\n"
    )
    sizes = {m.name: m.lines for m in measures(source, "core/x.py") if m.kind == "function"}
    assert sizes == {"core/x.py::f": 5, "core/x.py::f.inner": 1, "core/x.py::C.g": 0, "core/x.py::C.h": 1}


def test_a_deliberately_long_function_is_over_the_budget():
    body = "    x = 1\n" * (MAX_FUNCTION_LINES + 1)
    (fn,) = [m for m in measures(f"def long():\n    '''Doc.'''\n{body}", "cli/x.py") if m.kind == "function"]
    assert (fn.name, fn.lines) == ("cli/x.py::long", MAX_FUNCTION_LINES + 1)


# ------------------------------------------------------------------------------------------------ class plans
def test_every_class_near_its_cap_has_a_split_plan():
    plans = planned_classes()
    near = {m.name: m.lines for m in _found() if m.kind == "class" and near_cap(m)}
    missing = sorted(f"{name} ({n} lines)" for name, n in near.items() if name not in plans)
    assert not missing, (
        f"classes within 10 % of the {MAX_CLASS_LINES}-line cap without a split plan: add a row (class, lines, the "
        "seam it will split along) to the table in docs/architecture.md, 'Size budgets and split plans':\n"
        + "\n".join(missing)
    )


def test_every_split_plan_names_a_class_that_exists_with_a_seam():
    classes = {m.name for m in _found() if m.kind == "class"}
    plans = planned_classes()
    assert len(plans) >= 5  # the table was found and read
    unknown = sorted(set(plans) - classes)
    assert not unknown, f"split plans for classes that do not exist (renamed or moved?): {unknown}"
    assert all(len(seam.split()) >= 4 for seam in plans.values()), plans


def test_the_plan_table_is_read_from_its_own_section_only():
    page = (
        "# Page\n\n| `a/x.py::Elsewhere` | 1 | not this table |\n\n## Size budgets and split plans\n\n"
        "| class | lines | seam |\n|---|---|---|\n| `trainer/x.py::Big` | 290 | reads from writes |\n\n"
        "## Next\n\n| `b/y.py::After` | 2 | nor this |\n"
    )
    assert planned_classes(page) == {"trainer/x.py::Big": "reads from writes"}


def test_the_report_lists_what_is_near_its_cap_and_marks_a_class_without_a_plan():
    found = [
        Measure("class", "core/x.py::Near", 270, MAX_CLASS_LINES),
        Measure("class", "core/x.py::Far", 269, MAX_CLASS_LINES),
        Measure("function", "core/x.py::f", 54, MAX_FUNCTION_LINES),
        Measure("function", "core/x.py::g", 53, MAX_FUNCTION_LINES),
        Measure("docstring", "core/x.py", 14, MAX_MODULE_DOC_LINES),
        Measure("file", "core/x.py", 540, MAX_FILE_LINES),
    ]
    lines = report(found).splitlines()
    # largest share of its cap first (14/15, then 9/10 each, by name)
    listed = [line.split()[:3] for line in lines[1:-1]]
    assert listed == [
        ["docstring", "14/15", "core/x.py"],
        ["file", "540/600", "core/x.py"],
        ["class", "270/300", "core/x.py::Near"],
        ["function", "54/60", "core/x.py::f"],
    ]
    assert "NO PLAN" in lines[3] and "NO PLAN" not in lines[4]
    assert lines[-1].strip() == "1 files, 1 classes, 1 functions, 1 module docstrings"


def _constant(test_file: str, name: str) -> int:
    tree = ast.parse((REPO / "tests" / test_file).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in tests/{test_file}")


def test_the_report_uses_the_caps_the_size_tests_enforce():
    assert _constant("test_gateway_structure.py", "MAX_FILE_LINES") == MAX_FILE_LINES
    assert _constant("test_gateway_structure.py", "MAX_CLASS_LINES") == MAX_CLASS_LINES
    assert _constant("test_code_text.py", "MAX_MODULE_DOC_LINES") == MAX_MODULE_DOC_LINES


# ------------------------------------------------------------------------------------------------ package list
def _listed_packages() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def _package_folders() -> set[str]:
    """``livelora.x.y`` for every folder with an ``__init__.py`` under the six package folders."""
    out = set()
    for top, folder in package_dirs().items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            out.add(".".join(["livelora", top, *parts]))
    return out


def test_the_installed_package_list_is_the_package_folders_on_disk():
    listed, on_disk = _listed_packages(), _package_folders()
    assert len(on_disk) >= 20 and "livelora.gateway.services.serving" in on_disk  # the folders were found
    assert not on_disk - listed, f"package folders not in pyproject's packages (not installed): {on_disk - listed}"
    assert not listed - on_disk, f"pyproject lists packages with no folder (or no __init__.py): {listed - on_disk}"


def test_every_folder_of_python_files_is_a_package_or_named_as_not_one():
    loose = set()
    for folder in package_dirs().values():
        for path in folder.rglob("*.py"):
            if not (path.parent / "__init__.py").is_file():
                loose.add(path.parent.relative_to(REPO).as_posix())
    assert loose == set(NOT_PACKAGES), (
        f"folders of .py files without __init__.py (add one, or name the folder in NOT_PACKAGES): "
        f"{sorted(loose - set(NOT_PACKAGES))}; named but gone or now packages: {sorted(set(NOT_PACKAGES) - loose)}"
    )
