"""Session summaries kept after a session ends: one Redis string per session and a per-tenant index, both
expiring ``session_history_ttl_s`` after the session's last heartbeat or finish (keys:
``docs/internals/redis-keys.md``)."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis.asyncio as aredis

from livelora.core.redis_keys import KeyLayout

log = logging.getLogger(__name__)

#: Most sessions one tenant's index keeps (the oldest beyond are dropped with their summaries).
MAX_INDEXED_SESSIONS = 10_000


class SessionHistory:
    """Read and write session summaries (JSON dicts with ``created``, ``tenant``, ``status``, ...).

    Args:
        redis: an asyncio client with ``decode_responses=True``.
        keys: the key layout.
        ttl_s: how long a summary stays after its last write or :meth:`touch` (s).
    """

    def __init__(self, redis: aredis.Redis, keys: KeyLayout, ttl_s: float):
        self.redis, self.keys, self.ttl_ms = redis, keys, int(ttl_s * 1000)

    async def put(self, sid: str, summary: dict[str, Any]) -> None:
        """Write ``summary`` (its ``tenant`` and ``created`` index it); refreshes both expiries; trims the index
        to its :data:`MAX_INDEXED_SESSIONS` newest (expired summaries leave it when :meth:`newest` meets them)."""
        index = self.keys.session_index(summary["tenant"])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.session_summary(sid), json.dumps(summary), px=self.ttl_ms)
            pipe.zadd(index, {sid: summary["created"]})
            pipe.zremrangebyrank(index, 0, -MAX_INDEXED_SESSIONS - 1)
            pipe.pexpire(index, self.ttl_ms)
            await pipe.execute()

    async def touch(self, sid: str) -> None:
        """Restart the summary's expiry (a heartbeat)."""
        await self.redis.pexpire(self.keys.session_summary(sid), self.ttl_ms)

    async def get(self, sid: str) -> dict[str, Any] | None:
        """The summary, or ``None`` (never had, or expired)."""
        raw = await self.redis.get(self.keys.session_summary(sid))
        return None if raw is None else json.loads(raw)

    async def newest(self, tenant: str, before: float | None = None) -> list[tuple[str, dict[str, Any]]]:
        """``tenant``'s ``(sid, summary)`` newest first, created at or before ``before`` (Unix s) when given."""
        index = self.keys.session_index(tenant)
        sids = await self.redis.zrevrangebyscore(index, "+inf" if before is None else before, "-inf")
        if not sids:
            return []
        raws = await self.redis.mget([self.keys.session_summary(s) for s in sids])
        gone = [s for s, raw in zip(sids, raws, strict=True) if raw is None]
        if gone:
            await self.redis.zrem(index, *gone)
        return [(s, json.loads(raw)) for s, raw in zip(sids, raws, strict=True) if raw is not None]

    async def migrate_legacy(self) -> int:
        """Move the summaries of the single ``sessionhistory`` hash (no expiry, before 2026-12) into per-session
        keys with this TTL, then delete the hash; the number moved."""
        moved = 0
        async for sid, raw in self.redis.hscan_iter(self.keys.legacy_session_history, count=500):
            try:
                summary = json.loads(raw)
                if "tenant" in summary and "created" in summary:
                    await self.put(sid, summary)
                    moved += 1
            except ValueError as exc:
                log.warning("session history: skipped %s: %s", sid, exc)
        await self.redis.delete(self.keys.legacy_session_history)
        return moved
