"""The walls between packages, checked by parsing every module's imports (nothing is imported or run).

Direction (an arrow points from a package to what it may import)::

    cli ──► gateway ──► adapters ──► core ──► clients
      └───► trainer ──►

* ``clients`` (the SDK: wire types, errors, HTTP transport) imports no other livelora package;
  ``clients.types`` imports nothing of livelora but ``clients.types`` and ``clients.errors``;
* ``core`` (settings, Redis keys, bus, session protocol, loss specs, keys, owners, quotas, metering, rails)
  imports only ``clients``; ``adapters`` (the adapter store) imports ``core`` and ``clients``;
* ``gateway`` and ``trainer`` import ``adapters``, ``core`` and ``clients``, never each other;
* ``cli`` (the composition root) may import everything, and nothing imports it.

Heavy libraries: ``vllm`` is imported (anywhere in a module) only under ``gateway/engines/``; ``torch`` is
imported at module level (outside functions and ``if TYPE_CHECKING:``) only under ``trainer/`` and
``gateway/engines/``, so the gateway validates requests and the CLI starts without loading torch code.

Every import counts, lazy ones inside functions and type-only ones included (a lazy import is still a
dependency). Package folders are read from ``pyproject.toml``'s ``package-dir`` map, so a new package is
covered as soon as it is declared.
"""

from __future__ import annotations

import pytest
from harness.source import imports_of, modules, package_dirs

#: package → the livelora packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "clients": set(),
    "core": {"clients"},
    "adapters": {"core", "clients"},
    "gateway": {"adapters", "core", "clients"},
    "trainer": {"adapters", "core", "clients"},
    "cli": {"gateway", "trainer", "adapters", "core", "clients"},
}
#: folders (relative to the repo) where torch may be imported at module level
TORCH_AT_MODULE_LEVEL = ("trainer/", "gateway/engines/")
#: folders where vllm may be imported at all
VLLM_ALLOWED = ("gateway/engines/",)


def violations(source: str, rel_path: str, package: str, module_name: str, is_package: bool = False) -> list[str]:
    """The layering rules ``source`` breaks, one message per offending import (empty when it keeps them).

    Args:
        rel_path: the file's path relative to the repository (``gateway/api/chat.py``).
        package: its top package (``gateway``).
        module_name: its import name (``livelora.gateway.api.chat``).
    """
    found = []
    for imp in imports_of(source, module_name, is_package):
        top = imp.module.split(".")
        if top[0] == "livelora" and len(top) > 1 and top[1] in ALLOWED and top[1] != package:
            if top[1] not in ALLOWED[package]:
                found.append(
                    f"{rel_path}:{imp.line}: {package} imports {imp.module} "
                    f"({package} may import only {sorted(ALLOWED[package]) or 'no other livelora package'})"
                )
        if (
            module_name.startswith("livelora.clients.types")
            and top[0] == "livelora"
            and not imp.module.startswith(("livelora.clients.types", "livelora.clients.errors"))
        ):
            found.append(
                f"{rel_path}:{imp.line}: clients.types imports {imp.module} (wire types import only "
                "clients.types and clients.errors)"
            )
        if top[0] == "vllm" and not rel_path.startswith(VLLM_ALLOWED):
            found.append(f"{rel_path}:{imp.line}: imports vllm outside {', '.join(VLLM_ALLOWED)}")
        if top[0] == "torch" and imp.module_level and not rel_path.startswith(TORCH_AT_MODULE_LEVEL):
            found.append(
                f"{rel_path}:{imp.line}: imports torch at module level outside "
                f"{', '.join(TORCH_AT_MODULE_LEVEL)} (import it inside the function that needs it)"
            )
    return found


def test_every_package_folder_has_a_layer():
    assert set(package_dirs()) == set(ALLOWED), "a package declared in pyproject.toml needs a row in ALLOWED"


def test_every_module_keeps_the_import_direction_and_the_heavy_library_rules():
    found = []
    for rel, package, name, is_package, path in modules():
        found += violations(path.read_text(), rel, package, name, is_package)
    assert not found, "layering violations:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "rel, package, name, source, expected",
    [
        (
            "trainer/x.py",
            "trainer",
            "livelora.trainer.x",
            "from livelora.gateway.app import create_app\n",
            "trainer/x.py:1: trainer imports livelora.gateway.app",
        ),
        (
            "gateway/x.py",
            "gateway",
            "livelora.gateway.x",
            "def f():\n    from livelora.trainer import executor\n",
            "gateway/x.py:2: gateway imports livelora.trainer",
        ),
        (
            "clients/x.py",
            "clients",
            "livelora.clients.x",
            "import livelora.adapters.store\n",
            "clients/x.py:1: clients imports livelora.adapters.store",
        ),
        (
            "adapters/x.py",
            "adapters",
            "livelora.adapters.x",
            "from livelora.cli.main import app\n",
            "adapters/x.py:1: adapters imports livelora.cli.main",
        ),
        (
            "core/x.py",
            "core",
            "livelora.core.x",
            "from livelora.adapters.store import AdapterStore\n",
            "core/x.py:1: core imports livelora.adapters.store",
        ),
        (
            "gateway/api/x.py",
            "gateway",
            "livelora.gateway.api.x",
            "import torch\n",
            "gateway/api/x.py:1: imports torch at module level",
        ),
        (
            "adapters/x.py",
            "adapters",
            "livelora.adapters.x",
            "def f():\n    import vllm\n",
            "adapters/x.py:2: imports vllm outside",
        ),
        (
            "clients/types/x.py",
            "clients",
            "livelora.clients.types.x",
            "from livelora.clients.futures import APIFuture\n",
            "clients/types/x.py:1: clients.types imports livelora.clients.futures",
        ),
    ],
)
def test_a_deliberately_wrong_import_is_reported(rel, package, name, source, expected):
    found = violations(source, rel, package, name)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize(
    "rel, package, name, source",
    [
        ("gateway/api/x.py", "gateway", "livelora.gateway.api.x", "def f():\n    import torch\n"),
        (
            "adapters/x.py",
            "adapters",
            "livelora.adapters.x",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        ),
        ("gateway/engines/x.py", "gateway", "livelora.gateway.engines.x", "import torch\nimport vllm\n"),
        (
            "cli/x.py",
            "cli",
            "livelora.cli.x",
            "from livelora.gateway.app import create_app\nfrom livelora.trainer import executor\n",
        ),
        ("trainer/losses/_a.py", "trainer", "livelora.trainer.losses._a", "from ._token import LossOutput\n"),
    ],
)
def test_allowed_imports_are_not_reported(rel, package, name, source):
    assert violations(source, rel, package, name) == []
