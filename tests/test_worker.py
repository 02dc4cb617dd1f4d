"""Trainer worker on real Redis and the real SmolLM2 model: dataset of record before ack, KTO/SFT/DPO steps,
versions with parents, notices, and reclaim of events left pending by a killed worker."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
from safetensors.torch import load_file

from livelora.adapters.store import AdapterStore
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler, kto_class_weights
from livelora.trainer.settings import TrainingSection
from livelora.trainer.worker import TRAINED_FILE, TrainerWorker, dataset_dir, read_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair_tokens(tokenizer):
    """Two real chat prompts and replies, tokenized with SmolLM2's template."""

    def chat(q: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)

    return [
        (chat("What is 2+2?"), tokenizer.encode(" 4.", add_special_tokens=False)),
        (chat("Name a colour."), tokenizer.encode(" Blue", add_special_tokens=False)),
    ]


def rating(endpoint: str, prompt, completion, up: bool, completion_id: str, user: str = "u") -> RatingEvent:
    return RatingEvent(
        id=f"feedback-{uuid.uuid4().hex}",
        endpoint=endpoint,
        created=int(time.time()),
        completion_id=completion_id,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        rating=up,
        rating_key=f"{completion_id}:/{user}",
        user=user,
    )


def xadd(client: redis.Redis, keys: KeyLayout, ev, replaces: str = "") -> str:
    return client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": replaces})


def pending(client, keys) -> int:
    return client.xpending(keys.signals, TRAINERS_GROUP)["pending"]


