"""The trainer worker: signals stream → dataset of record → scheduler → training step → version → notice.

One loop iteration (:meth:`TrainerWorker.poll`):

1. Every ``claim_interval_s``, ``XAUTOCLAIM`` entries that sat unacknowledged in
   the ``trainers`` group for longer than ``claim_idle_s`` (their worker died),
   and take them over. A worker restarted under the same consumer name first
   re-reads its own pending entries (``XREADGROUP … 0``).
2. ``XREADGROUP`` new entries (blocking up to ``block_ms``).
3. Append every entry read to ``LIVELORA_HOME/data/signals/<UTC date>.jsonl``
   and fsync, **before** anything is acknowledged, once per event id across all
   workers (:class:`~livelora.trainer.dataset.DatasetOfRecord`: under a file
   lock, after reading what peers appended).
4. Queue the events in the :class:`~livelora.trainer.scheduler.BatchScheduler`;
   ratings it supersedes are acknowledged at once (they are on disk and will not
   be trained). Events already trained are acknowledged, not queued; so are the events the backend holds
   out for the evaluation gate's signal check (``backend.hold_out``, :mod:`.gated`).
5. For each due batch: events trained meanwhile by any worker (the shared Redis
   sorted set ``signals:trained`` and ``trained.jsonl``) and entries no longer claimed by
   this worker are taken out; each example gets its rater's agreement weight
   (``governor.weigh``, :mod:`.governance`); under the tenant's ``max_adapter_versions`` room is made for
   the version or the batch is held back (:mod:`.retention`); the backend trains one step and writes a new
   adapter version (parent = previous); the event ids go to ``trained.jsonl``
   (fsync); then one Lua script adds them to ``signals:trained`` and acknowledges
   **and deletes** the batch's entries (``XACK`` + ``XDEL``, only those still
   pending for this worker); then a ``version_published`` notice goes out. A
   crash before the version is written leaves the entries pending, so they are
   reclaimed and trained (never lost); a crash between version and commit makes
   the redelivered entries be acknowledged without training them
   (``trained.jsonl`` is read again at every batch). An event that cannot be
   trained is dead-lettered alone (``rejected.jsonl``, then acknowledged) while
   the rest of its batch trains (:mod:`.triage`).

**Claims.** While this worker holds entries (queued in the scheduler or in the
step being trained) a thread re-claims them every ``claim_idle_s / 3``
(``XCLAIM … JUSTID`` of the entries still pending *for this consumer*, checked
in a Lua script), which resets their idle time: neither a peer's ``XAUTOCLAIM``
nor this worker's own takes them while it lives, however long a step runs.

**Trimming.** Acknowledged entries are deleted one by one (``XACK`` + ``XDEL`` in
one script). ``XTRIM MINID`` is not used: with several consumers, entries older
than the newest acknowledged one may still be pending in a slower worker, and
trimming by id would delete them before they are trained.

No event is trained twice as long as a worker is not frozen for longer than
``claim_idle_s`` (its claims then lapse and a peer takes its entries); a commit
that finds events already in ``signals:trained`` counts them in
``signals:retrained`` (it stays 0 in the tests and the soak bench).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import redis

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.errors import LiveloraError, UnavailableError
from livelora.clients.types.signals import VersionNotice, parse_stream_event
from livelora.core.bus import ensure_group, publish_notice, redis_unavailable
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout
from livelora.trainer import triage
from livelora.trainer.dataset import TRAINED_FILE, DatasetOfRecord, append_lines, dataset_dir, read_dataset, trained_log
from livelora.trainer.learning_status import LearningReporter
from livelora.trainer.retention import VersionRoom
from livelora.trainer.scheduler import Batch, BatchScheduler, kto_class_weights

log = logging.getLogger(__name__)

__all__ = [
    "TRAINED_FILE",
    "TrainerWorker",
    "TrainingBackend",
    "append_lines",
    "build_worker",
    "dataset_dir",
    "read_dataset",
    "run_worker",
]

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
# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] entry id, ARGV[4] event JSON, ARGV[5] replaces →
# the new entry id ('' if the entry was no longer ours)
_HANDOFF = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #p == 0 then return '' end
local sid = redis.call('XADD', KEYS[1], '*', 'event', ARGV[4], 'replaces', ARGV[5])
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


class TrainingBackend(Protocol):
    """Trains one batch and writes one new adapter version."""

    def train(self, batch: Batch) -> Any:
        """Run one step on ``batch`` and save a version; returns its store ``Manifest``
        (attributes ``lineage``, ``version``, ``name``, ``sha256``, ``parent``) plus ``path`` via :meth:`path_of`.

        Raises:
            BadRequestError: the batch's data cannot be trained. When its ``param`` names a datum
                (``data[i]...``) only that datum's event is dead-lettered and the rest is trained again;
                otherwise the whole batch is dead-lettered.
            Any other exception: a transient fault (the batch is retried).

        A backend may also have ``screen(batch) -> {event index: reason}``, called first: the events it names
        are dead-lettered alone (``trainer/triage.py``).
        """

    def path_of(self, manifest: Any) -> Path:
        """Directory of the version ``manifest`` describes."""


class TrainerWorker:
    """Consumes the signals stream for one trainer process.

    Args:
        client: blocking Redis client (``decode_responses=True``).
        keys: key layout.
        home: ``LIVELORA_HOME`` (dataset of record, endpoints).
        backend: trains batches and writes versions (:class:`~livelora.trainer.online.OnlineTrainer`).
        scheduler: batching scheduler (default: thresholds from the environment).
        consumer: consumer name in the ``trainers`` group (default ``<host>-<pid>``); reuse the
            same name after a restart to pick up this worker's own pending entries at once.
        claim_idle_s: entries pending longer than this (seconds) in another consumer are reclaimed; this
            worker re-claims its own every third of it.
        claim_interval_s: how often to run ``XAUTOCLAIM`` (seconds).
        block_ms: ``XREADGROUP`` block time (milliseconds).
        read_count: entries per read.
        max_failures: a batch failing this many times with a transient error is dead-lettered.
        clock: time source (seconds); tests pass their own.
        governor: feedback governance (:class:`~livelora.trainer.signal_governor.FeedbackGovernor`: per-rater
            rate limit and quarantine, forgotten users); ``None``: every event is admitted.
        versions, quota_retry_s: the ``max_adapter_versions`` limit (:class:`~livelora.core.quotas.
            AdapterVersions`; ``None``: none) and the wait of a held-back step (:mod:`livelora.trainer.retention`).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: KeyLayout,
        home: Path,
        backend: TrainingBackend,
        scheduler: BatchScheduler | None = None,
        *,
        consumer: str | None = None,
        claim_idle_s: float = 120.0,
        claim_interval_s: float = 10.0,
        block_ms: int = 1000,
        read_count: int = 64,
        max_failures: int = 3,
        clock: Callable[[], float] = time.time,
        governor: Any = None,
        versions: Any = None,
        quota_retry_s: float = 30.0,
    ):
        self.client = client
        self.keys = keys
        self.home = Path(home)
        self.backend = backend
        self.scheduler = scheduler if scheduler is not None else BatchScheduler()
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.claim_idle_s, self.claim_interval_s, self.block_ms = claim_idle_s, claim_interval_s, block_ms
        self.read_count, self.max_failures, self.clock = read_count, max_failures, clock
        self.governor = governor
        self.room = VersionRoom(versions, self.scheduler, quota_retry_s) if versions is not None else None
        self.endpoints = EndpointStore(self.home)
        self.dataset = DatasetOfRecord(self.home)
        self.trained = trained_log(self.home)
        self.published: list[VersionNotice] = []
        self._failures: dict[str, int] = {}
        self._held: set[str] = set()  # stream ids queued here or in the step being trained
        self._lost: set[str] = set()  # held ids whose claim went to another consumer
        self._held_lock = threading.Lock()
        self._keeper_stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._renew = client.register_script(_RENEW_MINE)
        self._commit_script = client.register_script(_COMMIT)
        self._handoff = client.register_script(_HANDOFF)
        self._last_claim = float("-inf")
        self._started = False
        self.learning = LearningReporter(client, keys, self.scheduler.config)  # GET /v1/learning/{endpoint}
        if hasattr(backend, "progress"):
            backend.progress = self.learning.progress

    # ------------------------------------------------------------------ reading

    def start(self) -> None:
        """Create the group if needed, read ``trained.jsonl``, take back this consumer's own pending entries and
        start the claim keeper thread."""
        ensure_group(self.client, self.keys)
        self.trained.refresh()
        with redis_unavailable():
            own = self.client.xreadgroup(TRAINERS_GROUP, self.consumer, {self.keys.signals: "0"}, count=10_000)
        entries = own[0][1] if own else []
        self._ingest([(sid, f) for sid, f in entries if f])
        self._started = True
        self.learning.started()
        if self._keeper is None:
            self._keeper_stop.clear()
            self._keeper = threading.Thread(target=self._keep_claims, name="livelora-claim-keeper", daemon=True)
            self._keeper.start()

    def close(self) -> None:
        """Stop the claim keeper thread (entries still held are reclaimed by peers after ``claim_idle_s``)."""
        self._keeper_stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None

    def _keep_claims(self) -> None:
        while not self._keeper_stop.wait(max(0.05, self.claim_idle_s / 3)):
            try:
                self.renew_claims()
            except Exception as exc:  # Redis hiccup: the next round tries again
                log.warning("renewing signal claims failed: %s", exc)

    def renew_claims(self) -> set[str]:
        """Reset the idle time of every entry this worker holds that is still pending for it; returns (and
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

    def _hold(self, ids: list[str]) -> None:
        with self._held_lock:
            self._held.update(ids)

    def _release(self, ids: list[str]) -> None:
        with self._held_lock:
            self._held.difference_update(ids)
            self._lost.difference_update(ids)

    def _reclaim(self) -> list[tuple[str, dict[str, str]]]:
        got: list[tuple[str, dict[str, str]]] = []
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
        with self._held_lock:
            got = [(sid, f) for sid, f in got if sid not in self._held]
        if got:
            log.info("reclaimed %d signal(s) left pending by a dead worker", len(got))
        return got

    def trained_ids(self, event_ids: list[str]) -> set[str]:
        """Which of ``event_ids`` any worker has trained: the shared Redis set (events of the last
        :data:`TRAINED_SET_WINDOW_S`), then ``trained.jsonl`` (every event, read incrementally)."""
        if not event_ids:
            return set()
        with redis_unavailable():
            scores = self.client.zmscore(self.keys.signals_trained, event_ids)
        done = {e for e, f in zip(event_ids, scores) if f is not None}
        rest = [e for e in event_ids if e not in done]
        if rest:
            on_disk = self.trained.refresh()
            done.update(e for e in rest if e in on_disk)
        return done

    def _ingest(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        with self._held_lock:
            entries = [(sid, f) for sid, f in entries if sid not in self._held]
        if not entries:
            return
        now = self.clock()
        day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
        records, parsed, bad = [], [], []
        for sid, fields in entries:
            try:
                ev = parse_stream_event(fields)
            except (ValueError, KeyError) as exc:
                bad.append(sid)
                records.append((sid, {"stream_id": sid, "received": now, "invalid": str(exc)[:500], "fields": fields}))
                continue
            parsed.append((sid, ev))
            if self.governor is not None and self.governor.forgotten(ev):
                continue  # a forgotten user's event is neither recorded nor trained (admit() drops it)
            records.append((ev.id, {"stream_id": sid, "received": now, "event": json.loads(ev.model_dump_json())}))
        self.dataset.append(day, records)  # durable BEFORE any ack; once per event id
        ack, touched = list(bad), {}
        done = self.trained_ids([ev.id for _, ev in parsed])
        for sid, ev in parsed:
            if ev.id in done:  # trained before a crash that came before its ack, or by a peer
                ack.append(sid)
                continue
            lineage = self.endpoints.get(ev.endpoint).lineage
            hold_out = getattr(self.backend, "hold_out", None)  # kept for the gate's signal check, or governed out
            if (self.governor is not None and self.governor.admit(lineage, ev, now)) or (
                hold_out is not None and hold_out(lineage, ev)
            ):
                ack.append(sid)
                continue
            self._hold([sid])
            ack += self.scheduler.add(lineage, sid, ev, now)
            touched[lineage] = ev.endpoint
        if ack:
            self._ack(ack)
        self.learning.queued(self.scheduler, touched, [sid for sid, _ in entries])

    def _ack(self, ids: list[str]) -> None:
        """Acknowledge and delete entries still pending for this worker (nothing is marked trained)."""
        self._commit([], ids)

    def _commit(self, event_ids: list[str], stream_ids: list[str]) -> int:
        """One script: add ``event_ids`` to the shared trained set, then XACK + XDEL the ``stream_ids`` still
        pending for this worker. Returns how many events were already in the set (should be 0)."""
        now = time.time()
        with redis_unavailable():
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
        self._release(stream_ids)
        return dup

    # ------------------------------------------------------------------ stepping

    def poll(self, block_ms: int | None = None) -> list[VersionNotice]:
        """One iteration: reclaim, read, record, train what is due. Returns the notices published.

        Raises:
            UnavailableError: Redis unreachable (nothing acknowledged; safe to call again).
        """
        if not self._started:
            self.start()
        now = self.clock()
        if now - self._last_claim >= self.claim_interval_s:
            self._last_claim = now
            self._ingest(self._reclaim())
        with redis_unavailable():
            res = self.client.xreadgroup(
                TRAINERS_GROUP,
                self.consumer,
                {self.keys.signals: ">"},
                count=self.read_count,
                block=self.block_ms if block_ms is None else block_ms,
            )
        self._ingest([(sid, f) for sid, f in (res[0][1] if res else []) if f])
        self._hand_off_lonely()
        out = []
        for batch in self.scheduler.due(self.clock()):
            if self.room is not None and self.room.waiting(batch, self.clock()):
                continue  # held back by max_adapter_versions (trainer/retention.py)
            batch = self._screen(batch)
            if batch is None or (self.room is not None and not self.room.admit(batch, self.clock(), self.backend)):
                continue
            notice = self._train(batch)
            if notice is not None:
                out.append(notice)
        return out

    def _hand_off_lonely(self) -> None:
        """A rating alone in its KTO queue for ``2 × max_wait_s`` goes back to the group as a new entry (same
        event, same id; one script adds it and acknowledges + deletes the old entry), so that with several
        workers it can meet a partner in another worker's queue instead of waiting for the next rating here."""
        max_wait = getattr(self.scheduler.config, "max_wait_s", 30.0)
        for sid, ev in self.scheduler.take_lonely(self.clock(), 2 * max_wait):
            with redis_unavailable():
                new = self._handoff(
                    keys=[self.keys.signals],
                    args=[TRAINERS_GROUP, self.consumer, sid, ev.model_dump_json(), ev.replaces or ""],
                )
            self._release([sid])
            log.info(
                "lone rating %s handed back to the group (%s → %s): a KTO step needs two ratings of one "
                "endpoint, so it trains with the next one",
                ev.id,
                sid,
                new or "not ours",
            )

    def _screen(self, batch: Batch) -> Batch | None:
        """Take out of a due batch the events trained meanwhile by any worker (acknowledged) and the entries
        another worker has claimed (forgotten); None when too few remain to train now (they are requeued)."""
        with self._held_lock:
            lost = self._lost & set(batch.stream_ids)
        done = self.trained_ids([e.id for e in batch.events])
        if self.governor is not None:  # a user forgotten while their events were queued: dropped, never trained
            done |= {e.id for e in batch.events if self.governor.forgotten(e)}
        if done:
            self._ack([sid for sid, e in zip(batch.stream_ids, batch.events) if e.id in done])
        if lost:
            self._release(list(lost))
        keep = [(sid, e) for sid, e in zip(batch.stream_ids, batch.events) if sid not in lost and e.id not in done]
        if len(keep) == len(batch.events):
            return batch
        log.info(
            "batch for %s: %d event(s) already trained, %d claimed by another worker",
            batch.lineage,
            len(done),
            len(lost),
        )
        if not keep:
            return None
        out = Batch(batch.lineage, batch.kind, [e for _, e in keep], [sid for sid, _ in keep])
        if out.kind == "kto":
            if len(keep) < 2:  # KTO never runs on one example
                self.scheduler.requeue(out, self.clock())
                return None
            n_d = sum(1 for e in out.events if e.rating)
            out.desirable_weight, out.undesirable_weight = kto_class_weights(n_d, len(out.events) - n_d)
        return out

    def _train(self, batch: Batch) -> VersionNotice | None:
        key, started_at = batch.stream_ids[0], self.clock()
        try:
            screen = getattr(self.backend, "screen", None)  # untrainable events go alone (trainer/triage.py)
            batch = self._reject(batch, screen(batch) if screen is not None else {})
            if batch is None:
                return None
            if self.governor is not None:
                batch = self.governor.weigh(batch)  # rater agreement weights
            self.learning.training(batch, self.scheduler)
            manifest = self.backend.train(batch)
        except LiveloraError as exc:
            if exc.category == "user":
                index = triage.culprit(batch, exc.param)
                if index is not None and len(batch.events) > 1:
                    rest = self._reject(batch, {index: str(exc)})
                    return self._train(rest) if rest is not None else None
                log.error(
                    "dropping a %s batch of %d event(s) for %s: %s", batch.kind, len(batch.events), batch.lineage, exc
                )
                self._dead_letter(batch, str(exc))
                return None
            return self._failed(batch, key, exc)
        except Exception as exc:  # a transient or internal fault: retry later
            return self._failed(batch, key, exc)
        self._failures.pop(key, None)
        event_ids = [e.id for e in batch.events]
        append_lines(
            dataset_dir(self.home) / TRAINED_FILE,
            [
                json.dumps(
                    {
                        "version": manifest.name,
                        "event_ids": event_ids,
                        "stream_ids": batch.stream_ids,
                        "started_at": round(started_at, 3),
                        "written_at": round(self.clock(), 3),
                    }
                )
            ],
        )
        dup = self._commit(event_ids, batch.stream_ids)
        if dup:
            log.error("%d event(s) of %s had already been trained by another worker", dup, manifest.name)
        notice = VersionNotice(
            lineage=manifest.lineage,
            version=manifest.version,
            name=manifest.name,
            path=str(self.backend.path_of(manifest)),
            sha256=manifest.sha256,
            endpoint=batch.endpoint,
            parent=f"{manifest.lineage}@{manifest.parent}" if manifest.parent else None,
            kind=batch.kind,
            created=int(self.clock()),
        )
        self.published.append(notice)
        try:
            publish_notice(self.client, self.keys, notice.model_dump(mode="json"))
        except UnavailableError as exc:  # gateways catch up from the store
            log.warning("version %s written but its notice was not published: %s", notice.name, exc)
        log.info("published %s (%s, %d events)", notice.name, batch.kind, len(batch.events))
        self.learning.outcome(batch, manifest, self.scheduler)
        return notice

    def _failed(self, batch: Batch, key: str, exc: BaseException) -> None:
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        log.exception("training step for %s failed (%d/%d): %s", batch.lineage, n, self.max_failures, exc)
        self.learning.failed(batch, self.scheduler, f"{type(exc).__name__}: {exc}")
        if n >= self.max_failures:
            self._failures.pop(key, None)
            self._dead_letter(batch, f"{type(exc).__name__}: {exc}")
        else:
            self.scheduler.requeue(batch, self.clock())

    def _reject(self, batch: Batch, reasons: dict[int, str]) -> Batch | None:
        """Dead-letter the events at the indexes of ``reasons`` alone; return the rest of the batch, or ``None``
        when nothing is left to train now (a lone KTO rating goes back to the queue to wait for more)."""
        if not reasons:
            return batch
        log.error(
            "dead-lettering %d of %d %s event(s) for %s: %s",
            len(reasons),
            len(batch.events),
            batch.kind,
            batch.lineage,
            "; ".join(reasons.values())[:500],
        )
        append_lines(dataset_dir(self.home) / "rejected.jsonl", triage.rejected_lines(batch, reasons))
        self._ack([batch.stream_ids[i] for i in reasons])
        rest = triage.without(batch, reasons)
        if rest is not None and not triage.trainable(rest):
            self.scheduler.requeue(rest, self.clock())
            return None
        return rest

    def _dead_letter(self, batch: Batch, reason: str) -> None:
        lines = triage.rejected_lines(batch, dict.fromkeys(range(len(batch.events)), reason))
        append_lines(dataset_dir(self.home) / "rejected.jsonl", lines)
        self._ack(batch.stream_ids)
        self.learning.failed(batch, self.scheduler, f"dead-lettered: {reason}")

    def run(self, stop: threading.Event, retry_s: float = 1.0) -> None:
        """Poll until ``stop`` is set (:func:`run_loop`)."""
        run_loop(self, stop, retry_s)


