"""Feedback governance on real Redis and a real trainer worker: one rater's flood is capped (rate limit →
quarantine, kept in the dataset of record, listed by the admin service, recorded in the history; at most a set
share of a batch per rater), a rater contradicting the others on the same completions gets a lower weight in
the loss (rater agreement), and delete-by-user removes a user's signals from the dataset of record and from
every later batch."""

from __future__ import annotations

import time
import uuid

import pytest

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.types.signals import RatingEvent
from livelora.clients.types.tinker import TensorData
from livelora.core.governance import agreement_weights, rater_of, read_quarantine
from livelora.trainer.dataset import read_dataset
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.signal_governor import FeedbackGovernor
from livelora.trainer.worker import TrainerWorker

EP = "gov"


def rating(user: str, i: int, up: bool = True, cid: str | None = None) -> RatingEvent:
    cid = cid or f"chatcmpl-{uuid.uuid4().hex}"
    return RatingEvent(
        id=f"feedback-{uuid.uuid4().hex}",
        endpoint=EP,
        created=int(time.time()),
        completion_id=cid,
        prompt_token_ids=[1, 2, 3 + i],
        completion_token_ids=[4, 5],
        rating=up,
        rating_key=f"{cid}:{user}",
        user=user,
    )


def worker_for(client, keys, home, base_ref, **training) -> TrainerWorker:
    cfg = TrainingSection(**{"kto_min_batch": 100, "max_batch": 100, "max_wait_s": 3600, **training})
    gov = FeedbackGovernor(client, keys, home, max_events=cfg.rater_max_events, window_s=cfg.rater_window_s)
    return TrainerWorker(
        client,
        keys,
        home,
        OnlineTrainer(base_ref, home, cfg),
        BatchScheduler(cfg),
        consumer="w1",
        governor=gov,
        block_ms=10,
    )


def send(client, keys, events) -> None:
    for ev in events:
        client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": ""})


def test_one_raters_flood_is_quarantined_kept_listed_and_audited(bus, tmp_path, base_ref):
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    client, keys = bus
    w = worker_for(client, keys, tmp_path, base_ref, rater_max_events=5, rater_window_s=600)
    flood = [rating("mallory", i, up=False) for i in range(12)]
    honest = [rating("alice", i) for i in range(3)]
    send(client, keys, flood[:6] + honest + flood[6:])
    w.poll(block_ms=10)
    queued = {e.id for (_, kind), q in w.scheduler._queues.items() for _, e, _ in q.items.values()}
    assert queued == {e.id for e in flood[:5] + honest}  # 5 of mallory's 12, all of alice's
    assert {r["event"]["id"] for r in read_dataset(tmp_path)} == {e.id for e in flood + honest}  # all kept
    q = read_quarantine(tmp_path)
    assert [r["event_id"] for r in q] == [e.id for e in flood[5:]] and {r["rater"] for r in q} == {"mallory"}
    assert q[0]["reason"].startswith("rate_limit: 5 events")
    assert [r["event_id"] for r in StoreAdmin(tmp_path, tenant=None).quarantine()] == [e.id for e in flood[5:]]
    assert StoreAdmin(tmp_path, tenant="acme").quarantine() == []  # another tenant sees none of it
    hist = [h for h in EndpointStore(tmp_path).history(EP) if h.action == "quarantine"]
    assert len(hist) == 1 and hist[0].to == "mallory" and hist[0].details["limit"] == 5  # one line per burst
    assert client.xpending(keys.signals, "trainers")["pending"] == 8  # the quarantined ones are acknowledged
    w.close()


def test_no_rater_fills_more_than_the_share_of_a_batch():
    sched = BatchScheduler(TrainingSection(kto_min_batch=8, max_batch=32, rater_max_batch_share=0.5))
    flood = [rating("mallory", i) for i in range(10)]
    honest = [rating("alice", i, up=False) for i in range(2)] + [rating("bob", 0, up=False)]
    for n, ev in enumerate(flood[:5] + honest + flood[5:]):
        sched.add("lin", f"{n + 1}-0", ev, now=0)
    batch = sched.due(now=1)[0]
    raters = [rater_of(e) for e in batch.events]
    assert len(batch.events) == 6 and raters.count("mallory") == 3  # m = 6: mallory 3, alice 2, bob 1
    assert [e.id for e in batch.events if rater_of(e) == "mallory"] == [e.id for e in flood[:3]]  # oldest first
    assert len(sched) == 7 and sched.due(now=2) == []  # mallory's surplus waits
    solo = BatchScheduler(TrainingSection(kto_min_batch=4, rater_max_batch_share=0.5))
    for n, ev in enumerate(flood[:4]):
        solo.add("lin", f"{n + 1}-0", ev, now=0)
    assert len(solo.due(now=1)[0].events) == 4  # a lone rater is limited by rate only