def test_policy_batches_by_count_or_wait_and_balances_classes():
    assert kto_class_weights(6, 2) == (pytest.approx(1 / 3), 1.0)
    assert kto_class_weights(1, 4) == (1.0, 0.25)
    assert kto_class_weights(5, 0) == (1.0, 1.0)
    pol = BatchScheduler(TrainingSection(kto_min_batch=3, sft_min_batch=2, max_wait_s=10))
    evs = [rating("ep", [1, 2], [3], up, f"c{i}") for i, up in enumerate([True, True, False])]
    assert pol.add("lin", "1-0", evs[0], now=0) == []
    assert pol.add("lin", "2-0", evs[1], now=1) == []
    assert pol.due(now=5) == []  # 2 < 3 and not waited
    again = rating("ep", [1, 2], [3], False, "c0")  # same completion, same rater: replaces "1-0"
    assert pol.add("lin", "3-0", again, now=6) == ["1-0"]
    old = rating("ep", [1, 2], [3], True, "c0")  # an older redelivered entry never wins
    assert pol.add("lin", "0-5", old, now=6) == ["0-5"]
    assert len(pol) == 2
    assert pol.due(now=9) == []
    [batch] = pol.due(now=11)  # oldest (t=1) waited 10 s, 2 >= KTO floor
    assert batch.kind == "kto" and batch.stream_ids == ["2-0", "3-0"]
    assert [e.rating for e in batch.events] == [True, False]
    assert (batch.desirable_weight, batch.undesirable_weight) == (1.0, 1.0)
    pol.add("lin", "4-0", evs[2], now=20)
    assert pol.due(now=100) == []  # one rating never makes a KTO step
    demo = DemonstrationEvent(
        id="d",
        endpoint="ep",
        created=0,
        messages=[ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a")],
    )
    pol.add("lin", "5-0", demo, now=100)
    assert pol.due(now=100) == []
    [sft] = pol.due(now=110)
    assert sft.kind == "sft"


def test_worker_records_before_ack_trains_kto_and_publishes(bus, base_ref, pair_tokens, tmp_path):
    client, keys = bus
    (p1, c1), (p2, c2) = pair_tokens
    first = rating("live", p1, c1, True, "chatcmpl-1")
    ids = [xadd(client, keys, first), xadd(client, keys, rating("live", p2, c2, False, "chatcmpl-2"))]
    rerate = rating("live", p1, c1, False, "chatcmpl-1")  # the same user changes their mind
    ids.append(xadd(client, keys, rerate, replaces=first.id))
    sub = client.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(keys.notices)
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3))
    backend.warm_up()  # what TrainerWorker.run() does first: the model is built before any signal
    warmed = backend._fresh
    worker = TrainerWorker(
        client, keys, tmp_path, backend, BatchScheduler(TrainingSection(kto_min_batch=2)), consumer="w1", block_ms=100
    )
    [notice] = worker.poll()
    assert backend.model_for("live") is warmed and backend._fresh is None  # the new lineage took it
    # dataset of record: every entry read, including the superseded rating
    records = read_dataset(tmp_path)
    assert [r["stream_id"] for r in records] == ids
    assert records[2]["event"]["replaces"] == first.id
    # the step trained on the latest rating per (completion, user): two undesirable examples
    manifest = AdapterStore(tmp_path).get("live", 1)
    assert notice.name == manifest.name == "live@1" and notice.sha256 == manifest.sha256
    assert notice.path == str(tmp_path / "adapters" / "live" / "1") and notice.kind == "kto"
    assert manifest.parent is None and manifest.metrics["events:sum"] == 2
    # fresh adapter = reference, so r = 0, z0 = 0 and each KTO term is λ(1 − σ(0)) = 0.5
    assert manifest.metrics["loss:sum"] == pytest.approx(0.5, abs=1e-5)
    weights = load_file(str(tmp_path / "adapters" / "live" / "1" / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in weights.items() if "lora_B" in k)
    [trained] = [json.loads(x) for x in (dataset_dir(tmp_path) / TRAINED_FILE).read_text().splitlines()]
    started, written = trained.pop("started_at"), trained.pop("written_at")
    assert trained == {
        "version": "live@1",
        "event_ids": [_id for _id in (records[1]["event"]["id"], rerate.id)],
        "stream_ids": [ids[1], ids[2]],
    }
    assert time.time() - 600 < started <= written <= time.time()  # the step's wall time, Unix seconds
    assert pending(client, keys) == 0
    msg = None
    for _ in range(50):
        msg = sub.get_message(timeout=0.1)
        if msg:
            break
    assert json.loads(msg["data"]) == notice.model_dump(mode="json")
    # the next batch is version 2, child of version 1, with both classes balanced 1:1
    xadd(client, keys, rating("live", p1, c1, True, "chatcmpl-3"))
    xadd(client, keys, rating("live", p2, c2, True, "chatcmpl-4"))
    xadd(client, keys, rating("live", p2, c2, False, "chatcmpl-5"))
    worker.scheduler.config = TrainingSection(kto_min_batch=3)
    [n2] = worker.poll()
    m2 = AdapterStore(tmp_path).get("live", 2)
    assert n2.parent == "live@1" and m2.parent == 1 and m2.step == 2
    assert m2.metrics["desirable_weight:mean"] == 0.5 and m2.metrics["undesirable_weight:mean"] == 1.0
    sub.close()


def test_dpo_then_sft_steps_on_one_lineage(bus, base_ref, pair_tokens, tmp_path):
    client, keys = bus
    (p1, c1), (_, c2) = pair_tokens
    msgs = [
        ChatMessage(role="user", content="What is the capital of France?"),
        ChatMessage(role="assistant", content="Paris."),
    ]
    xadd(
        client,
        keys,
        PreferenceEvent(
            id="preference-1", endpoint="ep", created=0, prompt_token_ids=p1, chosen_token_ids=c1, rejected_token_ids=c2
        ),
    )
    xadd(client, keys, DemonstrationEvent(id="demonstration-1", endpoint="ep", created=0, messages=msgs))
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(sft_lr=1e-3))
    worker = TrainerWorker(
        client,
        keys,
        tmp_path,
        backend,
        BatchScheduler(TrainingSection(sft_min_batch=1, dpo_min_batch=1)),
        consumer="w",
        block_ms=100,
    )
    notices = worker.poll()
    assert [(n.kind, n.name, n.parent) for n in notices] == [("dpo", "ep@1", None), ("sft", "ep@2", "ep@1")]
    store = AdapterStore(tmp_path)
    assert store.get("ep", 1).metrics["loss:sum"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference
    # SFT: the completion is the reply plus the template's end-of-turn tokens, and its NLL went down
    prompt, completion = backend.chat_pair(msgs[:1], "Paris.")
    assert backend.tokenizer.decode(completion) == "Paris.<|im_end|>\n"
    from livelora.trainer.event_datums import completion_datum

    before = store.get("ep", 2).metrics["loss:sum"]
    after = backend.model_for("ep").forward([completion_datum(prompt, completion)], "cross_entropy").metrics["loss:sum"]
    assert before > 0 and after < before
    assert pending(client, keys) == 0


def test_killed_worker_events_are_reclaimed_and_trained(bus, base_ref, pair_tokens, tmp_path):
    client, keys = bus
    (p1, c1), (p2, c2) = pair_tokens
    env = {
        **os.environ,
        "LIVELORA_HOME": str(tmp_path),
        "LIVELORA_MODEL": str(base_ref.path),
        "LIVELORA_REDIS_PREFIX": keys.prefix,
        "LIVELORA_CONSUMER": "doomed",
        "LIVELORA_KTO_MIN_BATCH": "100",
        "LIVELORA_MAX_WAIT_S": "100000",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "livelora.trainer.worker"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        ids = [
            xadd(client, keys, rating("crash", p1, c1, True, "c-a")),
            xadd(client, keys, rating("crash", p2, c2, False, "c-b")),
        ]
        deadline = time.time() + 60
        while time.time() < deadline and len(read_dataset(tmp_path)) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        assert [r["stream_id"] for r in read_dataset(tmp_path)] == ids  # durable on disk ...
        info = client.xpending_range(keys.signals, TRAINERS_GROUP, "-", "+", 10)
        assert [(e["message_id"], e["consumer"]) for e in info] == [(i, "doomed") for i in ids]  # ... not acked
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    backend = OnlineTrainer(base_ref, tmp_path)
    worker = TrainerWorker(
        client,
        keys,
        tmp_path,
        backend,
        BatchScheduler(TrainingSection(kto_min_batch=2)),
        consumer="rescuer",
        claim_idle_s=0.3,
        block_ms=50,
    )
    time.sleep(0.4)
    [notice] = worker.poll()
    assert notice.name == "crash@1" and notice.kind == "kto"
    assert pending(client, keys) == 0
    trained = json.loads((dataset_dir(tmp_path) / TRAINED_FILE).read_text().splitlines()[0])
    assert trained["stream_ids"] == ids
    assert len(read_dataset(tmp_path)) == 2  # re-appended lines dedupe by event id


def test_trained_but_unacked_events_are_not_trained_twice(bus, base_ref, pair_tokens, tmp_path):
    """A crash after the version is written but before XACK: the redelivered events are acked, not retrained."""
    client, keys = bus
    (p1, c1), (p2, c2) = pair_tokens
    ids = [
        xadd(client, keys, rating("once", p1, c1, True, "c1")),
        xadd(client, keys, rating("once", p2, c2, False, "c2")),
    ]
    backend = OnlineTrainer(base_ref, tmp_path)
    w1 = TrainerWorker(
        client, keys, tmp_path, backend, BatchScheduler(TrainingSection(kto_min_batch=2)), consumer="same", block_ms=50
    )
    w1.claims.commit = lambda event_ids, stream_ids: 0  # the process dies after trained.jsonl, before its commit
    assert [n.name for n in w1.poll()] == ["once@1"]
    assert pending(client, keys) == 2
    w2 = TrainerWorker(
        client, keys, tmp_path, backend, BatchScheduler(TrainingSection(kto_min_batch=2)), consumer="same", block_ms=50
    )  # restarted under the same consumer name
    assert w2.poll() == []
    assert pending(client, keys) == 0
    assert [m.version for m in AdapterStore(tmp_path).list("once")] == [1]
    assert len(ids) == 2


def test_warm_model_resumes_a_stored_lineage_or_gives_way_to_its_shape(base_ref, tmp_path):
    """After a restart the model built ahead takes the newest version's weights when the LoRA shapes agree; a
    lineage of another rank gets a model of its own shape."""
    import torch

    from livelora.clients.types.tinker import LoraConfig
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(tmp_path)
    for lineage, rank in (("same", 8), ("other", 4)):
        tm = TrainingModel(base_ref, LoraConfig(rank=rank, alpha=32, train_unembed=False))
        with torch.no_grad():
            for k, p in tm.lora_params.items():
                if "lora_B" in k:
                    p.normal_(0, 0.02)
        tm.save_weights(store, lineage)
        del tm
    saved = load_file(str(store.version_dir("same", 1) / "adapter_model.safetensors"))

    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(lora_rank=8, lora_alpha=32))
    backend.warm_up()
    warmed = backend._fresh
    model = backend.model_for("same")
    assert model is warmed and model.parent == 1
    assert all(torch.equal(model.lora_params[k].detach(), saved[k]) for k in saved)

    backend.warm_up()
    warmed = backend._fresh
    other = backend.model_for("other")
    assert other is not warmed and other.lora.rank == 4 and other.parent == 1


class _SlowBackend:
    """Writes a real (tiny) adapter version per batch after ``delay_s``: the worker's bookkeeping under a step
    longer than the claim idle time, without the cost of the model."""

    def __init__(self, home, delay_s: float):
        self.store = AdapterStore(home)
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def train(self, batch):
        time.sleep(self.delay_s)

        def write(tmp):
            (tmp / "adapter_model.safetensors").write_bytes(json.dumps([e.id for e in batch.events]).encode())
            (tmp / "adapter_config.json").write_text("{}")

        with self.lock:
            return self.store.write_version(batch.lineage, write, base_model="test")

    def path_of(self, manifest):
        return self.store.version_dir(manifest.lineage, manifest.version)


class _RatedDuringStep(_SlowBackend):
    """A slow backend whose first step sees ``during`` more ratings accepted (added to the stream) while it runs."""

    def __init__(self, home, delay_s: float, client, keys, during: list):
        super().__init__(home, delay_s)
        self.client, self.keys, self.during, self.added = client, keys, during, []

    def train(self, batch):
        if self.during:
            self.added = [xadd(self.client, self.keys, ev) for ev in self.during]
            self.during = []
        return super().train(batch)


def test_ratings_left_after_a_step_wait_from_their_arrival_not_from_the_steps_end(bus, tmp_path):
    """Four ratings make a full step (4 s); two more are accepted as it starts. When the worker reads them after
    the step they have waited longer than max_wait_s (2 s): the next poll trains them at once (a partial batch),
    instead of queueing them for a whole new max_wait_s counted from the step's end. A rating that a screened
    batch puts back keeps its arrival too; a failed step's retry waits again."""
    from livelora.trainer.scheduler import Batch, arrival

    client, keys = bus
    config = TrainingSection(kto_min_batch=4, max_wait_s=2.0)
    late = [rating("wait", [1, 2], [3], i == 0, f"late-{i}") for i in range(2)]
    backend = _RatedDuringStep(tmp_path, 4.0, client, keys, late)
    worker = TrainerWorker(client, keys, tmp_path, backend, BatchScheduler(config), consumer="w", block_ms=50)
    for i in range(4):
        xadd(client, keys, rating("wait", [1, 2], [3], i % 2 == 0, f"first-{i}"))
    [first] = worker.poll()
    assert first.name == "wait@1" and len(backend.added) == 2 and len(worker.scheduler) == 0
    [second] = worker.poll()  # read now, 4 s after they were accepted: due at once
    assert second.name == "wait@2"
    trained = [json.loads(x) for x in (dataset_dir(tmp_path) / TRAINED_FILE).read_text().splitlines()]
    assert trained[1]["stream_ids"] == backend.added and trained[1]["event_ids"] == [e.id for e in late]
    st = json.loads(client.get(keys.learning("wait")))
    assert st["last"]["detail"].startswith("kto step on 2 event(s): a partial batch (2 of 4), started because")

    # the queue's times are the ratings' acceptance times (stream ids), also for a batch put back
    sched, now = worker.scheduler, time.time()
    sid = xadd(client, keys, rating("wait", [1, 2], [3], True, "put-back"))
    accepted = int(sid.split("-")[0]) / 1000
    assert arrival(sid, now + 100) == accepted and arrival(sid, 5.0) == 5.0  # never after the clock's now
    sched.requeue(Batch("wait", "kto", [late[0]], [sid]), now + 100)
    assert sched.queued("wait")["kto"] == (1, accepted)
    sched.clear()
    sched.requeue(Batch("wait", "kto", [late[0]], [sid]), now + 100, restart_wait=True)  # a failed step's retry
    assert sched.queued("wait")["kto"] == (1, now + 100)


def test_a_lone_rating_handed_back_keeps_its_arrival(bus, tmp_path):
    """A rating alone for 2 x max_wait_s goes back to the group as a new entry carrying its first arrival: read
    again, it has waited since it was accepted, so the next rating starts a step with it at once."""
    client, keys = bus
    config = TrainingSection(kto_min_batch=4, max_wait_s=0.5)
    worker = TrainerWorker(
        client, keys, tmp_path, _SlowBackend(tmp_path, 0.0), BatchScheduler(config), consumer="w", block_ms=50
    )
    first = xadd(client, keys, rating("lone", [1, 2], [3], True, "lone-0"))
    accepted = int(first.split("-")[0]) / 1000
    assert worker.poll() == [] and worker.scheduler.queued("lone")["kto"] == (1, accepted)
    time.sleep(2 * config.max_wait_s + 0.1)
    assert worker.poll() == []  # handed back: a new entry with the same event
    [(sid, fields)] = client.xrange(keys.signals)
    assert sid != first and float(fields["arrived"]) == pytest.approx(accepted, abs=1e-3)
    assert json.loads(fields["event"])["completion_id"] == "lone-0"
    assert worker.poll() == []  # read again: still alone, but its wait counts from its acceptance
    assert worker.scheduler.queued("lone")["kto"] == (1, pytest.approx(accepted, abs=1e-3))
    xadd(client, keys, rating("lone", [1, 2], [3], False, "lone-1"))
    [notice] = worker.poll()  # the oldest waited over max_wait_s: a partial batch of the two, now
    assert notice.name == "lone@1"
    trained = [json.loads(x) for x in (dataset_dir(tmp_path) / TRAINED_FILE).read_text().splitlines()]
    assert len(trained) == 1 and len(trained[0]["event_ids"]) == 2


def test_two_workers_slow_steps_train_every_event_once_and_trim_the_stream(bus, tmp_path):
    """Steps 4x longer than claim_idle_s: claims are renewed (no worker reclaims entries a live worker holds,
    not even its own), every event is recorded once and trained once, and acknowledged entries are deleted."""
    client, keys = bus
    ids = [xadd(client, keys, rating("slow", [1, 2, 3], [4, 5], i % 2 == 0, f"c{i}")) for i in range(12)]
    sched = TrainingSection(kto_min_batch=2, max_wait_s=0.5)
    workers = [
        TrainerWorker(
            client,
            keys,
            tmp_path,
            _SlowBackend(tmp_path, 1.2),
            BatchScheduler(sched),
            consumer=f"w{i}",
            claim_idle_s=0.3,
            claim_interval_s=0.1,
            block_ms=50,
            read_count=4,
        )
        for i in range(2)
    ]
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), kwargs={"retry_s": 0.1}) for w in workers]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    try:
        while time.time() < deadline and len(_trained_events(tmp_path)) < 12:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    events = _trained_events(tmp_path)
    assert sorted(set(events)) == sorted(r["event"]["id"] for r in read_dataset(tmp_path)) and len(events) == 12
    assert len(set(events)) == len(events)  # trained exactly once
    recorded = [
        json.loads(x)["event"]["id"]
        for p in dataset_dir(tmp_path).glob("[0-9]*.jsonl")
        for x in p.read_text().splitlines()
    ]
    assert len(recorded) == len(set(recorded)) == 12  # the dataset of record holds each once
    assert all(w.published for w in workers)  # both workers trained
    assert pending(client, keys) == 0 and client.xlen(keys.signals) == 0 and len(ids) == 12
    assert int(client.get(keys.signals_retrained) or 0) == 0