def run_loop(worker: TrainerWorker, stop: threading.Event, retry_s: float = 1.0) -> None:
    """Poll ``worker`` until ``stop`` is set; Redis outages are logged and retried every ``retry_s`` seconds.
    First the backend builds its model ahead (``warm_up``), so the first update is not slower."""
    worker.learning.started()  # the batch size for GET /v1/learning while the model is built
    warm_up = getattr(worker.backend, "warm_up", None)
    if warm_up is not None:
        try:
            warm_up()
        except Exception:  # only an optimisation: the first update builds what it needs
            log.exception("trainer warm-up failed")
    try:
        while not stop.is_set():
            try:
                worker.poll()
            except UnavailableError as exc:
                log.warning("Redis unavailable: %s", exc)
                stop.wait(retry_s)
            except Exception:  # a bug must not silently end the trainer: log, back off, go on
                log.exception("trainer poll failed")
                stop.wait(retry_s)
    finally:
        worker.close()


def build_worker(settings: Any = None, *, client: redis.Redis | None = None) -> TrainerWorker:
    """A worker wired from :class:`~livelora.trainer.settings.TrainerSettings` (environment by default):
    real Redis client, the settings' base model, an :class:`~livelora.trainer.online.OnlineTrainer`."""
    from livelora.adapters.kept_versions import AdapterVersions
    from livelora.core.base_models import resolve_base_model
    from livelora.core.bus import connect_sync
    from livelora.core.metering import Meter
    from livelora.core.quotas import Limits
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import TrainerSettings
    from livelora.trainer.signal_governor import FeedbackGovernor

    s = settings or TrainerSettings()
    t = s.training
    client = client or connect_sync(s.redis_url)
    keys = KeyLayout(s.redis_prefix)
    meter = Meter(keys, enabled=s.observability.metering)
    backend = OnlineTrainer(resolve_base_model(s.model, s.home), s.home, t, gate=s.gate, meter=meter, redis=client)
    governor = FeedbackGovernor(
        client,
        keys,
        s.home,
        max_events=t.rater_max_events,
        window_s=t.rater_window_s,
        agreement=t.rater_agreement,
        agreement_window=t.rater_agreement_window,
    )
    return TrainerWorker(
        client,
        keys,
        s.home,
        backend,
        BatchScheduler(t),
        consumer=t.consumer,
        claim_idle_s=t.claim_idle_s,
        claim_interval_s=min(10.0, t.claim_idle_s / 2),
        governor=governor,
        versions=AdapterVersions(s.home, Limits.from_settings(s.quotas)),
        quota_retry_s=t.quota_retry_s,
    )


def run_worker(settings: Any = None) -> None:
    """Run one trainer worker (blocking) until SIGINT/SIGTERM; ``settings`` default to the environment.

    Raises:
        InstallMismatchError: the store and the Redis prefix belong to different installs.
    """
    import signal

    from livelora.core.install import bind_install

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = build_worker(settings)
    bind_install(worker.client, worker.keys, worker.home)
    log.info("trainer worker %s consuming %s", worker.consumer, worker.keys.signals)
    worker.run(stop)


def main() -> None:
    """``python -m livelora.trainer.worker``: one trainer worker configured from the environment."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker()


if __name__ == "__main__":
    main()
