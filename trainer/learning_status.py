"""Where each lineage's next version stands, published for ``GET /v1/learning/{endpoint}`` and logged at INFO.

The worker calls :meth:`LearningReporter.queued` after reading signals, :meth:`~ServingWaits.deferred` for the
ready steps that wait for serving (the duty budget of ``core/cpu_share.py``), :meth:`~LearningReporter.training`
when a step starts and :meth:`~LearningReporter.outcome` when its version is written (:meth:`~LearningReporter.failed`
otherwise); the backend calls :meth:`~LearningReporter.progress` at each pass of the evaluation gate and for the
start-up base measurement, the pacer :meth:`~ServingWaits.step_paused` around a pause inside a step.
Each change SETs one small JSON value (atomic): ``keys.learning(lineage)`` (a
:class:`~livelora.clients.types.learning.LearningStatus` without the gateway's estimates) and
``keys.learning_trainer`` (batch settings, step-time estimate, the newest stream id read). Reporting never fails
the trainer: a Redis error is logged and skipped.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from livelora.clients.types.learning import LearningStatus, StageMark
from livelora.core.cpu_share import on_step_pause, serving_duty

log = logging.getLogger(__name__)

#: Step times kept per estimate; the estimate is their median.
RECENT_STEPS = 5
#: Stage changes kept per step (gate passes included).
MAX_MARKS = 24


def _sid_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def serving_reason(duty: float | None) -> str:
    """Why a step waits for serving, for the status (``duty``: the trainer's duty while serving)."""
    share = f"at most {duty:.0%} of the time" if duty is not None else "part of the time"
    return f"serving is busy: training uses {share} while requests are served"


def timed_step(times: list[float], took: float, warm: bool) -> tuple[list[float], float]:
    """A step of ``took`` seconds added to the recent step times ``times`` (the last :data:`RECENT_STEPS` steps of
    a warm trainer, s): ``(times, estimate)``. A trainer process's first step
    (``warm`` False: it also loads the model, builds the optimizer, may wait for the gate's base measurement) is
    kept out of ``times``; it is the estimate only while no other step is known. The estimate is the median of
    ``times``: from three steps on, one slow or fast step hardly moves it."""
    if warm:
        times = [*times, round(took, 3)][-RECENT_STEPS:]
    if not times:
        return [], round(took, 3)
    return times, round(statistics.median(times), 3)


def batch_detail(batch: Any, max_wait_s: float) -> str:
    """What a step trains on and why it started now: a full batch, or a partial one after ``max_wait_s``."""
    n, size = len(batch.events), getattr(batch, "min_size", None)
    what = f"{batch.kind} step on {n} event(s)"
    if size is None:
        return what
    if getattr(batch, "waited", False):
        return (
            f"{what}: a partial batch ({n} of {size}), started because the oldest had waited max_wait_s "
            f"{max_wait_s:g} s; later ratings wait for the next step"
        )
    return f"{what}: a full batch ({size} start a step)"


class LearningReporter:
    """The trainer side of the learning status.

    Args:
        client: blocking Redis client (``decode_responses=True``).
        keys: key layout.
        config: the batching thresholds (``kto_min_batch``, ``max_wait_s``).
        clock: Unix seconds.
        holdout_every: the gate keeps one rating in this many out of training (0: none); published for the
            feedback answer.
    """

    def __init__(
        self, client: Any, keys: Any, config: Any, clock: Callable[[], float] = time.time, holdout_every: int = 0
    ):
        self.client, self.keys, self.config, self.clock = client, keys, config, clock
        self.holdout_every = holdout_every
        self._status: dict[str, LearningStatus] = {}
        self._batches: dict[str, str] = {}  # lineage → what its running step trains on
        self._lock = threading.Lock()
        self.step_seconds: float | None = None  # over every lineage: the estimate of a lineage with no step yet
        self.step_times: list[float] = []  # over every lineage: the recent steps of a warm trainer (timed_step)
        self._timed: set[str] = set()  # lineages this process has timed a step of (their next steps are warm)
        self.read_through: str | None = None
        self.base_measure: dict[str, Any] | None = None
        self.recovered_signals: dict[str, Any] | None = None  # {"total", "count", "at", "why"}
        self.waits = ServingWaits(self)

    # ------------------------------------------------------------------ writing
    def _write(self, key: str, value: str) -> None:
        try:
            self.client.set(key, value)
        except Exception as exc:  # the status is for people watching; training goes on without it
            log.warning("learning status not published (%s): %s", key, exc)

    def _write_many(self, values: dict[str, str]) -> None:
        """SET every key of ``values`` in one MSET (atomic: a reader never sees half of them)."""
        try:
            self.client.mset(values)
        except Exception as exc:  # the status is for people watching; training goes on without it
            log.warning("learning status not published (%s): %s", ", ".join(values), exc)

    def _trainer(self) -> None:
        self._write(*self._trainer_doc())

    def _trainer_doc(self) -> tuple[str, str]:
        doc = {
            "batch_size": self.config.kto_min_batch,
            "max_wait_s": self.config.max_wait_s,
            "step_seconds": self.step_seconds,
            "step_times": self.step_times,
            "holdout_every": self.holdout_every,
            "read_through": self.read_through,
            "base_measure": self.base_measure,
            "recovered": self.recovered_signals,
            "updated": self.clock(),
        }
        return self.keys.learning_trainer, json.dumps(doc)

    def _get(self, lineage: str, endpoint: str) -> LearningStatus:
        st = self._status.get(lineage)
        if st is None:
            try:  # a restarted trainer keeps the last outcome and the step-time estimate
                raw = self.client.get(self.keys.learning(lineage))
                st = LearningStatus.model_validate_json(raw) if raw else None
            except Exception:
                st = None
            if st is None:
                st = LearningStatus(endpoint=endpoint, lineage=lineage, stage="idle")
            elif st.stage in ("waiting", "training", "gate"):  # a step this trainer did not finish: its events return
                st.stage, st.stages = "idle", []
            st.deferred = st.deferred_since = st.deferred_until = None
            st.batch_size, st.max_wait_s = self.config.kto_min_batch, self.config.max_wait_s
            self._status[lineage] = st
        st.endpoint = endpoint or st.endpoint
        return st

    def _set_stage(self, st: LearningStatus, mark: StageMark, *, new_step: bool = False) -> None:
        st.stage, st.since = mark.stage, mark.at
        st.check, st.detail = mark.check, mark.detail
        st.version, st.reason, st.step_scale = mark.version, mark.reason, mark.step_scale
        st.stages = ([] if new_step else st.stages)[-(MAX_MARKS - 1) :] + [mark]
        if new_step:
            st.serving_wait_s = 0.0
        published = mark.version if mark.stage == "published" else None
        what = mark.check or published or mark.detail or mark.reason or mark.version or ""
        if mark.step_scale is not None and mark.step_scale != 1:
            what += f", step scaled by {mark.step_scale:g}"
        log.info(
            "learning %s: %s%s",
            st.lineage,
            mark.stage if mark.stage != "waiting" else f"waiting, {st.ratings_waiting} of {st.batch_size} ratings",
            f" ({what})" if what else "",
            extra={"lineage": st.lineage, "endpoint": st.endpoint, "stage": mark.stage},
        )

    def _save(self, st: LearningStatus) -> None:
        self._write(*self._status_doc(st))

    def _status_doc(self, st: LearningStatus) -> tuple[str, str]:
        st.updated = self.clock()
        return self.keys.learning(st.lineage), st.model_dump_json()

    def _counts(self, st: LearningStatus, scheduler: Any) -> None:
        q = scheduler.queued(st.lineage)
        st.ratings_waiting, st.oldest_waiting_at = q["kto"]
        st.demonstrations_waiting, st.preferences_waiting = q["sft"][0], q["dpo"][0]

    def _queued_any(self, st: LearningStatus) -> bool:
        return bool(st.ratings_waiting or st.demonstrations_waiting or st.preferences_waiting)

    # ------------------------------------------------------------------ the worker's calls
    def recovered(self, total: int, last: dict[str, Any] | None) -> None:
        """Signals re-queued from the accepted-signal log: ``total`` by this process, ``last`` the newest re-queue."""
        with self._lock:
            self.recovered_signals = {"total": total, **(last or {})}
            self._trainer()

    def started(self) -> None:
        """The trainer's settings, at start-up; the step times measured by an earlier trainer on this Redis are
        kept (this one's first step, with its warm-up, replaces them only where none was measured warm). From now
        on the pacer's pauses are reported (:class:`ServingWaits`)."""
        with self._lock:
            try:
                before = json.loads(self.client.get(self.keys.learning_trainer) or "{}")
            except Exception:
                before = {}
            if self.step_seconds is None and isinstance(before.get("step_seconds"), int | float):
                self.step_seconds = float(before["step_seconds"])
                self.step_times = [float(x) for x in before.get("step_times") or [] if isinstance(x, int | float)]
            self._trainer()
        on_step_pause(self.waits.step_paused)  # a trainer process's pauses for serving show in the status

    def queued(self, scheduler: Any, endpoints: dict[str, str], stream_ids: list[str], left_out: list = ()) -> None:
        """After reading signals: the queues of the lineages in ``endpoints`` (lineage → newest event's endpoint),
        the newest stream id read, and the ratings kept out of training (``(lineage, "held_out" | "rate_limit")``
        each)."""
        with self._lock:
            writes: dict[str, str] = {}
            for lineage, endpoint in endpoints.items():
                st = self._get(lineage, endpoint)
                for _, why in [x for x in left_out if x[0] == lineage]:
                    if why == "held_out":
                        st.ratings_held_out += 1
                    else:
                        st.ratings_quarantined += 1
                before = st.ratings_waiting
                self._counts(st, scheduler)
                if st.stage in ("idle", "published", "rejected") and self._queued_any(st):
                    self._set_stage(st, StageMark(stage="waiting", at=self.clock()), new_step=True)
                elif st.stage == "waiting" and st.ratings_waiting != before:
                    log.info("learning %s: waiting, %d of %d ratings", lineage, st.ratings_waiting, st.batch_size)
                writes.update([self._status_doc(st)])
            newest = max(stream_ids, key=_sid_key, default=None)
            if newest is not None and (self.read_through is None or _sid_key(newest) > _sid_key(self.read_through)):
                self.read_through = newest
            # the counts and the stream id they include in one write: the gateway adds the events after
            # read_through to the counts, so a reader between two writes would count the newest events twice
            writes.update([self._trainer_doc()])
            self._write_many(writes)

    def training(self, batch: Any, scheduler: Any) -> None:
        """A step of ``batch`` starts (its events have left the queue)."""
        with self._lock:
            st = self._get(batch.lineage, batch.endpoint)
            self.waits.started(st)
            self._counts(st, scheduler)
            detail = self._batches[batch.lineage] = batch_detail(batch, self.config.max_wait_s)
            self._set_stage(st, StageMark(stage="training", at=self.clock(), detail=detail))
            self._save(st)

    def progress(self, lineage: str | None, stage: str, **fields: Any) -> None:
        """From the backend: ``stage`` ``training`` or ``gate`` of ``lineage`` with ``check``/``detail``; or, with
        ``lineage`` None and stage ``base``, the start-up base measurement (``state``, ``seconds``, ``source``)."""
        with self._lock:
            if lineage is None:
                self.base_measure = {**fields, "at": self.clock()}
                self._trainer()
                return
            st = self._status.get(lineage)
            if st is None or st.stage not in ("training", "gate"):
                return  # not a step the worker announced (a direct backend call)
            if stage == "training":
                fields.setdefault("detail", self._batches.get(lineage))  # what the step trains on
            self._set_stage(st, StageMark(stage=stage, at=self.clock(), **fields))
            self._save(st)

    def outcome(self, batch: Any, manifest: Any, scheduler: Any) -> None:
        """The step's version is written: published, or rejected by the gate (``manifest.gate.continued_from``)."""
        with self._lock:
            st = self._get(batch.lineage, batch.endpoint)
            now = self.clock()
            started = next((m.at for m in reversed(st.stages) if m.stage == "training"), None)
            gate = getattr(manifest, "gate", None) or {}
            tries = gate.get("line_search") or []
            if gate.get("continued_from"):
                failed = (gate.get("verdicts", {}).get(batch.endpoint) or {}).get("failed") or []
                scaled = f" at every step scale down to {tries[-1]['step_scale']:g}" if len(tries) > 1 else ""
                reason = (
                    f"{', '.join(failed) or 'gate'} failed{scaled}; training continues from {gate['continued_from']}"
                )
                mark = StageMark(stage="rejected", at=now, version=manifest.name, reason=reason)
            else:
                mark = StageMark(
                    stage="published",
                    at=now,
                    version=manifest.name,
                    step_scale=gate.get("step_scale"),
                    detail=self._batches.pop(batch.lineage, None),
                )
            mark.freeform = freeform_verdict(gate, batch.endpoint)
            self.waits.ended(st, now)
            mark.serving_wait_s = round(st.serving_wait_s, 3) if st.serving_wait_s else None
            if started is not None:
                took = now - started
                warm = batch.lineage in self._timed
                st.step_times, st.step_seconds = timed_step(st.step_times, took, warm)
                self.step_times, self.step_seconds = timed_step(self.step_times, took, bool(self._timed))
                self._timed.add(batch.lineage)
            self._counts(st, scheduler)
            self._set_stage(st, mark)
            st.last = mark
            if self._queued_any(st):  # the next version's ratings are already waiting
                self._set_stage(st, StageMark(stage="waiting", at=now), new_step=True)
            self._save(st)
            self._trainer()

    def failed(self, batch: Any, scheduler: Any, why: str) -> None:
        """The step failed (retried later, or its events dead-lettered): back to waiting."""
        with self._lock:
            st = self._get(batch.lineage, batch.endpoint)
            self.waits.ended(st, self.clock())
            self._counts(st, scheduler)
            self._set_stage(st, StageMark(stage="waiting", at=self.clock(), reason=f"step failed: {why}"[:300]))
            self._save(st)


class ServingWaits:
    """The waits for serving of a :class:`LearningReporter`'s lineages: ready steps deferred before they start
    (:meth:`deferred`, from the worker) and pauses inside the running step (:meth:`step_paused`, from the pacer).
    Sets the ``deferred*`` fields of their statuses and adds each finished wait to the step's ``serving_wait_s``."""

    def __init__(self, reporter: LearningReporter):
        self.reporter = reporter
        self.lineages: set[str] = set()  # lineages whose ready step is deferred now
        self.running: tuple[str, int] | None = None  # (lineage, thread id) of the step running now

    def deferred(self, lineages: list[str], wait_s: float) -> None:
        """The ready steps of ``lineages`` wait up to ``wait_s`` more seconds for serving (the configured duty:
        :func:`~livelora.core.cpu_share.serving_duty`); lineages deferred before and not in ``lineages`` no longer
        wait (their step starts, or their batch left the queue). Writes only what changed."""
        r, duty = self.reporter, serving_duty()
        with r._lock:
            now, writes = r.clock(), {}
            for lineage in self.lineages - set(lineages):
                st = r._status.get(lineage)
                if st is not None and st.deferred:
                    end_wait(st, now)
                    writes.update([r._status_doc(st)])
            for lineage in lineages:
                st = r._get(lineage, "")
                if lineage in self.lineages and st.deferred:
                    continue
                st.deferred, st.deferred_since, st.deferred_until = serving_reason(duty), now, now + wait_s
                log.info("learning %s: step deferred (%s)", lineage, st.deferred, extra={"lineage": lineage})
                writes.update([r._status_doc(st)])
            self.lineages = set(lineages)
            if writes:
                r._write_many(writes)

    def step_paused(self, pausing: bool) -> None:
        """The pacer pauses the running step for serving (``True``) or resumes it (``False``); pauses of other
        threads' steps (the gate's base measurement, the sessions API) are not a lineage's."""
        r = self.reporter
        with r._lock:
            if self.running is None or self.running[1] != threading.get_ident():
                return
            st = r._status.get(self.running[0])
            if st is None:
                return
            if pausing:
                st.deferred, st.deferred_since, st.deferred_until = serving_reason(serving_duty()), r.clock(), None
            elif st.deferred:
                end_wait(st, r.clock())
            r._save(st)

    def started(self, st: LearningStatus) -> None:
        """(Reporter's lock held.) The step of ``st`` starts on this thread: its deferral, if any, ended."""
        self.running = (st.lineage, threading.get_ident())
        end_wait(st, self.reporter.clock())
        self.lineages.discard(st.lineage)

    def ended(self, st: LearningStatus, now: float) -> None:
        """(Reporter's lock held.) The running step of ``st`` ended (a pause it was in ended with it)."""
        self.running = None
        end_wait(st, now)


def end_wait(st: LearningStatus, now: float) -> None:
    """A wait for serving of ``st`` ended (nothing when it was not waiting): its time added to ``serving_wait_s``."""
    if st.deferred and st.deferred_since is not None:
        st.serving_wait_s += max(0.0, now - st.deferred_since)
    st.deferred = st.deferred_since = st.deferred_until = None


def freeform_verdict(gate: dict, endpoint: str) -> dict[str, Any] | None:
    """The free-form capability check of a manifest's gate result for a learning status: the measures'
    ``freeform`` summary less its examples, with ``passed`` (neither free-form check failed for ``endpoint``)."""
    ff = (gate.get("measures") or {}).get("freeform")
    if not ff:
        return None
    failed = (gate.get("verdicts", {}).get(endpoint) or gate.get("verdicts", {}).get("*") or {}).get("failed") or []
    examples = {"lost", "gained"}
    return {k: v for k, v in ff.items() if k not in examples} | {
        "passed": not {"freeform", "freeform_base"} & set(failed)
    }
