"""The signals stream's door: every accepted signal event is written in one Lua script, all of it or none.

A re-rate of a completion by the same rater replaces the queued rating (:meth:`KeyLayout.rating`); an
``Idempotency-Key`` stores the first answer (:meth:`KeyLayout.idem`, 24 h) so a retry adds nothing and a different body
with that key is a 409. With an accepted-signal log (:class:`~livelora.core.accept_log.AcceptLog`) a new event is
also appended there, fsync'd, before the answer: what Redis loses later is re-queued from it. The rules:
``docs/internals/live-training.md``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

import redis.asyncio as aredis

from livelora.clients.errors import ConflictError, UnavailableError
from livelora.clients.types.signals import parse_stream_event
from livelora.core import metrics
from livelora.core.bus import dumps, redis_unavailable
from livelora.core.redis_keys import KeyLayout

log = logging.getLogger(__name__)

# KEYS[1] signals stream, KEYS[2] idempotency key or "", KEYS[3] rating key or ""
# ARGV[1] event JSON, ARGV[2] request fingerprint, ARGV[3] idem TTL s, ARGV[4] rating TTL s, ARGV[5] event id
_ACCEPT_LUA = """
if KEYS[2] ~= '' then
  local prev = redis.call('GET', KEYS[2])
  if prev then return {'replay', prev} end
end
local replaces = ''
if KEYS[3] ~= '' then
  replaces = redis.call('GET', KEYS[3]) or ''
  redis.call('SET', KEYS[3], ARGV[5], 'EX', ARGV[4])
end
local sid = redis.call('XADD', KEYS[1], '*', 'event', ARGV[1], 'replaces', replaces)
local stored = cjson.encode({fingerprint = ARGV[2], event = ARGV[1], replaces = replaces, stream_id = sid})
if KEYS[2] ~= '' then redis.call('SET', KEYS[2], stored, 'EX', ARGV[3]) end
return {'new', stored}
"""


class SignalStream:
    """Writes signal events to the Redis signals stream (see the module docstring).

    Args:
        client: asyncio Redis client (``decode_responses=True``).
        keys: key layout.
        idempotency_ttl_s: lifetime of idempotency records (seconds).
        rating_ttl_s: lifetime of a rating key (seconds; the completion log's retention).
        accept_log: where each new event is made durable before the answer (``None``: Redis alone).
    """

    def __init__(
        self, client: aredis.Redis, keys: KeyLayout, idempotency_ttl_s: int, rating_ttl_s: int, accept_log: Any = None
    ):
        self.keys = keys
        self.accept_log = accept_log
        self.idempotency_ttl_s = int(idempotency_ttl_s)
        self.rating_ttl_s = int(rating_ttl_s)
        self._accept = client.register_script(_ACCEPT_LUA)

    async def submit(
        self,
        route: str,
        event: Any,
        body: Any,
        caller: str | None,
        idempotency_key: str | None,
        rating_key: str | None = None,
    ) -> tuple[Any, str, bool]:
        """Run the accept script for ``event`` of ``caller`` at ``route`` (``body``: the request, whose fingerprint an
        idempotency record keeps; ``rating_key``: the Redis key of a rating's (completion, rater)).

        Returns:
            ``(event, replaces, replayed)``: the event the stream holds, the id of the rating it replaces (or
            ``None``), whether it is an idempotent replay.

        Raises:
            ConflictError: the idempotency key was used with another body (409).
            UnavailableError: Redis unreachable (503); nothing accepted. Or the accepted-signal log could not be
                written (503): the event is queued but not durable; a retry with a new Idempotency-Key may queue
                it twice (a re-rate replaces, so ratings are safe).
        """
        fingerprint = hashlib.sha256((route + "\n" + dumps(body.model_dump(mode="json"))).encode()).hexdigest()
        idem = self.keys.idem(f"{route}/{caller or '-'}", idempotency_key) if idempotency_key else ""
        rkey = rating_key or ""
        with redis_unavailable():
            kind, stored = await self._accept(
                keys=[self.keys.signals, idem, rkey],
                args=[
                    event.model_dump_json(),
                    fingerprint,
                    self.idempotency_ttl_s,
                    self.rating_ttl_s,
                    event.id,
                ],
            )
        rec = json.loads(stored)
        if kind == "replay" and rec["fingerprint"] != fingerprint:
            raise ConflictError(
                f"Idempotency-Key {idempotency_key!r} was already used with a different "
                f"request to {route}; use a new key for a new request",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        ev = parse_stream_event({"event": rec["event"], "replaces": rec["replaces"]})
        if kind != "replay" and self.accept_log is not None:
            try:
                await asyncio.to_thread(self.accept_log.append, rec["event"], rec["replaces"])
            except OSError as exc:
                log.error("accepted %s but the accepted-signal log failed: %s", ev.id, exc)
                raise UnavailableError(
                    f"the signal {ev.id} is queued but could not be written to the accepted-signal log ({exc}); "
                    "it may still be trained",
                    retry_after=5.0,
                ) from exc
        if kind != "replay":
            metrics.SIGNALS.labels("accepted", ev.type).inc()
            log.info(
                "accepted %s %s",
                ev.type,
                ev.id,
                extra={
                    "event_id": ev.id,
                    "endpoint": ev.endpoint,
                    "tenant": caller,
                    "completion_id": getattr(ev, "completion_id", None),
                    "completion_ids": [
                        c
                        for c in (
                            getattr(ev, "chosen_completion_id", None),
                            getattr(ev, "rejected_completion_id", None),
                        )
                        if c
                    ]
                    or None,
                },
            )
        return ev, rec["replaces"] or None, kind == "replay"