def test_agreement_weight_formula_values():
    # alice and bob agree on three completions, mallory contradicts both each time
    three = {f"c{i}": {"alice": 1, "bob": 1, "mallory": 0} for i in range(3)}
    one_pass = agreement_weights(three, iterations=1)
    # pass 1, every p = p0 = 0.9 (logit l0 = ln 9): alice's others are bob (+l0) and mallory (−l0): P = σ(0) = ½;
    # mallory's others both say the opposite: P = σ(−2·l0) = 1/82. p = (4·0.9 + 3·P) / (4 + 3), w = (2p − 1)/0.8
    p_a, p_m = (3.6 + 1.5) / 7, (3.6 + 3 / 82) / 7
    assert one_pass["alice"]["weight"] == pytest.approx((2 * p_a - 1) / 0.8)  # 0.5714
    assert one_pass["mallory"]["weight"] == pytest.approx((2 * p_m - 1) / 0.8)  # 0.0488
    w = agreement_weights(three)  # the fixed point
    assert w["alice"]["weight"] == w["bob"]["weight"] == pytest.approx(0.985, abs=1e-3)
    assert w["mallory"]["weight"] == pytest.approx(0.051, abs=1e-3) and w["mallory"]["compared"] == 3
    assert [
        round(agreement_weights({f"c{i}": {"a": 1, "b": 1, "m": 0} for i in range(n)})["m"]["weight"], 2)
        for n in (1, 2, 4)
    ] == [0.56, 0.27, 0.0]
    lone = agreement_weights({"c0": {"carol": 1}, "c1": {"carol": 0}})  # never compared: weight 1
    assert lone["carol"] == {"weight": 1.0, "agreement": 0.9, "compared": 0.0}
    duel = agreement_weights({f"c{i}": {"h": 1, "x": 0} for i in range(10)})  # symmetric: both fall alike
    assert duel["h"]["weight"] == duel["x"]["weight"] < 0.2


def test_contradicting_rater_counts_less_in_the_loss(bus, tmp_path, base_ref):
    client, keys = bus
    cfg = TrainingSection(kto_min_batch=100, max_batch=100, max_wait_s=3600)
    gov = FeedbackGovernor(client, keys, tmp_path, max_events=0, window_s=60)
    w = TrainerWorker(
        client,
        keys,
        tmp_path,
        OnlineTrainer(base_ref, tmp_path, cfg),
        BatchScheduler(cfg),
        consumer="w1",
        governor=gov,
        block_ms=10,
    )
    cids = [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(2)]
    events = [rating(u, i, up=(u != "mallory"), cid=c) for i, c in enumerate(cids) for u in ("alice", "bob", "mallory")]
    send(client, keys, events)
    w.poll(block_ms=10)
    lineage = EndpointStore(tmp_path).get(EP).lineage
    assert len(client.hgetall(keys.rater_labels(lineage))) == 6  # shared by every worker, in Redis
    weights = gov.weights(lineage)
    assert weights == agreement_weights({c: {"alice": 1, "bob": 1, "mallory": 0} for c in cids})
    assert weights["mallory"]["weight"] == pytest.approx(0.268, abs=1e-3)  # contradicted on 2 completions
    assert weights["alice"]["weight"] == pytest.approx(0.929, abs=1e-3)

    batch = gov.weigh(w.scheduler.due(now=time.time() + 7200)[0])
    a = {rater_of(e): x for e, x in zip(batch.events, batch.example_weights)}
    assert a == {r: weights[r]["weight"] for r in ("alice", "bob", "mallory")}
    n_d, n_u = 4 * a["alice"], 2 * a["mallory"]  # class weights balance weighted counts
    assert (batch.desirable_weight, batch.undesirable_weight) == pytest.approx((n_u / n_d, 1.0))
    # the loss is mean_i a_i·ℓ_i: L(a) = L(honest at a, mallory at 0) + a_mallory · L(mallory at 1, honest at 0)
    backend = w.backend
    data, loss_fn, lcfg, _ = backend.datums(batch)
    model = backend.model_for(lineage)
    assert [d.loss_fn_inputs["example_weight"].data for d in data] == [[x] for x in batch.example_weights]
    loss = model.forward(data, loss_fn, lcfg).metrics["loss:sum"]

    def loss_with(honest: float, mallory: float) -> float:
        for d, e in zip(data, batch.events):
            d.loss_fn_inputs["example_weight"] = TensorData.from_list(
                [mallory if e.user == "mallory" else honest], "float32"
            )
        return model.forward(data, loss_fn, lcfg).metrics["loss:sum"]

    honest_part, mallory_part = loss_with(a["alice"], 0.0), loss_with(0.0, 1.0)
    assert mallory_part > 0.1 * honest_part  # mallory's terms are not negligible at 1
    assert loss == pytest.approx(honest_part + a["mallory"] * mallory_part, rel=1e-5)
    w.close()


def test_deleted_user_is_gone_from_the_dataset_and_from_later_batches(bus, tmp_path, base_ref):
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    client, keys = bus
    w = worker_for(client, keys, tmp_path, base_ref)
    alice = [rating("alice", i) for i in range(3)]
    bob = [rating("bob", i, up=False) for i in range(3)]
    send(client, keys, alice + bob)
    w.poll(block_ms=10)
    assert len(read_dataset(tmp_path)) == 6 and len(w.scheduler) == 6

    out = StoreAdmin(tmp_path, tenant=None).forget_user("alice", who="local:test", reason="GDPR request 17")
    assert out["signals_removed"] == {EP: 3}
    assert {r["event"]["user"] for r in read_dataset(tmp_path)} == {"bob"}  # gone from the dataset of record
    hist = [h for h in EndpointStore(tmp_path).history(EP) if h.action == "forget"]
    assert len(hist) == 1 and hist[0].to == "user:alice" and hist[0].details["signals"] == 3
    assert hist[0].reason == "GDPR request 17"

    late = [rating("alice", 9)]
    send(client, keys, late + [rating("carol", 1, up=False)])
    w.poll(block_ms=10)
    assert all(
        e.user != "alice"
        for (_, _), q in w.scheduler._queues.items()
        for _, e, _ in q.items.values()
        if e.id == late[0].id
    )
    batch = w.scheduler.due(now=time.time() + 7200)[0]  # what the next step would get, after the screen
    screened = w.intake.screen(batch)
    assert {e.user for e in screened.events} == {"bob", "carol"} and len(screened.events) == 4
    assert {r["event"]["user"] for r in read_dataset(tmp_path)} == {"bob", "carol"}  # the late one not recorded
    w.close()
