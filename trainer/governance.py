"""Feedback governance in the trainer: per-rater rate limits with quarantine, and delete-by-user exclusion.

* **Rate limit.** Each rater (:func:`~livelora.adapters.governance.rater_of`) may send at most
  ``rater_max_events`` events per lineage in any ``rater_window_s`` seconds (ratings, preferences and
  demonstrations alike). The count is shared by every trainer worker of the store: a Redis sorted set per
  (lineage, rater) of event ids scored by receive time (``KeyLayout.rater``), trimmed to the window. Events
  beyond the limit are **quarantined**: they stay in the dataset of record, a line goes to
  ``quarantine.jsonl`` (listed by ``GET /admin/quarantine``), they are acknowledged and never trained. The first
  quarantined event of a burst (none in the previous window) also writes a ``quarantine`` line to the
  endpoint's history.
* **Share of a batch.** At most ``rater_max_batch_share`` of any training batch comes from one rater when the
  queue holds events of several raters (:class:`~livelora.trainer.scheduler.BatchScheduler`); a rater's
  surplus waits for the next batch.
* **Forgotten users.** After ``POST /admin/users/{user}/forget`` the user's events on the named endpoints are
  dropped when read and when a queued batch is about to train (``forgotten.jsonl``, re-read when it changes).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import redis

from livelora.adapters.bus import redis_unavailable
from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.governance import FORGOTTEN_FILE, forgotten, rater_of, record_quarantine, signals_dir
from livelora.adapters.redis_keys import KeyLayout

log = logging.getLogger(__name__)

# KEYS[1] rater set; ARGV[1] now, ARGV[2] window start, ARGV[3] event id, ARGV[4] limit, ARGV[5] ttl (s) →
# {admitted (1/0), count in window before this event}
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return {1, redis.call('ZCARD', KEYS[1])} end
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[4]) then return {0, n} end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {1, n}
"""


class FeedbackGovernor:
    """Decides, per event read from the stream, whether it may be trained.

    Args:
        client / keys: Redis (the shared per-rater windows).
        home: ``LIVELORA_HOME``.
        max_events / window_s: the rate limit (``max_events`` ≤ 0 disables it).
    """

    def __init__(self, client: redis.Redis, keys: KeyLayout, home: Path, *, max_events: int, window_s: float):
        self.client, self.keys, self.home = client, keys, Path(home)
        self.max_events, self.window_s = max_events, window_s
        self._admit = client.register_script(_ADMIT)
        self._forgotten: dict[str, set[str]] = {}
        self._forgotten_mtime = -1.0
        self._bursting: set[tuple[str, str]] = set()

    def forgotten(self, event: Any) -> bool:
        """Whether ``event``'s user was forgotten on its endpoint."""
        path = signals_dir(self.home) / FORGOTTEN_FILE
        mtime = path.stat().st_mtime if path.is_file() else 0.0
        if mtime != self._forgotten_mtime:
            self._forgotten, self._forgotten_mtime = forgotten(self.home), mtime
        user = getattr(event, "user", None)
        tenants = self._forgotten.get(user) if user is not None else None
        if not tenants:
            return False
        binding = EndpointStore(self.home).get(event.endpoint)
        return None in tenants or any(binding.administered_by(t) for t in tenants)

    def admit(self, lineage: str, event: Any, now: float) -> str | None:
        """``None`` if ``event`` may be queued for training, else why not (``forgotten`` or ``rate_limit``; a
        rate-limited event is recorded in the quarantine list here).

        Raises:
            UnavailableError: Redis unreachable (nothing is acknowledged; the event is read again).
        """
        if self.forgotten(event):
            return "forgotten"
        if self.max_events <= 0:
            return None
        rater = rater_of(event)
        digest = hashlib.sha256(rater.encode()).hexdigest()[:32]
        with redis_unavailable():
            ok, n = self._admit(keys=[self.keys.rater(lineage, digest)],
                                args=[now, now - self.window_s, event.id, self.max_events,
                                      int(self.window_s) + 60])
        if int(ok):
            self._bursting.discard((lineage, rater))
            return None
        record_quarantine(self.home, [{"event_id": event.id, "endpoint": event.endpoint, "lineage": lineage,
                                       "rater": rater, "type": event.type, "time": now,
                                       "reason": f"rate_limit: {int(n)} events in the last {self.window_s:g} s "
                                                 f"(limit {self.max_events})"}])
        if (lineage, rater) not in self._bursting:
            self._bursting.add((lineage, rater))
            b = EndpointStore(self.home).get(event.endpoint)
            EndpointStore(self.home).record(event.endpoint, "quarantine", who="trainer", to=rater,
                                            reason=f"rater {rater!r} exceeded {self.max_events} events per "
                                                   f"{self.window_s:g} s: further events quarantined",
                                            details={"rater": rater, "count": int(n), "limit": self.max_events,
                                                     "window_s": self.window_s}, tenant=b.tenant)
        log.warning("quarantined %s from rater %r (rate limit)", event.id, rater)
        return "rate_limit"
