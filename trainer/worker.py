"""The trainer worker: signals stream → dataset of record → scheduler → training step → version → notice.

One loop iteration (:meth:`TrainerWorker.poll`):

1. Every ``claim_interval_s``, ``XAUTOCLAIM`` entries that sat unacknowledged in
   the ``trainers`` group for longer than ``claim_idle_s`` (their worker died),
   and take them over. A worker restarted under the same consumer name first
   re-reads its own pending entries (``XREADGROUP … 0``).
2. ``XREADGROUP`` new entries (blocking up to ``block_ms``).
3. Append every entry read to ``LIVELORA_HOME/data/signals/<UTC date>.jsonl``
   and fsync, **before** anything is acknowledged. The dataset is at least once:
   an entry re-delivered after a crash is appended again; :func:`read_dataset`
   keeps the first line per event id.
4. Queue the events in the :class:`~livelora.trainer.scheduler.BatchScheduler`;
   ratings it supersedes are acknowledged at once (they are on disk and will not
   be trained).
5. For each due batch: the backend trains one step and writes a new adapter
   version (parent = previous); the event ids go to ``trained.jsonl`` (fsync);
   then the batch's entries are ``XACK``-ed; then a ``version_published``
   notice goes out on the notices channel. A crash before the version is
   written leaves the entries pending, so they are reclaimed and trained
   (never lost); a crash between version and ack makes the redelivered entries
   be acknowledged without training them twice (``trained.jsonl``). An event
   that cannot be trained is dead-lettered alone (``rejected.jsonl``, then
   acknowledged) while the rest of its batch trains (:mod:`.triage`).

While entries wait in the scheduler's queues the worker periodically re-claims
them for itself (``XCLAIM … JUSTID``), which resets their idle time, so a live
worker's queued entries are not stolen by a peer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import redis

from livelora.adapters.bus import ensure_group, publish_notice, redis_unavailable
from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.redis_keys import TRAINERS_GROUP, KeyLayout
from livelora.clients.errors import LiveloraError, UnavailableError
from livelora.clients.types.signals import VersionNotice, parse_stream_event
from livelora.trainer import triage
from livelora.trainer.scheduler import Batch, BatchScheduler

log = logging.getLogger(__name__)

#: Which events each version was trained on (``{"version", "event_ids", "stream_ids"}`` per line), written
#: after the version and before the ack: events redelivered after a crash in between are not trained twice.
TRAINED_FILE = "trained.jsonl"


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


def dataset_dir(home: Path) -> Path:
    """``LIVELORA_HOME/data/signals``: the dataset of record."""
    return Path(home) / "data" / "signals"


def append_lines(path: Path, lines: Iterable[str]) -> None:
    """Append JSONL lines with one write and one fsync (the lines are durable when this returns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(line.rstrip("\n") + "\n" for line in lines)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_dataset(home: Path) -> list[dict[str, Any]]:
    """Every accepted event in the dataset of record, oldest file first, one record per event id.

    Each record: ``{"stream_id", "received" (Unix s), "event" (the event as JSON object)}``.
    A partial last line (the process died mid-write, before the fsync returned) is skipped.
    """
    out: dict[str, dict[str, Any]] = {}
    d = dataset_dir(home)
    if not d.is_dir():
        return []
    for path in sorted(d.glob("[0-9]*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.setdefault(rec["event"]["id"] if isinstance(rec.get("event"), dict) else rec["stream_id"], rec)
    return list(out.values())


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
        claim_idle_s: entries pending longer than this (seconds) in *another* consumer are reclaimed.
        claim_interval_s: how often to run ``XAUTOCLAIM`` (seconds).
        block_ms: ``XREADGROUP`` block time (milliseconds).
        read_count: entries per read.
        max_failures: a batch failing this many times with a transient error is dead-lettered.
        clock: time source (seconds); tests pass their own.
    """

    def __init__(self, client: redis.Redis, keys: KeyLayout, home: Path, backend: TrainingBackend,
                 scheduler: BatchScheduler | None = None, *, consumer: str | None = None,
                 claim_idle_s: float = 120.0, claim_interval_s: float = 10.0, block_ms: int = 1000,
                 read_count: int = 64, max_failures: int = 3, clock: Callable[[], float] = time.time):
        self.client = client
        self.keys = keys
        self.home = Path(home)
        self.backend = backend
        self.scheduler = scheduler if scheduler is not None else BatchScheduler()
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.claim_idle_s = claim_idle_s
        self.claim_interval_s = claim_interval_s
        self.block_ms = block_ms
        self.read_count = read_count
        self.max_failures = max_failures
        self.clock = clock
        self.endpoints = EndpointStore(self.home)
        self.published: list[VersionNotice] = []
        self._failures: dict[str, int] = {}
        self._trained: set[str] = self._load_trained()
        self._last_claim = float("-inf")
        self._last_touch = clock()
        self._started = False

    def _load_trained(self) -> set[str]:
        path = dataset_dir(self.home) / TRAINED_FILE
        ids: set[str] = set()
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    ids.update(json.loads(line)["event_ids"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line: its version's events are trained again
        return ids

    # ------------------------------------------------------------------ reading

    def start(self) -> None:
        """Create the group if needed and take back this consumer's own pending entries."""
        ensure_group(self.client, self.keys)
        with redis_unavailable():
            own = self.client.xreadgroup(TRAINERS_GROUP, self.consumer, {self.keys.signals: "0"},
                                         count=10_000)
        entries = own[0][1] if own else []
        self._ingest([(sid, f) for sid, f in entries if f])
        self._started = True

    def _reclaim(self) -> list[tuple[str, dict[str, str]]]:
        got: list[tuple[str, dict[str, str]]] = []
        cursor = "0-0"
        with redis_unavailable():
            while True:
                res = self.client.xautoclaim(self.keys.signals, TRAINERS_GROUP, self.consumer,
                                             min_idle_time=int(self.claim_idle_s * 1000), start_id=cursor,
                                             count=100)
                cursor, entries = res[0], res[1]
                got.extend((sid, f) for sid, f in entries if f)
                if cursor in ("0-0", b"0-0"):
                    break
        if got:
            log.info("reclaimed %d signal(s) left pending by a dead worker", len(got))
        return got

    def _touch_queued(self) -> None:
        """Reset the idle time of entries queued here, so peers do not reclaim them."""
        ids = self.scheduler.pending()
        if ids:
            with redis_unavailable():
                self.client.xclaim(self.keys.signals, TRAINERS_GROUP, self.consumer, min_idle_time=0,
                                   message_ids=ids, justid=True)

    def _ingest(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        if not entries:
            return
        now = self.clock()
        day = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d")
        lines, parsed, bad = [], [], []
        for sid, fields in entries:
            try:
                ev = parse_stream_event(fields)
            except (ValueError, KeyError) as exc:
                bad.append(sid)
                lines.append(json.dumps({"stream_id": sid, "received": now, "invalid": str(exc)[:500],
                                         "fields": fields}))
                continue
            parsed.append((sid, ev))
            lines.append(json.dumps({"stream_id": sid, "received": now,
                                     "event": json.loads(ev.model_dump_json())}))
        append_lines(dataset_dir(self.home) / f"{day}.jsonl", lines)  # durable BEFORE any ack
        ack = list(bad)
        for sid, ev in parsed:
            if ev.id in self._trained:  # trained before a crash that came before its ack
                ack.append(sid)
                continue
            lineage = self.endpoints.get(ev.endpoint).lineage
            ack += self.scheduler.add(lineage, sid, ev, now)
        if ack:
            self._ack(ack)

    def _ack(self, ids: list[str]) -> None:
        with redis_unavailable():
            self.client.xack(self.keys.signals, TRAINERS_GROUP, *ids)

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
            res = self.client.xreadgroup(TRAINERS_GROUP, self.consumer, {self.keys.signals: ">"},
                                         count=self.read_count,
                                         block=self.block_ms if block_ms is None else block_ms)
        self._ingest([(sid, f) for sid, f in (res[0][1] if res else []) if f])
        now = self.clock()
        if now - self._last_touch >= self.claim_idle_s / 3:
            self._last_touch = now
            self._touch_queued()
        out = []
        for batch in self.scheduler.due(now):
            notice = self._train(batch)
            if notice is not None:
                out.append(notice)
        return out

    def _train(self, batch: Batch) -> VersionNotice | None:
        key = batch.stream_ids[0]
        try:
            screen = getattr(self.backend, "screen", None)  # untrainable events go alone (trainer/triage.py)
            batch = self._reject(batch, screen(batch) if screen is not None else {})
            if batch is None:
                return None
            manifest = self.backend.train(batch)
        except LiveloraError as exc:
            if exc.category == "user":
                index = triage.culprit(batch, exc.param)
                if index is not None and len(batch.events) > 1:
                    rest = self._reject(batch, {index: str(exc)})
                    return self._train(rest) if rest is not None else None
                log.error("dropping a %s batch of %d event(s) for %s: %s", batch.kind, len(batch.events),
                          batch.lineage, exc)
                self._dead_letter(batch, str(exc))
                return None
            return self._failed(batch, key, exc)
        except Exception as exc:  # a transient or internal fault: retry later
            return self._failed(batch, key, exc)
        self._failures.pop(key, None)
        append_lines(dataset_dir(self.home) / TRAINED_FILE, [json.dumps(
            {"version": manifest.name, "event_ids": [e.id for e in batch.events], "stream_ids": batch.stream_ids})])
        self._trained.update(e.id for e in batch.events)
        self._ack(batch.stream_ids)
        notice = VersionNotice(lineage=manifest.lineage, version=manifest.version, name=manifest.name,
                               path=str(self.backend.path_of(manifest)), sha256=manifest.sha256,
                               endpoint=batch.endpoint,
                               parent=f"{manifest.lineage}@{manifest.parent}" if manifest.parent else None,
                               kind=batch.kind, created=int(self.clock()))
        self.published.append(notice)
        try:
            publish_notice(self.client, self.keys, notice.model_dump(mode="json"))
        except UnavailableError as exc:  # gateways catch up from the store
            log.warning("version %s written but its notice was not published: %s", notice.name, exc)
        log.info("published %s (%s, %d events)", notice.name, batch.kind, len(batch.events))
        return notice

    def _failed(self, batch: Batch, key: str, exc: BaseException) -> None:
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        log.exception("training step for %s failed (%d/%d): %s", batch.lineage, n, self.max_failures, exc)
        if n >= self.max_failures:
            self._failures.pop(key, None)
            self._dead_letter(batch, f"{type(exc).__name__}: {exc}")
        else:
            self.scheduler.requeue(batch, self.clock())
        return None

    def _reject(self, batch: Batch, reasons: dict[int, str]) -> Batch | None:
        """Dead-letter the events at the indexes of ``reasons`` alone; return the rest of the batch, or ``None``
        when nothing is left to train now (a lone KTO rating goes back to the queue to wait for more)."""
        if not reasons:
            return batch
        log.error("dead-lettering %d of %d %s event(s) for %s: %s", len(reasons), len(batch.events), batch.kind,
                  batch.lineage, "; ".join(reasons.values())[:500])
        append_lines(dataset_dir(self.home) / "rejected.jsonl", triage.rejected_lines(batch, reasons))
        self._ack([batch.stream_ids[i] for i in reasons])
        rest = triage.without(batch, reasons)
        if rest is not None and not triage.trainable(rest):
            self.scheduler.requeue(rest, self.clock())
            return None
        return rest

    def _dead_letter(self, batch: Batch, reason: str) -> None:
        append_lines(dataset_dir(self.home) / "rejected.jsonl",
                     [json.dumps({"stream_id": sid, "event_id": ev.id, "kind": batch.kind, "reason": reason[:1000]})
                      for sid, ev in zip(batch.stream_ids, batch.events)])
        self._ack(batch.stream_ids)

    def run(self, stop: threading.Event, retry_s: float = 1.0) -> None:
        """Poll until ``stop`` is set; Redis outages are logged and retried every ``retry_s`` seconds.
        First the backend builds its model ahead (``warm_up``), so the first update is not slower."""
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is not None:
            try:
                warm_up()
            except Exception:  # only an optimisation: the first update builds what it needs
                log.exception("trainer warm-up failed")
        while not stop.is_set():
            try:
                self.poll()
            except UnavailableError as exc:
                log.warning("Redis unavailable: %s", exc)
                stop.wait(retry_s)
            except Exception:  # a bug must not silently end the trainer: log, back off, go on
                log.exception("trainer poll failed")
                stop.wait(retry_s)


def build_worker(settings: Any = None, *, client: redis.Redis | None = None) -> TrainerWorker:
    """A worker wired from :class:`~livelora.trainer.settings.TrainerSettings` (environment by default):
    real Redis client, the settings' base model, an :class:`~livelora.trainer.online.OnlineTrainer`."""
    from livelora.adapters.bus import connect_sync
    from livelora.adapters.models import resolve_base_model
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import TrainerSettings

    s = settings or TrainerSettings()
    t = s.training
    backend = OnlineTrainer(resolve_base_model(s.model, s.home), s.home, t)
    return TrainerWorker(client or connect_sync(s.redis_url), KeyLayout(s.redis_prefix), s.home, backend,
                         BatchScheduler(t), consumer=t.consumer, claim_idle_s=t.claim_idle_s,
                         claim_interval_s=min(10.0, t.claim_idle_s / 2))


def run_worker(settings: Any = None) -> None:
    """Run one trainer worker (blocking) until SIGINT/SIGTERM; ``settings`` default to the environment."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = build_worker(settings)
    log.info("trainer worker %s consuming %s", worker.consumer, worker.keys.signals)
    worker.run(stop)


def main() -> None:
    """``python -m livelora.trainer.worker``: one trainer worker configured from the environment."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker()


if __name__ == "__main__":
    main()
