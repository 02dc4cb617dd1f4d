"""The trainer worker: signals stream → dataset of record → scheduler → training step → version → notice.

:class:`TrainerWorker` reads the ``trainers`` consumer group (reclaiming a dead worker's entries), appends every
event to the dataset of record before acknowledging it, queues it in the
:class:`~livelora.trainer.scheduler.BatchScheduler` (:mod:`.intake`), and for each due batch trains one step
through its :class:`TrainingBackend`, commits the trained event ids, acknowledges and deletes the entries and
publishes a ``version_published`` notice (:meth:`TrainerWorker.poll` is one iteration). The entries it holds are
:mod:`.claims`'; events that cannot be trained are dead-lettered alone (:mod:`.triage`). Entry points:
:func:`build_worker`, :func:`run_worker`. The loop step by step and why no event is lost or trained twice:
``docs/internals/live-training.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import redis

from livelora.clients.errors import LiveloraError, UnavailableError
from livelora.clients.types.signals import VersionNotice
from livelora.core.bus import ensure_group, publish_notice, volatile_warning
from livelora.core.cpu_share import step_wait
from livelora.core.redis_keys import KeyLayout
from livelora.trainer import triage
from livelora.trainer.bus_recovery import BusRecovery
from livelora.trainer.claims import SignalClaims, hand_off_lonely
from livelora.trainer.dataset import TRAINED_FILE, append_lines, dataset_dir, read_dataset
from livelora.trainer.intake import SignalIntake
from livelora.trainer.learning_status import LearningReporter
from livelora.trainer.retention import VersionRoom
from livelora.trainer.scheduler import Batch, BatchScheduler

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
        recovery: re-queues what Redis lost (:class:`~livelora.trainer.bus_recovery.BusRecovery`); ``None``: no.
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
        recovery: BusRecovery | None = None,
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
        self.published: list[VersionNotice] = []
        self._failures: dict[str, int] = {}
        self.claims = SignalClaims(client, keys, self.consumer, claim_idle_s)
        self.dead_letters = triage.DeadLetters(self.home, self.claims, self.scheduler, clock)
        self._last_claim = float("-inf")
        self._started = False
        every = getattr(getattr(backend, "gate_config", None), "gate_holdout_every", 0)  # GET /v1/learning/{endpoint}:
        self.learning = LearningReporter(client, keys, self.scheduler.config, holdout_every=every)
        self.intake = SignalIntake(
            client, keys, self.home, self.claims, self.scheduler, self.learning, clock, governor, backend
        )
        self.endpoints = self.intake.endpoints
        self.recovery = recovery
        if hasattr(backend, "progress"):
            backend.progress = self.learning.progress

    # ------------------------------------------------------------------ reading

    def start(self) -> None:
        """Create the group if needed, read ``trained.jsonl``, take back this consumer's own pending entries and
        start the claim keeper thread."""
        ensure_group(self.client, self.keys)
        self.intake.trained.refresh()
        self._check_bus()
        self.intake.ingest(self.claims.own_pending())
        self._started = True
        self.learning.started()
        self.claims.start_keeper()

    def _check_bus(self) -> None:
        """Re-queue what Redis lost (:meth:`BusRecovery.check`); a loss of state first drops the queue here."""
        drop = lambda: (self.scheduler.clear(), self.claims.forget_all(), self._failures.clear())  # noqa: E731
        if self.recovery is not None and self.recovery.check(drop):
            self.learning.recovered(self.recovery.recovered, self.recovery.last)

    def close(self) -> None:
        """Stop the claim keeper thread (entries still held are reclaimed by peers after ``claim_idle_s``)."""
        self.claims.close()

    # ------------------------------------------------------------------ stepping

    def poll(self, block_ms: int | None = None) -> list[VersionNotice]:
        """One iteration: reclaim, read, record, train what is due (turns). Returns the notices published.

        Raises:
            UnavailableError: Redis unreachable (nothing acknowledged; safe to call again).
        """
        self.start() if not self._started else self._check_bus()  # start() checks the bus too
        now = self.clock()
        if now - self._last_claim >= self.claim_interval_s:
            self._last_claim = now
            self.intake.ingest(self.claims.reclaim())
        self.intake.ingest(self.claims.read_new(self.read_count, self.block_ms if block_ms is None else block_ms))
        hand_off_lonely(self.scheduler, self.claims, self.clock())
        out = []
        paused = self.endpoints.paused_lineages() if len(self.scheduler) else set()  # an admin's pause
        for batch in self.scheduler.turns(self.clock, paused, step_wait, self.learning.waits.deferred):
            if self.room is not None and self.room.waiting(batch, self.clock()):
                continue  # held back by max_adapter_versions (trainer/retention.py)
            batch = self.intake.screen(batch)
            if batch is None or (self.room is not None and not self.room.admit(batch, self.clock(), self.backend)):
                continue
            notice = self._train(batch)
            if notice is not None:
                out.append(notice)
        return out

    def _train(self, batch: Batch) -> VersionNotice | None:
        key, started_at = batch.stream_ids[0], self.clock()
        try:
            # taken from the queue: the status says "training" now, also while screening waits for the model
            # (on a fresh store, the gate's base measurement at start-up)
            self.learning.training(batch, self.scheduler)
            screen = getattr(self.backend, "screen", None)  # untrainable events go alone (trainer/triage.py)
            taken, batch = batch, self.dead_letters.reject(batch, screen(batch) if screen is not None else {})
            if batch is None:
                self.learning.failed(taken, self.scheduler, "no event of the batch can be trained (dead-lettered)")
                return None
            if self.governor is not None:
                batch = self.governor.weigh(batch)  # rater agreement weights
            if len(batch.events) != len(taken.events):
                self.learning.training(batch, self.scheduler)  # what the step trains on after screening
            manifest = self.backend.train(batch)
        except LiveloraError as exc:
            if exc.category == "user":
                index = triage.culprit(batch, exc.param)
                if index is not None and len(batch.events) > 1:
                    rest = self.dead_letters.reject(batch, {index: str(exc)})
                    return self._train(rest) if rest is not None else None
                log.error(
                    "dropping a %s batch of %d event(s) for %s: %s", batch.kind, len(batch.events), batch.lineage, exc
                )
                self.dead_letters.all(batch, str(exc))
                self.learning.failed(batch, self.scheduler, f"dead-lettered: {exc}")
                return None
            return self._failed(batch, key, exc)
        except Exception as exc:  # a transient or internal fault: retry later
            return self._failed(batch, key, exc)
        return self._publish(batch, key, manifest, started_at)

    def _publish(self, batch: Batch, key: str, manifest: Any, started_at: float) -> VersionNotice:
        """A written version: its events marked trained (``trained.jsonl``, claims), its notice published."""
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
        dup = self.claims.commit(event_ids, batch.stream_ids)
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
            self.dead_letters.all(batch, f"{type(exc).__name__}: {exc}")
            self.learning.failed(batch, self.scheduler, f"dead-lettered: {type(exc).__name__}: {exc}")
        else:
            self.scheduler.requeue(batch, self.clock(), restart_wait=True)

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
    with contextlib.suppress(redis.exceptions.RedisError):  # unreachable, or CONFIG disabled: cannot tell
        warning = volatile_warning(client.config_get("append*"), s.redis_url)
        if warning:
            log.warning(warning)
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
        recovery=BusRecovery(client, keys, s.home, reconcile_s=t.reconcile_s, forgotten=governor.forgotten),
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
