"""Futures of Tinker ops: results in Redis (``future:{request_id}``), waiters woken by a pub/sub channel.

Training ops are resolved by the op executor, samples by :mod:`.sampling`; ``retrieve_future`` waits up to
``long_poll_s`` for the result, then answers 408 ``try_again`` (:class:`NotReady`); an unknown or expired
request id is 410 (:class:`GoneError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from livelora.clients.errors import NotFoundError
from livelora.core.bus import redis_unavailable
from livelora.gateway.services.sessions.context import SessionContext

log = logging.getLogger(__name__)


class GoneError(NotFoundError):
    """An unknown, expired or finished session or future (HTTP 410: the tinker SDK stops or resubmits)."""

    status = 410
    default_code = "gone"


class NotReady:
    """Returned by :meth:`~livelora.gateway.services.sessions.SessionService.retrieve_future` when the op is still
    running (the route answers 408)."""

    def __init__(self, request_id: str):
        self.request_id = request_id


class Futures:
    """Create, resolve and wait for op futures (see the module docstring)."""

    def __init__(self, ctx: SessionContext):
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self._waiters: dict[str, asyncio.Event] = {}
        self._listener: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe to future notifications."""
        self._listener = asyncio.create_task(self._listen())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(self.keys.futures_channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        event = self._waiters.get(msg["data"])
                        if event is not None:
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarted: resubscribe (waiters also re-check periodically)
                log.warning("futures listener: %s", exc)
                await asyncio.sleep(1.0)

    async def create(self, request_id: str) -> None:
        await self.redis.set(
            self.keys.future(request_id), json.dumps({"state": "pending"}), ex=self.settings.future_ttl_s
        )

    async def resolve(self, request_id: str, record: str) -> None:
        await self.redis.set(self.keys.future(request_id), record, ex=self.settings.future_ttl_s)
        await self.redis.publish(self.keys.futures_channel, request_id)
        event = self._waiters.get(request_id)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, wait_s: float | None = None) -> dict[str, Any] | NotReady:
        """The op's result dict, its ``{"error", "category", ...}`` dict, or :class:`NotReady` after waiting.

        Raises:
            GoneError: unknown or expired request id.
        """
        deadline = time.monotonic() + (self.settings.long_poll_s if wait_s is None else wait_s)
        event = self._waiters.setdefault(request_id, asyncio.Event())
        try:
            while True:
                event.clear()
                with redis_unavailable():
                    raw = await self.redis.get(self.keys.future(request_id))
                if raw is None:
                    raise GoneError(  # also when Redis restarted empty while the op ran: asked again within 1 s
                        f"request {request_id!r} is unknown, its result expired, or Redis lost it (a restart "
                        "without persistence or a flush); submit the op again",
                        param="request_id",
                    )
                record = json.loads(raw)
                if record["state"] == "done":
                    return record["result"]
                if record["state"] == "failed":
                    return {k: v for k, v in record.items() if k != "state"}
                left = deadline - time.monotonic()
                if left <= 0:
                    return NotReady(request_id)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
        finally:
            self._waiters.pop(request_id, None)
