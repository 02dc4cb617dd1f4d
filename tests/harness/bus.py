"""Real-Redis helpers: fresh key prefixes, their clean-up, and the op-stream calls of the executor tests.

``send`` / ``future`` / ``run_until`` drive a trainer's :class:`~livelora.trainer.executor.OpExecutor` the way a
gateway does: put an op on the model's stream with a pending future, then poll until the future resolves.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


def new_prefix(tag: str = "") -> str:
    """A unique Redis prefix under the test session's (``$LIVELORA_REDIS_PREFIX``, deleted when the tests end)."""
    return f"{os.environ['LIVELORA_REDIS_PREFIX']}{tag + '-' if tag else ''}{uuid.uuid4().hex[:8]}:"


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key starting with ``prefix``."""
    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(f"{prefix}*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def send(r, keys, model_id: str, op) -> None:
    """Queue ``op`` (a :class:`~livelora.core.session_protocol.Op`) for ``model_id`` with a pending future."""
    r.sadd(keys.models, model_id)
    r.set(keys.future(op.request_id), json.dumps({"state": "pending"}))
    r.xadd(keys.ops(model_id), {"op": op.to_json()})


def future(r, keys, request_id: str) -> dict:
    """The future of ``request_id`` as stored (``{"state": "pending"|"done"|"failed", ...}``)."""
    return json.loads(r.get(keys.future(request_id)))


def run_until(executor, cond, timeout_s: float = 120.0) -> None:
    """Poll ``executor`` until ``cond()`` holds.

    Raises:
        AssertionError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        executor.poll(block_ms=50)
