"""The trainer's duty budget while serving, across lineages (issue #49): ready steps of several lineages (the shared
one and segments) take turns round-robin, one at a time while an engine on this machine serves and the last step's
share is not yet paid; the others stay queued (later signals join their batch) and ``GET /v1/learning`` says they
are deferred, and a step paused between its passes says so too. Real Redis, the real SmolLM2 trainer, the real
pacer of ``core/cpu_share.py`` and a serving flag beaten by the test as an engine beats it."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from livelora.clients.types.learning import LearningStatus, SegmentStatus, StageMark
from livelora.clients.types.signals import RatingEvent
from livelora.core import cpu_share
from livelora.core.cpu_share import SERVING_WINDOW_S, ServingFlag
from livelora.gateway.services.live.learning import estimate
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.worker import TrainerWorker

BUSY = "serving is busy: training uses at most 1% of the time while requests are served"


def rating(endpoint: str, up: bool, n: int, prompt=(1, 2, 3), completion=(4, 5)) -> RatingEvent:
    cid = f"chatcmpl-{uuid.uuid4().hex[:8]}-{n}"
    return RatingEvent(
        id=f"feedback-{uuid.uuid4().hex}",
        endpoint=endpoint,
        created=int(time.time()),
        completion_id=cid,
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        rating=up,
        rating_key=f"{cid}:/u{n}",
        user=f"u{n}",
    )


def test_ready_lineages_take_turns_so_busy_segments_never_starve_the_shared_lineage():
    """One step per turn (the budget allows one, then asks to wait): never-trained lineages first, then the one
    whose last step was taken longest ago, oldest event first among equals. A segment with a backlog of old ratings
    (more than one batch) would win every turn by age alone; it waits for the others' turns instead."""
    sched = BatchScheduler(TrainingSection(kto_min_batch=2, max_batch=2, max_wait_s=3600))
    now, n = [100.0], [0]

    def add(lineage: str, count: int) -> None:
        for _ in range(count):
            n[0] += 1
            sched.add(lineage, f"{n[0]}-0", rating(lineage, n[0] % 2 == 0, n[0]), now[0])
            now[0] += 1

    add("seg-a", 6)  # the oldest: a backlog of three batches
    add("seg-b", 2)
    add("shared", 2)
    order, told = [], []

    def one_turn() -> None:
        calls = {"n": 0}

        def wait() -> float:
            calls["n"] += 1
            return 0.0 if calls["n"] == 1 else 7.5  # after a step: its share is owed

        for batch in sched.turns(lambda: now[0], frozenset(), wait, lambda lineages, w: told.append((lineages, w))):
            order.append(batch.lineage)
        add("seg-a", 2)  # every lineage keeps getting ratings, the segments' older ones first
        add("seg-b", 2)
        add("shared", 2)
        now[0] += 5

    for _ in range(6):
        one_turn()
    assert order == ["seg-a", "seg-b", "shared", "seg-a", "seg-b", "shared"]
    # before the first step no lineage waits; after it the rest are deferred (each lineage once) with the wait
    assert told[0] == ([], 0.0) and told[1] == (["seg-b", "shared"], 7.5)
    assert all(w == 7.5 and len(set(ls)) == len(ls) == 2 for ls, w in told[1::2])
    # with nothing to wait for, every ready lineage trains in one poll, each queue once; a held (paused) one never
    held = [b.lineage for b in sched.turns(lambda: now[0], {"seg-b"}, lambda: 0.0, lambda *_: None)]
    assert held == ["seg-a", "shared"] and sched.queued("seg-b")["kto"][0] > 0


def test_the_learning_status_wire_type_says_a_step_waits_for_serving():
    st = LearningStatus.model_validate_json(
        LearningStatus(
            endpoint="acme.live",
            lineage="acme.support",
            stage="waiting",
            ratings_waiting=8,
            batch_size=8,
            step_seconds=20.0,
            deferred=BUSY,
            deferred_since=1000.0,
            deferred_until=1030.0,
        ).model_dump_json()
    )
    estimate(st, now=1012.0)
    assert st.deferred_s == pytest.approx(12.0)
    assert st.eta_s == pytest.approx(38.0) and st.eta_basis.endswith("plus the deferral for serving")
    assert st.summary() == (f"waiting: 8 of 8 ratings; step deferred for 12 s: {BUSY}; next version in about 38 s")
    paused = st.model_copy(update={"stage": "training", "detail": "kto step on 8 event(s)", "deferred_until": None})
    estimate(paused, now=1003.0)
    assert f"training (kto step on 8 event(s)); paused for 3.0 s: {BUSY}" in paused.summary()
    waited = StageMark(stage="published", at=1100.0, version="acme.support@4", serving_wait_s=41.6)
    done = LearningStatus(
        endpoint="acme.live", lineage="acme.support", stage="published", version="acme.support@4", last=waited
    )
    estimate(done, now=1101.0)
    assert done.deferred_s is None and "the step waited 42 s for serving" in done.summary()
    assert "deferred" not in LearningStatus(endpoint="e", lineage="l", stage="waiting", batch_size=8).summary()
    seg = SegmentStatus.model_validate(
        {"name": "vip", "binding": "acme.live::vip", "lineage": "l", "origin": "o", "versions": 1, "members": 2}
        | {"stage": "waiting", "deferred": BUSY}
    )
    assert seg.deferred == BUSY


