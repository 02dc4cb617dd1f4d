"""Shared fixtures: one store (LIVELORA_HOME) per test session, the real SmolLM2 model, real Redis."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def livelora_home() -> Path:
    """The store used by the tests: ``$LIVELORA_HOME`` or ``<repo>/.livelora-home`` (keeps the converted model)."""
    home = Path(os.environ.get("LIVELORA_HOME") or REPO / ".livelora-home")
    home.mkdir(parents=True, exist_ok=True)
    os.environ["LIVELORA_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def base_ref(livelora_home):
    """The built-in SmolLM2-135M-Instruct, converted once and cached in the test store."""
    from livelora.adapters.models import resolve_base_model
    from livelora.adapters.settings import DEFAULT_MODEL

    return resolve_base_model(DEFAULT_MODEL, livelora_home)


@pytest.fixture(scope="session")
def tokenizer(base_ref):
    from livelora.adapters.models import load_tokenizer

    return load_tokenizer(base_ref)
