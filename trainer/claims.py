"""The signals-stream entries one trainer worker holds in the ``trainers`` group (:class:`SignalClaims`).

**Claims.** While the worker holds entries (queued in the scheduler or in the step being trained) a thread
re-claims them every ``claim_idle_s / 3`` (``XCLAIM … JUSTID`` of the entries still pending *for this consumer*,
checked in a Lua script), which resets their idle time: neither a peer's ``XAUTOCLAIM`` nor this worker's own takes
them while it lives, however long a step runs. Entries idle longer than ``claim_idle_s`` in a dead consumer are
taken over (:meth:`SignalClaims.reclaim`).

**Trimming.** Acknowledged entries are deleted one by one (``XACK`` + ``XDEL`` in one script). ``XTRIM MINID`` is
not used: with several consumers, entries older than the newest acknowledged one may still be pending in a slower
worker, and trimming by id would delete them before they are trained.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from livelora.core.bus import redis_unavailable
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]  # (stream id, fields)

#: Seconds an event id stays in the Redis trained set (a fast path; ``trained.jsonl`` is the full record).
TRAINED_SET_WINDOW_S = 24 * 3600

# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids → the ids still pending for the consumer,
# re-claimed (idle time reset)
_RENEW_MINE = """
local mine = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then table.insert(mine, ARGV[i]) end
end
if #mine > 0 then
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(mine) do table.insert(args, id) end
  table.insert(args, 'JUSTID')
  redis.call(unpack(args))
end
return mine
"""
# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] entry id, ARGV[4] event JSON, ARGV[5] replaces,
# ARGV[6] arrival (Unix s, the first entry's) → the new entry id ('' if the entry was no longer ours)
_HANDOFF = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return '' end
local sid = redis.call('XADD', KEYS[1], '*', 'event', ARGV[4], 'replaces', ARGV[5], 'arrived', ARGV[6])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return sid
"""
# KEYS[1] stream, KEYS[2] trained sorted set, KEYS[3] retrained counter; ARGV[1] group, ARGV[2] consumer,
# ARGV[3] number of event ids n, ARGV[4] now (s), ARGV[5] forget before (s), ARGV[6..5+n] event ids, then entry
# ids → events found already trained
_COMMIT = """
local n = tonumber(ARGV[3])
local dup = 0
for i = 6, 5 + n do
  if redis.call('ZADD', KEYS[2], 'NX', ARGV[4], ARGV[i]) == 0 then dup = dup + 1 end
end
if dup > 0 then redis.call('INCRBY', KEYS[3], dup) end
if n > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[5]) end
for i = 6 + n, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
  end
end
return dup
"""


