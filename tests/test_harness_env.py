"""The suite ignores the caller's livelora environment (tests/harness/environ.py): with ``LIVELORA_REDIS_PREFIX`` set to
a prefix another install owns, and other ``LIVELORA_*`` settings of a user's shell, the tests still bind their
own stores to their own prefix. The probe runs in a child pytest with that environment."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from harness.bus import REDIS_URL, delete_prefix
from harness.environ import SET_HERE, SUITE_INPUTS

from livelora.core.install import InstallMismatchError, bind_install, store_id
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import CommonSettings

TESTS = Path(__file__).resolve().parent
#: what a user of a shared Redis may have in their shell (README: "LIVELORA_REDIS_PREFIX keeps installs apart")
CALLER = {
    "LIVELORA_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens there
    "LIVELORA_GATE_ENABLED": "true",
    "LIVELORA_API_KEY": "tml-000000000000-not-a-key",
    "LIVELORA_DEVICE": "cuda:7",
}


def test_the_probe_binds_the_session_store_to_the_sessions_own_prefix(livelora_home):
    """What a gateway or trainer the tests start on the session's store does first (``live_server``): resolve its
    settings from the environment and bind the store to the Redis prefix (or find it bound already)."""
    settings = CommonSettings()
    assert settings.redis_prefix == os.environ["LIVELORA_REDIS_PREFIX"]
    assert settings.redis_prefix.startswith("livelora-test-") and settings.redis_url == REDIS_URL
    assert os.environ["LIVELORA_GATE_ENABLED"] == "false"
    assert (
        not {n for n in os.environ if n.startswith("LIVELORA_")}
        - SUITE_INPUTS
        - {
            *SET_HERE,
            "LIVELORA_HOME",
            "LIVELORA_TOKENIZER_CACHE",  # the session's own (harness.plugin._tokenizer_cache)
        }
    )
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        keys = KeyLayout(settings.redis_prefix)
        assert bind_install(client, keys, livelora_home, settings.redis_url) == store_id(livelora_home)
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_a_callers_prefix_of_another_install_and_other_settings_do_not_reach_the_tests(tmp_path):
    prefix = f"someone-else-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        bind_install(client, KeyLayout(prefix), tmp_path / "their-store", REDIS_URL)
        with pytest.raises(InstallMismatchError):  # what the tests met before the harness cleared the variable
            bind_install(client, KeyLayout(prefix), Path(os.environ["LIVELORA_HOME"]), REDIS_URL)
        env = {**os.environ, **CALLER, "LIVELORA_REDIS_PREFIX": prefix}
        probe = f"{Path(__file__).name}::test_the_probe_binds_the_session_store_to_the_sessions_own_prefix"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", probe],
            cwd=TESTS,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
        assert sorted(client.scan_iter(f"{prefix}*")) == [f"{prefix}store_id"]  # the child wrote nothing there
    finally:
        delete_prefix(REDIS_URL, prefix)
        client.close()
