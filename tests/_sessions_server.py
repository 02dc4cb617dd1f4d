"""One live gateway for the training-session tests (its own Redis prefix; keys deleted at exit).

Import the fixture in a test module::

    from _sessions_server import sessions_server  # noqa: F401  (fixture)
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from _server import LiveServer, start_server

MODEL = "smollm2-135m-instruct"
#: Server-side session TTL in the tests (the official tinker SDK beats every 10 s).
SESSION_TTL_S = 30


def delete_prefix(url: str, prefix: str) -> None:
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture(scope="session")
def sessions_server(livelora_home) -> LiveServer:
    """A gateway on the real SmolLM2 with a unique Redis prefix and the in-process op executor (stopped, and
    its Redis keys deleted, when the test session ends)."""
    from livelora.gateway.settings import GatewaySettings

    prefix = f"livelora-test-{uuid.uuid4().hex[:10]}:"
    os.environ["LIVELORA_SESSION_TTL_S"] = str(SESSION_TTL_S)
    settings = GatewaySettings(
        model=MODEL,
        home=livelora_home,
        device="cpu",
        redis_prefix=prefix,
        max_batch_size=8,
        max_waiting=16,
        executor_in_process=True,
    )
    try:
        live = start_server(settings)
    finally:
        os.environ.pop("LIVELORA_SESSION_TTL_S", None)
    yield live
    live.stop()
    delete_prefix(settings.redis_url, prefix)
