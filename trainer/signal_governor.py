"""Feedback governance in the trainer: per-rater rate limits with quarantine, and delete-by-user exclusion.

:class:`FeedbackGovernor` quarantines a rater's events beyond ``rater_max_events`` per lineage in any
``rater_window_s`` (counted in Redis, shared by every worker; the events stay in the dataset of record and are
never trained), weighs every example of a batch by its rater's agreement with other raters
(:meth:`FeedbackGovernor.weigh`, :func:`~livelora.core.governance.agreement_weights`), and drops the events of
forgotten users. The rules in full: ``docs/internals/live-training.md``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import redis

from livelora.adapters.endpoints import EndpointStore
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.bus import redis_unavailable
from livelora.core.governance import (
    FORGOTTEN_FILE,
    RECORD_LABEL_SCRIPT,
    agreement_item,
    agreement_weights,
    forgotten,
    label_field,
    labels_from_hash,
    rater_of,
    record_quarantine,
    signals_dir,
)
from livelora.core.redis_keys import KeyLayout

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
        agreement: record labels and weight examples by rater agreement (False: every weight is 1).
        agreement_window: labels kept per lineage (the newest).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: KeyLayout,
        home: Path,
        *,
        max_events: int,
        window_s: float,
        agreement: bool = True,
        agreement_window: int = 2000,
    ):
        self.client, self.keys, self.home = client, keys, Path(home)
        self.max_events, self.window_s = max_events, window_s
        self.agreement, self.agreement_window = agreement, agreement_window
        self._admit = client.register_script(_ADMIT)
        self._record_label = client.register_script(RECORD_LABEL_SCRIPT)
        self._forgotten: dict[str, set[str]] = {}
        self._forgotten_mtime = -1.0
        self._bursting: set[tuple[str, str]] = set()

    def forgotten(self, event: Any) -> bool:
        """Whether ``event``'s user, or a user of a completion it trains on, was forgotten on its endpoint by the
        tenant whose key sent the event."""
        path = signals_dir(self.home) / FORGOTTEN_FILE
        mtime = path.stat().st_mtime if path.is_file() else 0.0
        if mtime != self._forgotten_mtime:
            self._forgotten, self._forgotten_mtime = forgotten(self.home), mtime
        users = {getattr(event, "user", None), *(getattr(event, "completion_users", None) or ())} - {None}
        tenants = set().union(*(self._forgotten.get(u) or () for u in users))
        if not tenants:
            return False
        binding = EndpointStore(self.home).get(event.endpoint)
        caller = getattr(event, "caller", None) or DEFAULT_TENANT  # a user name is its tenant's own
        return None in tenants or any(t == caller and binding.administered_by(t) for t in tenants)

    def admit(self, lineage: str, event: Any, now: float) -> str | None:
        """``None`` if ``event`` may be queued for training, else why not (``forgotten`` or ``rate_limit``; a
        rate-limited event is recorded in the quarantine list here).

        Raises:
            UnavailableError: Redis unreachable (nothing is acknowledged; the event is read again).
        """
        if self.forgotten(event):
            return "forgotten"
        if self.max_events <= 0:
            self.record_label(lineage, event, now)
            return None
        rater = rater_of(event)
        digest = hashlib.sha256(rater.encode()).hexdigest()[:32]
        with redis_unavailable():
            ok, n = self._admit(
                keys=[self.keys.rater(lineage, digest)],
                args=[now, now - self.window_s, event.id, self.max_events, int(self.window_s) + 60],
            )
        if int(ok):
            self._bursting.discard((lineage, rater))
            self.record_label(lineage, event, now)
            return None
        record_quarantine(
            self.home,
            [
                {
                    "event_id": event.id,
                    "endpoint": event.endpoint,
                    "lineage": lineage,
                    "rater": rater,
                    "type": event.type,
                    "time": now,
                    "reason": f"rate_limit: {int(n)} events in the last {self.window_s:g} s (limit {self.max_events})",
                }
            ],
        )
        if (lineage, rater) not in self._bursting:
            self._bursting.add((lineage, rater))
            b = EndpointStore(self.home).get(event.endpoint)
            EndpointStore(self.home).record(
                event.endpoint,
                "quarantine",
                who="trainer",
                to=rater,
                reason=f"rater {rater!r} exceeded {self.max_events} events per "
                f"{self.window_s:g} s: further events quarantined",
                details={"rater": rater, "count": int(n), "limit": self.max_events, "window_s": self.window_s},
                tenant=b.tenant,
            )
        log.warning("quarantined %s from rater %r (rate limit)", event.id, rater)
        return "rate_limit"

    # ------------------------------------------------------------------ rater agreement
    def record_label(self, lineage: str, event: Any, now: float) -> None:
        """Record ``event``'s rater's label of its completion (or served preference pair) for agreement
        weighting; nothing for other events or with agreement off.

        Raises:
            UnavailableError: Redis unreachable.
        """
        item = agreement_item(event) if self.agreement else None
        if item is None:
            return
        with redis_unavailable():
            self._record_label(
                keys=[self.keys.rater_labels(lineage), self.keys.rater_labels_order(lineage)],
                args=[label_field(item[0], rater_of(event)), item[1], now, self.agreement_window],
            )

    def weights(self, lineage: str) -> dict[str, dict[str, float]]:
        """``rater → {"weight", "agreement", "compared"}`` for ``lineage`` now (see
        :func:`~livelora.core.governance.agreement_weights`).

        Raises:
            UnavailableError: Redis unreachable.
        """
        with redis_unavailable():
            raw = self.client.hgetall(self.keys.rater_labels(lineage))
        return agreement_weights(labels_from_hash(raw))

    def weigh(self, batch: Any) -> Any:
        """Give every example of ``batch`` its rater's agreement weight (``batch.example_weights``, one per
        event, in [0, 1]) and, for KTO, class weights that balance the weighted counts of desirable and
        undesirable examples (:func:`~livelora.trainer.scheduler.kto_class_weights`). Returns the batch
        (changed in place); unchanged with agreement off.

        Raises:
            UnavailableError: Redis unreachable (the batch is retried).
        """
        if not self.agreement or batch.kind not in ("kto", "dpo"):
            return batch
        from livelora.trainer.scheduler import kto_class_weights

        w = self.weights(batch.lineage)
        batch.example_weights = [w.get(rater_of(e), {}).get("weight", 1.0) for e in batch.events]
        batch.rater_weights = {r: v["weight"] for r, v in w.items()}
        if batch.kind == "kto":
            n_d = sum(a for a, e in zip(batch.example_weights, batch.events) if e.rating)
            n_u = sum(a for a, e in zip(batch.example_weights, batch.events) if not e.rating)
            batch.desirable_weight, batch.undesirable_weight = kto_class_weights(n_d, n_u)
        low = {rater_of(e): a for a, e in zip(batch.example_weights, batch.events) if a < 1.0}
        if low:
            log.info(
                "batch of %s: rater weights below 1: %s",
                batch.lineage,
                ", ".join(f"{r}={a:.2f}" for r, a in sorted(low.items())),
            )
        return batch