def _trained_events(home) -> list[str]:
    path = dataset_dir(home) / TRAINED_FILE
    return [e for x in path.read_text().splitlines() for e in json.loads(x)["event_ids"]] if path.exists() else []


def _tiny_version(store: AdapterStore, lineage: str, tag: str):
    def write(tmp):
        (tmp / "adapter_model.safetensors").write_bytes(tag.encode())
        (tmp / "adapter_config.json").write_text("{}")

    return store.write_version(lineage, write, base_model="test")


def test_live_loop_prunes_oldest_unused_versions_and_holds_back_when_none_can_go(bus, tmp_path):
    """max_adapter_versions in the live loop (real store, real Redis, a backend writing tiny versions): at the
    limit the worker deletes the lineage's oldest version no endpoint uses (never the served one, its
    predecessor, a pinned one, a rollback target or an open canary's), records it in the endpoint's history and
    trains; when nothing can go it writes nothing, keeps the signals pending, counts it, and trains later."""
    from prometheus_client import REGISTRY

    from livelora.adapters.endpoints import EndpointStore
    from livelora.adapters.kept_versions import AdapterVersions
    from livelora.core.owners import OwnerStore
    from livelora.core.quotas import Limits, QuotaStore

    client, keys = bus
    store, endpoints, quotas = AdapterStore(tmp_path), EndpointStore(tmp_path), QuotaStore(tmp_path)
    OwnerStore(tmp_path).claim("lineage", "acme.qlin", "acme")
    for i in range(1, 6):
        _tiny_version(store, "acme.qlin", f"v{i}")
    endpoints.create("acme.qep", "acme.qlin", tenant="acme", who="test")  # follow: serves @5
    endpoints.create("acme.qpin", "acme.qlin", tenant="acme", who="test", mode="pinned", version=1)
    endpoints.promote("acme.qpin", 2, tenant="acme", who="test")  # @1 is its rollback target
    endpoints.record(
        "acme.qep",
        "canary",
        who="gateway",
        from_="acme.qlin@3",
        to="acme.qlin@5",
        tenant="acme",
        details={"state": "started"},
    )  # an open canary from @3
    quotas.set("acme", Limits(max_adapter_versions=6))
    now = [1000.0]
    worker = TrainerWorker(
        client,
        keys,
        tmp_path,
        _SlowBackend(tmp_path, 0.0),
        BatchScheduler(TrainingSection(kto_min_batch=2)),
        consumer="q1",
        block_ms=50,
        clock=lambda: now[0],
        versions=AdapterVersions(tmp_path, Limits()),
        quota_retry_s=30,
    )

    def held_back() -> float:
        return REGISTRY.get_sample_value("livelora_live_steps_held_back_total", {"endpoint": "acme.qep"}) or 0.0

    def rate_twice(tag: str) -> None:
        for i in range(2):
            xadd(client, keys, rating("acme.qep", [1, 2, 3], [4], i == 0, f"{tag}-{i}"))

    rate_twice("a")  # 5 kept, limit 6: room, nothing pruned
    [n6] = worker.poll()
    assert n6.name == "acme.qlin@6" and store.version_numbers("acme.qlin") == [1, 2, 3, 4, 5, 6]
    rate_twice("b")  # 6 kept: the oldest unused (@4) goes, @7 is written
    [n7] = worker.poll()
    assert n7.name == "acme.qlin@7" and store.version_numbers("acme.qlin") == [1, 2, 3, 5, 6, 7]
    [prune] = [h for h in endpoints.history("acme.qep") if h.action == "prune"]
    assert prune.details == {"deleted": ["acme.qlin@4"], "kept": 6, "limit": 6} and prune.tenant == "acme"
    # @1 rollback target, @2 pinned, @3 canary incumbent, @5 canary, @6 predecessor, @7 served: nothing can go
    before = held_back()
    rate_twice("c")
    assert worker.poll() == []
    assert store.version_numbers("acme.qlin") == [1, 2, 3, 5, 6, 7]  # nothing written, nothing deleted
    assert pending(client, keys) == 2 and held_back() == before + 1  # the signals are kept, the hold counted
    assert AdapterVersions(tmp_path, Limits()).count("acme") == 6
    # the canary ends: @3 and @5 are free again; before quota_retry_s the batch still waits
    endpoints.record(
        "acme.qep",
        "canary",
        who="gateway",
        from_="acme.qlin@3",
        to="acme.qlin@5",
        tenant="acme",
        details={"state": "completed"},
    )
    assert worker.poll() == [] and pending(client, keys) == 2
    now[0] += 31
    [n8] = worker.poll()
    assert n8.name == "acme.qlin@8"
    assert store.version_numbers("acme.qlin") == [1, 2, 5, 6, 7, 8]  # the oldest one free again: @3
    assert pending(client, keys) == 0
    # lifted: no pruning at all
    quotas.set("acme", Limits.model_validate({"max_adapter_versions": None}))
    rate_twice("d")
    [n9] = worker.poll()
    assert n9.name == "acme.qlin@9" and len(store.version_numbers("acme.qlin")) == 7
    worker.close()


