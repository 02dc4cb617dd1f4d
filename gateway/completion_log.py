"""The completion log: every served completion, kept in Redis for a retention period.

Each record is one JSON string at ``{prefix}completion:{id}`` with a TTL of
``retention_s`` (default 7 days, :data:`~livelora.gateway.settings.DEFAULT_RETENTION_S`).
Feedback on a completion looks its record up here; an expired or unknown id is
a 404. Records hold the exact prompt and completion token ids, so training
uses the tokens that were served, never a re-tokenization.
"""

from __future__ import annotations

import redis.asyncio as aredis

from livelora.adapters.bus import dumps, redis_unavailable
from livelora.adapters.redis_keys import KeyLayout
from livelora.clients.errors import BadRequestError, InternalError, NotFoundError
from livelora.clients.types.signals import CompletionRecord
from livelora.gateway.settings import DEFAULT_RETENTION_S


class CompletionLog:
    """Record and fetch :class:`CompletionRecord` values.

    Args:
        client: asyncio Redis client (``decode_responses=True``).
        keys: the key layout (prefix).
        retention_s: seconds a record is kept (> 0).
    """

    def __init__(self, client: aredis.Redis, keys: KeyLayout, retention_s: int = DEFAULT_RETENTION_S):
        if retention_s <= 0:
            raise BadRequestError(f"completion retention must be > 0 seconds, got {retention_s}",
                                  param="retention_s")
        self.client = client
        self.keys = keys
        self.retention_s = int(retention_s)

    async def record(self, rec: CompletionRecord) -> None:
        """Store ``rec`` under its id with TTL = retention. Ids are unique: an existing id is not overwritten.

        Raises:
            UnavailableError: Redis unreachable (the caller decides whether serving goes on).
            InternalError: the id is already recorded (ids must be unique per completion).
        """
        with redis_unavailable():
            ok = await self.client.set(self.keys.completion(rec.id), dumps(rec.model_dump(mode="json")),
                                       ex=self.retention_s, nx=True)
        if not ok:
            raise InternalError(f"completion id {rec.id!r} is already recorded")

    async def get(self, completion_id: str) -> CompletionRecord:
        """The record of ``completion_id``.

        Raises:
            NotFoundError: unknown or expired id (``param='completion_id'``).
            UnavailableError: Redis unreachable.
        """
        with redis_unavailable():
            raw = await self.client.get(self.keys.completion(completion_id))
        if raw is None:
            raise NotFoundError(f"No completion {completion_id!r}: unknown id, or older than the "
                                f"retention period ({self.retention_s} s)", param="completion_id")
        return CompletionRecord.model_validate_json(raw)