class SignalClaims:
    """The entries one consumer of the ``trainers`` group holds: read, held while queued or trained, re-claimed by
    a keeper thread, acknowledged (with the trained set) or handed back.

    Args:
        client: blocking Redis client (``decode_responses=True``).
        keys: key layout.
        consumer: consumer name in the ``trainers`` group.
        claim_idle_s: entries pending longer than this (seconds) in another consumer are reclaimed; this
            consumer re-claims its own every third of it.
    """

    def __init__(self, client: redis.Redis, keys: KeyLayout, consumer: str, claim_idle_s: float):
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.claim_idle_s = claim_idle_s
        self._held: set[str] = set()  # stream ids queued here or in the step being trained
        self._lost: set[str] = set()  # held ids whose claim went to another consumer
        self._held_lock = threading.Lock()
        self._keeper_stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._renew = client.register_script(_RENEW_MINE)
        self._commit_script = client.register_script(_COMMIT)
        self._handoff = client.register_script(_HANDOFF)

    # ------------------------------------------------------------------ reading
    def own_pending(self) -> list[Entry]:
        """This consumer's own pending entries (``XREADGROUP … 0``: after a restart under the same name)."""
        with redis_unavailable():
            own = self.client.xreadgroup(TRAINERS_GROUP, self.consumer, {self.keys.signals: "0"}, count=10_000)
        return [(sid, f) for sid, f in (own[0][1] if own else []) if f]

    def read_new(self, count: int, block_ms: int) -> list[Entry]:
        """New entries of the group (``XREADGROUP … >``, blocking up to ``block_ms``)."""
        with redis_unavailable():
            res = self.client.xreadgroup(
                TRAINERS_GROUP, self.consumer, {self.keys.signals: ">"}, count=count, block=block_ms
            )
        return [(sid, f) for sid, f in (res[0][1] if res else []) if f]

    def reclaim(self) -> list[Entry]:
        """``XAUTOCLAIM`` the entries idle longer than ``claim_idle_s`` (their worker died), except those held."""
        got: list[Entry] = []
        cursor = "0-0"
        with redis_unavailable():
            while True:
                res = self.client.xautoclaim(
                    self.keys.signals,
                    TRAINERS_GROUP,
                    self.consumer,
                    min_idle_time=int(self.claim_idle_s * 1000),
                    start_id=cursor,
                    count=100,
                )
                cursor, entries = res[0], res[1]
                got.extend((sid, f) for sid, f in entries if f)
                if cursor in ("0-0", b"0-0"):
                    break
        got = self.unheld(got)
        if got:
            log.info("reclaimed %d signal(s) left pending by a dead worker", len(got))
        return got

    # ------------------------------------------------------------------ holding
    def unheld(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` less those already held."""
        with self._held_lock:
            return [(sid, f) for sid, f in entries if sid not in self._held]

    def hold(self, ids: list[str]) -> None:
        with self._held_lock:
            self._held.update(ids)

    def release(self, ids: list[str]) -> None:
        with self._held_lock:
            self._held.difference_update(ids)
            self._lost.difference_update(ids)

    def forget_all(self) -> None:
        """Hold nothing (Redis lost the group: these entries no longer exist)."""
        with self._held_lock:
            self._held.clear()
            self._lost.clear()

    def lost_of(self, ids: list[str]) -> set[str]:
        """Those of ``ids`` whose claim went to another consumer (:meth:`renew` found them)."""
        with self._held_lock:
            return self._lost & set(ids)

    def start_keeper(self) -> None:
        """Start the thread that re-claims the held entries every ``claim_idle_s / 3``."""
        if self._keeper is None:
            self._keeper_stop.clear()
            self._keeper = threading.Thread(target=self._keep, name="livelora-claim-keeper", daemon=True)
            self._keeper.start()

    def close(self) -> None:
        """Stop the keeper thread (entries still held are reclaimed by peers after ``claim_idle_s``)."""
        self._keeper_stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None

    def _keep(self) -> None:
        while not self._keeper_stop.wait(max(0.05, self.claim_idle_s / 3)):
            try:
                self.renew()
            except Exception as exc:  # Redis hiccup: the next round tries again
                log.warning("renewing signal claims failed: %s", exc)

    def renew(self) -> set[str]:
        """Reset the idle time of every held entry that is still pending for this consumer; returns (and
        remembers) the held ids that another consumer has taken."""
        with self._held_lock:
            held = sorted(self._held)
        lost: set[str] = set()
        for i in range(0, len(held), 500):
            chunk = held[i : i + 500]
            with redis_unavailable():
                mine = set(self._renew(keys=[self.keys.signals], args=[TRAINERS_GROUP, self.consumer, *chunk]))
            lost.update(set(chunk) - mine)
        if lost:
            with self._held_lock:
                lost &= self._held
                self._lost |= lost
            log.warning("%d held signal(s) were claimed by another worker", len(lost))
        return lost

    # ------------------------------------------------------------------ letting go
    def ack(self, ids: list[str]) -> None:
        """Acknowledge and delete entries still pending for this consumer (nothing is marked trained)."""
        self.commit([], ids)

    def commit(self, event_ids: list[str], stream_ids: list[str]) -> int:
        """One script: add ``event_ids`` to the shared trained set, then XACK + XDEL the ``stream_ids`` still
        pending for this consumer. Returns how many events were already in the set (should be 0); 0 when the group
        is gone (Redis lost its state: ``trained.jsonl`` holds the step, ``bus_recovery.py`` re-queues the rest)."""
        now = time.time()
        dup = 0
        with redis_unavailable():
            try:
                dup = int(
                    self._commit_script(
                        keys=[self.keys.signals, self.keys.signals_trained, self.keys.signals_retrained],
                        args=[
                            TRAINERS_GROUP,
                            self.consumer,
                            len(event_ids),
                            now,
                            now - TRAINED_SET_WINDOW_S,
                            *event_ids,
                            *stream_ids,
                        ],
                    )
                )
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("commit found no signals group (Redis lost its state): %s", exc)
        self.release(stream_ids)
        return dup

    def hand_back(self, sid: str, event_json: str, replaces: str, arrived: float) -> str:
        """Put entry ``sid``'s event back in the group as a new entry (its field ``arrived``: when the event first
        arrived, Unix s, so its wait goes on counting from then) and acknowledge + delete ``sid`` (one script);
        returns the new entry id, ``""`` when ``sid`` was no longer this consumer's."""
        with redis_unavailable():
            new = self._handoff(
                keys=[self.keys.signals],
                args=[TRAINERS_GROUP, self.consumer, sid, event_json, replaces, f"{arrived:.3f}"],
            )
        self.release([sid])
        return new


def hand_off_lonely(scheduler: Any, claims: SignalClaims, now: float) -> None:
    """A rating alone in its KTO queue for ``2 × max_wait_s`` goes back to the group as a new entry (same event,
    same id; one script adds it and acknowledges + deletes the old entry), so that with several workers it can meet a
    partner in another worker's queue instead of waiting for the next rating here."""
    max_wait = getattr(scheduler.config, "max_wait_s", 30.0)
    for sid, ev, arrived in scheduler.take_lonely(now, 2 * max_wait):
        new = claims.hand_back(sid, ev.model_dump_json(), ev.replaces or "", arrived)
        log.info(
            "lone rating %s handed back to the group (%s → %s): a KTO step needs two ratings of one "
            "endpoint, so it trains with the next one",
            ev.id,
            sid,
            new or "not ours",
        )