def test_a_paused_lineage_keeps_its_ratings_queued_until_resumed(bus, base_ref, pair_tokens, tmp_path):
    """An admin's pause (``POST /admin/endpoints/{name}/pause``) holds the lineage's due batch in the queue (no
    version, the entries stay pending); after resume the same ratings train one version."""
    from livelora.adapters.endpoints import EndpointStore

    client, keys = bus
    (p1, c1), (p2, c2) = pair_tokens
    store = EndpointStore(tmp_path)
    store.create("held", "held-l", tenant="default", who="t")
    store.set_learning("held", True, tenant="default", who="t", reason="reviewing the ratings")
    assert store.paused_lineages() == {"held-l"} and store.history("held")[-1].action == "pause"
    ids = [
        xadd(client, keys, rating("held", p, c, up, f"chatcmpl-h{i}"))
        for i, (p, c, up) in enumerate([(p1, c1, True), (p2, c2, False)])
    ]
    backend = OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3))
    worker = TrainerWorker(
        client, keys, tmp_path, backend, BatchScheduler(TrainingSection(kto_min_batch=2)), consumer="w1", block_ms=100
    )
    assert worker.poll() == [] and worker.poll() == []
    assert AdapterStore(tmp_path).list("held-l") == [] and pending(client, keys) == 2
    assert worker.scheduler.queued("held-l")["kto"][0] == 2
    store.set_learning("held", False, tenant="default", who="t", reason="looks fine")
    [notice] = worker.poll()
    assert notice.name == "held-l@1" and AdapterStore(tmp_path).get("held-l", 1).metrics["events:sum"] == 2
    assert pending(client, keys) == 0 and len(ids) == 2
