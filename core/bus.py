"""Redis as the bus: connections, consumer groups, notices, error mapping.

Key names live in :class:`~livelora.core.redis_keys.KeyLayout` (one class for every key and channel).
Each signals-stream entry has one field, ``event``, holding the event as JSON
(see :mod:`livelora.clients.types.signals`).

Every Redis call that can fail because Redis is unreachable goes through
:func:`redis_unavailable` (a context manager usable around sync or async code),
which raises :class:`~livelora.clients.errors.UnavailableError` (HTTP 503 with
``Retry-After``) instead of redis-py's ``ConnectionError``/``TimeoutError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import redis
import redis.asyncio as aredis

from livelora.clients.errors import UnavailableError
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout

#: Seconds a client is told to wait (``Retry-After``) when Redis is unreachable.
RETRY_AFTER_S = 1.0


@contextlib.contextmanager
def redis_unavailable(what: str = "Redis") -> Iterator[None]:
    """Map redis-py connection failures inside the block to :class:`UnavailableError`.

    Works around ``await`` expressions too (the exception propagates through the
    ``with`` block). ``redis.exceptions.ResponseError`` (a bad command) is not
    mapped: it is a bug, not unavailability.

    Raises:
        UnavailableError: Redis refused the connection, timed out, is loading
            its data set, or is read-only (a replica); ``retry_after`` = 1 s.
    """
    try:
        yield
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        redis.exceptions.ReadOnlyError,
        OSError,
    ) as exc:
        from livelora.core import metrics

        metrics.REDIS_ERRORS.labels(what).inc()
        raise UnavailableError(
            f"{what} is unreachable ({type(exc).__name__}: {exc}); retry later", retry_after=RETRY_AFTER_S
        ) from exc


def connect_async(url: str, *, timeout_s: float = 2.0) -> aredis.Redis:
    """An asyncio Redis client (``decode_responses=True``: every value is ``str``).

    No connection is made until the first command. ``timeout_s`` bounds connect
    and per-command socket waits (not blocking reads, which pass their own).
    """
    return aredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s, health_check_interval=30)


def connect_sync(url: str, *, timeout_s: float = 2.0) -> redis.Redis:
    """A blocking Redis client (``decode_responses=True``); see :func:`connect_async`."""
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s, health_check_interval=30)


def volatile_warning(config: dict[str, str], url: str) -> str | None:
    """A warning for a Redis whose ``CONFIG GET append*`` answer (``config``) shows it may lose acknowledged
    writes on a restart (no AOF, or AOF not fsync'd at every write); ``None`` when it persists each write."""
    if config.get("appendonly") == "yes" and config.get("appendfsync") == "always":
        return None
    how = "without append-only persistence" if config.get("appendonly") != "yes" else "with appendfsync "
    how += "" if config.get("appendonly") != "yes" else config.get("appendfsync", "?")
    return (
        f"Redis at {url} runs {how}: a restart loses its queued signals, sessions and futures; accepted signals "
        "are re-queued from LIVELORA_HOME/data/accepted, sessions and futures in flight fail (docs/scaling-out.md)"
    )


def dumps(obj: Any) -> str:
    """Compact JSON used for every value livelora writes to Redis."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def ensure_group(client: redis.Redis, keys: KeyLayout) -> None:
    """Create the signals stream and its ``trainers`` consumer group if missing (from the start, id 0).

    Raises:
        UnavailableError: Redis unreachable.
    """
    with redis_unavailable():
        try:
            client.xgroup_create(keys.signals, TRAINERS_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


async def ensure_group_async(client: aredis.Redis, keys: KeyLayout) -> None:
    """Async twin of :func:`ensure_group`."""
    with redis_unavailable():
        try:
            await client.xgroup_create(keys.signals, TRAINERS_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def publish_notice(client: redis.Redis, keys: KeyLayout, notice: dict[str, Any]) -> int:
    """Publish a notice (JSON) on the notices channel; returns the number of subscribers reached.

    Notices are an optimisation: a gateway that misses one catches up from the
    store, so a failed publish is reported but never undoes the version.

    Raises:
        UnavailableError: Redis unreachable.
    """
    with redis_unavailable():
        return int(client.publish(keys.notices, dumps(notice)))


async def delete_prefix(client: aredis.Redis, prefix: str) -> int:
    """Delete every key starting with ``prefix`` (tests and ``livelora`` admin clean-up); returns the count."""
    n = 0
    with redis_unavailable():
        async for key in client.scan_iter(match=prefix + "*", count=500):
            n += await client.delete(key)
    return n
