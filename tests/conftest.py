"""Shared fixtures: one store (LIVELORA_HOME) per test session, the real SmolLM2 model, real Redis."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every gateway/trainer a test starts with default settings writes its Redis keys (completion log, signals,
# sessions) under one prefix per test session, deleted at the end (see _redis_prefix_cleanup).
os.environ.setdefault("LIVELORA_REDIS_PREFIX", f"livelora-test-{uuid.uuid4().hex[:12]}:")
# Trainer processes the tests start run without the evaluation gate (it holds out one rating in ten and costs
# seconds per update on these CPUs, which the loop-mechanics tests do not measure); tests/test_gate.py turns it on.
os.environ.setdefault("LIVELORA_GATE_ENABLED", "false")

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
    from livelora.core.base_models import resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL

    return resolve_base_model(DEFAULT_MODEL, livelora_home)


@pytest.fixture(scope="session")
def tokenizer(base_ref):
    from livelora.core.base_models import load_tokenizer

    return load_tokenizer(base_ref)


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    """The SDK's tokenizer cache (files fetched from ``GET /api/v1/tokenizer``) in the test session's tmp dir, not
    in ``~/.cache/livelora``."""
    if "LIVELORA_TOKENIZER_CACHE" not in os.environ:
        os.environ["LIVELORA_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizer-cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _redis_prefix_cleanup():
    """Delete the session's Redis keys (prefix ``$LIVELORA_REDIS_PREFIX``) when the tests end."""
    yield
    prefix = os.environ["LIVELORA_REDIS_PREFIX"]
    if not prefix.startswith("livelora-test-"):
        return
    import redis

    try:
        client = redis.Redis.from_url(os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"))
        for key in client.scan_iter(match=prefix + "*", count=500):
            client.delete(key)
        client.close()
    except redis.exceptions.ConnectionError:
        pass
