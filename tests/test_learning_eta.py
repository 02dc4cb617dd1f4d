"""The time to the next version in ``GET /v1/learning/{endpoint}``: the trainer's step-time estimate is the median
of its recent steps with a trainer process's slow first step (model load, optimizer, the gate's base measurement)
left out, kept across trainer restarts on the same Redis; a step running past the estimate shows ``eta_s: null``
with a basis that says so and for how long it has run, never 0. The trainer side is the real
:class:`~livelora.trainer.learning_status.LearningReporter` on real Redis (its clock given, so the step times are
exact); the gateway side a live gateway reading what it wrote."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
from harness.server import start_server

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import Manifest
from livelora.clients.types.learning import LearningStatus
from livelora.clients.types.signals import RatingEvent
from livelora.core.bus import connect_sync
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import DEFAULT_MODEL
from livelora.gateway.services.live.learning import base_first, estimate
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.learning_status import LearningReporter
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection

EP = "eta.ep"
WARM = "median of the last {n} step(s), each trainer's first step left out as warm-up"


def ratings(n: int) -> list[RatingEvent]:
    return [
        RatingEvent(
            id=f"feedback-{uuid.uuid4().hex}",
            endpoint=EP,
            created=int(time.time()),
            completion_id=f"c{i}",
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            rating=i % 2 == 0,
            rating_key=f"c{i}:/u",
        )
        for i in range(n)
    ]


class Steps:
    """Steps of lineage ``EP`` reported by a :class:`LearningReporter` at chosen clock times."""

    def __init__(self, client, keys, config: TrainingSection):
        self.now = [1_000_000.0]
        self.client, self.keys, self.config = client, keys, config
        self.scheduler = BatchScheduler(config)
        self.version = 0
        self.reporter = self.restart()

    def restart(self) -> LearningReporter:
        """A new trainer process on the same Redis."""
        self.reporter = LearningReporter(self.client, self.keys, self.config, clock=lambda: self.now[0])
        self.reporter.started()
        return self.reporter

    def start(self):
        """Ratings read (a full batch), then its step starts."""
        sids = [f"{int(self.now[0] * 1000)}-{i}" for i in range(self.config.kto_min_batch)]
        for sid, ev in zip(sids, ratings(self.config.kto_min_batch)):
            self.scheduler.add(EP, sid, ev, self.now[0])
        self.reporter.queued(self.scheduler, {EP: EP}, sids)
        [batch] = self.scheduler.due(self.now[0])
        self.reporter.training(batch, self.scheduler)
        return batch

    def run(self, seconds: float) -> None:
        """One whole step of ``seconds``: training, then the version published."""
        self.finish(self.start(), seconds)
        self.now[0] += 100  # ratings come in slowly

    def finish(self, batch, seconds: float) -> None:
        """The step of ``batch`` publishes its version ``seconds`` after it started."""
        self.now[0] += seconds
        self.version += 1
        name = f"{EP}@{self.version}"
        manifest = Manifest(lineage=EP, version=self.version, name=name, base_model="t", created=0, sha256="0")
        self.reporter.outcome(batch, manifest, self.scheduler)

    def status(self) -> LearningStatus:
        return LearningStatus.model_validate_json(self.client.get(self.keys.learning(EP)))


@pytest.mark.live
def test_the_step_estimate_is_a_median_of_warm_steps_across_restarts(bus):
    client, keys = bus
    steps = Steps(client, keys, TrainingSection(kto_min_batch=4))
    steps.run(60.0)  # the first step of the process: model load and warm-up
    st = steps.status()
    assert (st.step_seconds, st.step_times) == (60.0, [])  # nothing better known yet
    for took, want in ((10.0, 10.0), (14.0, 12.0), (11.0, 11.0), (40.0, 12.5), (9.0, 11.0), (12.0, 12.0)):
        steps.run(took)
        assert steps.status().step_seconds == want
    st = steps.status()
    assert st.step_times == [14.0, 11.0, 40.0, 9.0, 12.0]  # the last five; the 60 s warm-up never counted
    # (the moving average this replaced read 60, 35, 24.5, 17.8, 28.9, 18.9, 15.5: the warm-up and one slow step
    # stayed in it)

    # the estimate the gateway makes from it, while the next step trains: what is left of the median
    batch = steps.start()
    st = steps.status()
    st.updated = None
    estimate(st, steps.now[0] + 5)
    assert st.eta_s == pytest.approx(7.0) and st.eta_basis == f"measured: {WARM.format(n=5)}; this step has run for 5 s"

    steps.finish(batch, 12.0)
    assert steps.status().step_times == [11.0, 40.0, 9.0, 12.0, 12.0] and steps.status().step_seconds == 12.0

    # a restarted trainer keeps the times; its own warm-up step does not move the estimate
    steps.restart()
    assert steps.reporter.step_seconds == 12.0 and steps.reporter.step_times == [11.0, 40.0, 9.0, 12.0, 12.0]
    steps.run(75.0)
    assert steps.status().step_seconds == 12.0 and steps.status().step_times == [11.0, 40.0, 9.0, 12.0, 12.0]
    steps.run(13.0)
    assert steps.status().step_times == [40.0, 9.0, 12.0, 12.0, 13.0] and steps.status().step_seconds == 12.0


@pytest.mark.live
def test_an_overdue_step_shows_no_eta_but_how_long_it_runs(bus):
    client, keys = bus
    steps = Steps(client, keys, TrainingSection(kto_min_batch=2))
    steps.run(50.0)  # warm-up: the estimate is this one step, and the basis says so
    steps.run(20.0)
    steps.run(24.0)  # median 22 s
    steps.start()
    steps.now[0] += 10
    steps.reporter.progress(EP, "gate", check="probes", step_scale=1.0)  # the time counts from training's start
    st = steps.status()
    assert (st.stage, st.check) == ("gate", "probes")
    steps.now[0] -= 10
    estimate(st, steps.now[0] + 22.0)  # exactly due: not "0 s", not a negative wait
    assert st.eta_s is None and st.eta_basis.startswith("taking longer than usual: running for 22 s")
    estimate(st, steps.now[0] + 95.4)
    assert st.eta_s is None
    assert (
        st.eta_basis
        == f"taking longer than usual: running for 95 s, a step usually takes 22 s (measured: {WARM.format(n=2)})"
    )
    assert st.summary().endswith(f"; {st.eta_basis}")

    # before any warm step: the first step's time, named as such
    first = LearningStatus(endpoint=EP, lineage=EP, stage="training", since=100.0, step_seconds=50.0)
    estimate(first, 160.0)
    assert first.eta_s is None and first.eta_basis == (
        "taking longer than usual: running for 60 s, a step usually takes 50 s (measured: the trainer's first step "
        "only, warm-up included; later steps are usually faster)"
    )
    estimate(first, 130.0)
    assert first.eta_s == 20.0 and first.eta_basis.startswith("measured: the trainer's first step only")
    # before any step: no estimate (the gate's base measurement, all free-form replies at full length, bounds none)
    estimate(none := LearningStatus(endpoint=EP, lineage=EP, stage="training", since=100.0), 140.0)
    assert none.eta_s is None and none.eta_basis == "no step timed yet"


def test_the_base_measurement_running_first_shows_its_progress_and_time_left():
    """A fresh store: the trainer's base measurement reports its pass and, after a free-form chunk, the time left;
    the status adds what is left of it now to the ETA and says so."""
    full = LearningStatus(endpoint=EP, lineage=EP, stage="waiting", batch_size=8, ratings_waiting=8)
    full.eta_s, full.eta_basis = 20.0, "measured: one step"
    check = "pass 3 of 3, free-form answers: 30 of 60 items"
    base = {"state": "measuring", "check": check, "left_s": 50.0, "at": 100.0}
    base_first(full, base, 110.0)
    assert full.eta_s == 60.0 and full.eta_basis == (
        "measured: one step; the gate's base measurement runs first (once per store): pass 3 of 3, free-form "
        "answers: 30 of 60 items, about 40 s left"
    )
    # no time left known yet (before its first free-form chunk), no step timed: the progress alone
    early = LearningStatus(endpoint=EP, lineage=EP, stage="training")
    base_first(early, {"state": "measuring", "check": "probes", "left_s": None, "at": 100.0}, 101.0)
    assert early.eta_s is None
    assert early.eta_basis == "the gate's base measurement runs first (once per store): probes"
    # its time left known, no step timed: at least that
    later = LearningStatus(endpoint=EP, lineage=EP, stage="training")
    later.eta_basis = "no step timed yet"
    base_first(later, base, 110.0)
    assert later.eta_s == 40.0 and later.eta_basis == (
        "the gate's base measurement runs first (once per store): pass 3 of 3, free-form answers: 30 of 60 items, "
        "about 40 s left; then the step (not timed yet)"
    )
    # its estimate run out while it still measures: not "about 0 s left", and no eta_s of 0 (a fresh user's
    # trial saw eta_s 0.0 for 47 s): nothing known to add
    done = LearningStatus(endpoint=EP, lineage=EP, stage="waiting", batch_size=8, ratings_waiting=3)
    base_first(done, base, 160.0)
    assert done.eta_basis.endswith("30 of 60 items, finishing (taking longer than its estimate)")
    waiting = LearningStatus(endpoint=EP, lineage=EP, stage="training")
    waiting.eta_basis = "no step timed yet"
    base_first(waiting, base, 160.0)
    assert waiting.eta_s is None and waiting.eta_basis.startswith("no step timed yet; the gate's base measurement")
    # once it is ready, or while a step is being judged, nothing is added
    for stage, state in (("waiting", "ready"), ("gate", "measuring")):
        st = LearningStatus(endpoint=EP, lineage=EP, stage=stage)
        base_first(st, {**base, "state": state}, 110.0)
        assert st.eta_s is None and st.eta_basis is None


@pytest.mark.live
def test_the_gateway_shows_the_overdue_step(tmp_path, livelora_home, base_ref, bus):
    """Through ``GET /v1/learning``: a step that started 300 s ago (three warm steps of about 20 s before it)."""
    client, _ = bus
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL).symlink_to(livelora_home / "models" / DEFAULT_MODEL)
    EndpointStore(tmp_path).create(EP, EP, tenant="default", who="test")
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    server = start_server(
        GatewaySettings(
            model=DEFAULT_MODEL, home=tmp_path, redis_prefix=keys.prefix, device="cpu", executor_in_process=True
        )
    )
    try:
        steps = Steps(client, keys, TrainingSection(kto_min_batch=2))
        steps.now[0] = time.time() - 10_000
        for took in (45.0, 19.0, 21.0, 20.0):
            steps.run(took)
        steps.now[0] = time.time() - 300
        steps.start()
        doc = httpx.get(f"{server.base_url}/v1/learning/{EP}", timeout=60).json()
        assert doc["stage"] == "training" and doc["eta_s"] is None, doc
        assert doc["step_seconds"] == 20.0 and doc["step_times"] == [19.0, 21.0, 20.0]
        running = re.fullmatch(
            r"taking longer than usual: running for (\d+) s, a step usually takes 20 s "
            + re.escape(f"(measured: {WARM.format(n=3)})"),
            doc["eta_basis"],
        )
        assert running and int(running.group(1)) >= 300, doc["eta_basis"]  # it started 300 s ago
    finally:
        server.stop()
        r = connect_sync("redis://127.0.0.1:6379/0")
        for k in r.scan_iter(match=keys.prefix + "*"):
            r.delete(k)
        r.close()


def test_a_gate_pass_reads_in_words():
    """The status line names the gate's pass in words ("evaluation gate: replies" read as cut off)."""
    st = LearningStatus(endpoint=EP, lineage=EP, stage="gate", check="replies")
    assert st.summary() == "evaluation gate: replies to open prompts (length, repetition)"
    st.check = "freeform (60 of 120 items)"
    assert st.summary() == "evaluation gate: free-form answers (60 of 120 items)"
    st.check = "verdict"
    assert st.summary() == "evaluation gate: verdict"


def test_a_waiting_batch_without_a_timed_step_says_what_starts_it():
    """Before any step is timed, a waiting batch still says what starts its step (it read "no step timed yet"
    alone from the 2nd rating on)."""
    st = LearningStatus(endpoint=EP, lineage=EP, stage="waiting", batch_size=8, ratings_waiting=3, max_wait_s=30.0)
    st.oldest_waiting_at = 100.0
    estimate(st, 110.0)
    assert st.eta_s is None and st.eta_basis == (
        "5 more rating(s) start a step, or the batch's wait ends in 20 s; no step timed yet"
    )
    st.ratings_waiting = 8
    estimate(st, 110.0)
    assert st.eta_basis == "a step starts now; no step timed yet"