class Engine:
    """Beats the machine's serving flag the way the batching loop does while it has work (every iteration)."""

    def __init__(self, home):
        self.flag, self.stop = ServingFlag(home), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.flag.beat()
            self.stop.wait(0.1)

    def __enter__(self) -> Engine:
        self.thread.start()
        assert wait_for(self.flag.busy)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        past = time.time() - SERVING_WINDOW_S - 1  # idle since longer than the window
        os.utime(self.flag.path, (past, past))
        assert not self.flag.busy()


def wait_for(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def paced(tmp_path):
    """This process paced as a trainer process is (``configure_training_steps``), undone afterwards."""
    threads = torch.get_num_threads()

    def configure(duty: float) -> None:
        cpu_share.configure_training_steps(tmp_path, busy=threads, idle=threads, duty=duty, max_pause_s=3600)

    yield configure
    cpu_share.configure_training_steps(tmp_path, busy=threads, idle=threads)
    torch.set_num_threads(threads)


def status(client, keys, lineage: str) -> LearningStatus:
    return LearningStatus.model_validate_json(client.get(keys.learning(lineage)))


def test_ready_steps_are_deferred_while_serving_is_busy_and_the_status_says_so(bus, base_ref, paced, tmp_path):
    client, keys = bus
    paced(0.01)  # while serving: 1 % of the time in steps (99 s owed per second of a step)
    xadd = lambda ev: client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": ""})  # noqa: E731
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3))
    sched = BatchScheduler(TrainingSection(kto_min_batch=2, max_wait_s=3600))
    worker = TrainerWorker(client, keys, tmp_path, backend, sched, consumer="duty", block_ms=100)
    for i in range(2):
        xadd(rating("shared", i == 0, i))
    [first] = worker.poll()  # nothing served: the step runs at once, and owes its share afterwards
    assert first.name == "shared@1" and cpu_share.step_wait() == 0.0
    assert cpu_share._pacer.owed_s > 0

    with Engine(tmp_path):
        assert cpu_share.step_wait() > 0  # serving now: the next step waits for what the last one owes
        for i in range(2):
            xadd(rating("vip", i == 0, 10 + i))
            xadd(rating("shared", i == 1, 20 + i))
        assert worker.poll() == []  # both ready, both deferred
        deferred = {lin: status(client, keys, lin) for lin in ("vip", "shared")}
        for st in deferred.values():
            assert (st.stage, st.ratings_waiting, st.deferred) == ("waiting", 2, BUSY)
            assert st.deferred_since is not None and st.deferred_until > st.deferred_since
            estimate(st, time.time())
            assert st.deferred_s >= 0 and st.summary().startswith("waiting: 2 of 2 ratings; step deferred for ")
            assert f" s: {BUSY}" in st.summary()
        xadd(rating("vip", True, 12))  # a later rating joins the deferred batch
        assert worker.poll() == []
        again = status(client, keys, "vip")
        assert again.ratings_waiting == 3 and again.deferred_since == deferred["vip"].deferred_since  # one deferral

    # serving stopped: both train in this poll, the one never trained first (round-robin), the later rating included
    notices = worker.poll()
    assert [n.name for n in notices] == ["vip@1", "shared@2"]
    assert backend.store.get("vip", 1).metrics["events:sum"] == 3
    for lineage in ("vip", "shared"):
        st = status(client, keys, lineage)
        assert st.stage == "published" and st.deferred is None and st.deferred_since is None
        assert st.last.serving_wait_s > 0  # the step's wait for serving, kept with its outcome
        assert "the step waited" in st.summary() and "for serving" in st.summary()
    worker.close()


def test_a_step_paused_between_its_passes_for_serving_says_so(bus, base_ref, paced, tmp_path):
    client, keys = bus
    paced(0.5)
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3))
    sched = BatchScheduler(TrainingSection(kto_min_batch=2, max_wait_s=3600))
    worker = TrainerWorker(client, keys, tmp_path, backend, sched, consumer="pause", block_ms=100)
    assert worker.poll() == []  # started: the learning status listens to the pacer's pauses
    report = cpu_share._pacer.listener
    seen: list[tuple[bool, LearningStatus]] = []

    def listener(pausing: bool) -> None:  # the status right after the reporter wrote it
        report(pausing)
        seen.append((pausing, status(client, keys, "paced")))

    cpu_share.on_step_pause(listener)
    for i in range(2):
        ev = rating("paced", i == 0, i)
        client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": ""})
    with Engine(tmp_path):
        [notice] = worker.poll()  # the step runs, pausing at its passes while "requests are served"
    assert notice.name == "paced@1" and seen and seen[0][0] is True
    busy = "serving is busy: training uses at most 50% of the time while requests are served"
    for pausing, st in seen:
        assert st.stage in ("training", "gate")
        assert (st.deferred, st.deferred_since is not None) == ((busy, True) if pausing else (None, False))
        if pausing:
            assert "; paused" in st.summary() and busy in st.summary()
    assert [p for p, _ in seen] == [True, False] * (len(seen) // 2)
    st = status(client, keys, "paced")
    assert st.stage == "published" and st.deferred is None
    assert seen[-1][1].serving_wait_s > 0  # every pause added up, kept with the step's outcome
    assert st.last.serving_wait_s == pytest.approx(seen[-1][1].serving_wait_s, abs=1e-3)
    worker.close()
