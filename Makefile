# Maintainer tasks (CONTRIBUTING.md, "Tasks"). Run them in the dev virtual environment: pip install -e '.[dev]'.
# CI (.ci/run) runs lint and typecheck, then the README's test line (the whole suite).
PYTHON ?= python
STRUCTURE = tests/test_layering.py tests/test_gateway_structure.py tests/test_code_budgets.py \
            tests/test_code_text.py tests/test_maintainer_tools.py

.PHONY: lint format typecheck structure test-fast test docs budgets

lint:  ## ruff's lint rules and its formatting, checked (nothing is changed)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:  ## ruff's formatting and its safe fixes, applied
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

typecheck:  ## mypy on the packages of pyproject.toml's [tool.mypy] (.ci/typecheck resolves livelora.*)
	$(PYTHON) .ci/typecheck

structure:  ## the fast structural checks (imports, sizes, budgets, in-code text, these tools): seconds
	$(PYTHON) -m pytest -q -p no:cacheprovider $(STRUCTURE)

test-fast:  ## every package, the slow scenarios left out
	$(PYTHON) -m pytest -m "not slow" -q

test:  ## the whole suite, as CI runs it
	$(PYTHON) -m pytest -x -q

docs:  ## the documentation site, built as tests/test_docs_build.py builds it (warnings fail)
	$(PYTHON) -m mkdocs build --strict --site-dir build/site

budgets:  ## what is within 10 % of its size cap (files, classes, functions, module docstrings)
	$(PYTHON) tests/harness/budgets.py
