"""Segments through one live gateway (real SmolLM2, real Redis, its own store) and a real trainer worker with the
evaluation gate on: tenant acme's endpoint ``acme.live`` (shared version ``acme.support@1``) gets a segment
``vip``; a member (by ``user``, API key or header) is served the segment's version, anyone else the shared one;
ratings of its users train the segment's lineage alone, and the gate's verdict is recorded for the segment;
forgetting a user takes them out of it and deletes their signals; tenant beta cannot see, assign or be served by
it; bad input answers the OpenAI error envelope and changes nothing."""

from __future__ import annotations

import time

import httpx
import pytest
from harness.bus import new_prefix
from harness.console import console_client
from harness.seeds import saved_versions

from livelora.adapters.store import AdapterStore
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.redis_keys import KeyLayout
from livelora.trainer.dataset import read_dataset

EP, LINEAGE = "acme.live", "acme.support"
SEG, SEG_LINEAGE = f"{EP}::vip", "acme.support-seg-vip"
PREFIX = new_prefix("seg")
#: the harness ``keys``
KEYS = {
    "acme": ("acme", TENANT_ROLES),
    "app": ("acme", ("inference", "feedback")),
    "beta": ("beta", TENANT_ROLES),
    "ops": ("default", TENANT_ROLES),
}
#: the harness ``server``
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX}


def seed_home(home, base_ref) -> None:
    """``acme.support@1``: the shared version the endpoint serves when the segment is made."""
    saved_versions(base_ref, home, LINEAGE, seed=11, n=1)


def client(server, key: str, **headers) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}", **headers}, timeout=300)


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.request.method, str(r.request.url), r.status_code, r.text)
    return r.json()


def error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (str(r.request.url), r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(c: httpx.Client, user: str | None = None, model: str = EP, **headers) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    return c.post("/v1/chat/completions", json={**body, **({"user": user} if user else {})}, headers=headers)


def version_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-livelora-adapter-version"]


def wait_until(cond, timeout_s: float = 300) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def made(server, keys, server_redis) -> dict:
    """acme's endpoint with segments ``vip`` (alice, dave, the ``app`` key, header ``gold``) and ``basic``."""
    with client(server, keys["acme"]) as a:
        ok(a.post("/admin/endpoints", json={"name": EP, "lineage": LINEAGE}), 201)
        made = ok(a.post(f"/admin/endpoints/{EP}/segments", json={"name": "vip", "reason": "short answers"}), 201)
        members = {"users": ["alice", "dave"], "keys": [keys.records["app"].id], "headers": ["gold"]}
        ok(a.post(f"/admin/endpoints/{EP}/segments/vip/assign", json=members))
        ok(a.post(f"/admin/endpoints/{EP}/segments", json={"name": "basic"}), 201)
    return made


def test_segment_routing_bad_input_and_isolation(server, keys, made):
    home = server.services.settings.home
    assert (made["binding"], made["lineage"], made["origin"]) == (SEG, SEG_LINEAGE, f"{LINEAGE}@1")
    assert made["serving"] == f"{SEG_LINEAGE}@1"  # its lineage starts as a copy of the shared version
    assert AdapterStore(home).get(SEG_LINEAGE, 1).sha256 == AdapterStore(home).get(LINEAGE, 1).sha256
    with client(server, keys["acme"]) as a, client(server, keys["beta"]) as b:
        before = ok(a.get(f"/admin/endpoints/{EP}/segments"))
        assert [(s["name"], s["users"]) for s in before["data"]] == [("basic", []), ("vip", ["alice", "dave"])]

        # bad input: the error envelope, the right status, nothing changed
        error(a.post(f"/admin/endpoints/{EP}/segments/nope/assign", json={"users": ["x"]}), 404, "segment")
        error(a.post(f"/admin/endpoints/{EP}/segments/basic/assign", json={"users": ["alice"]}), 409, "users")
        error(a.post(f"/admin/endpoints/{EP}/segments/vip/assign", json={"headers": ["gold"]}), 409, "headers")
        error(a.post(f"/admin/endpoints/{EP}/segments", json={"name": "vip"}), 409, "segment")
        error(a.post(f"/admin/endpoints/{EP}/segments", json={"name": "x" * 33}), 400, "name")
        error(a.post(f"/admin/endpoints/{EP}/segments", json={"name": "Bad Name"}), 400, "segment")
        error(a.post(f"/admin/endpoints/{EP}/segments/basic/assign", json={"users": ["u" * 257]}), 400, "users")
        error(a.post(f"/admin/endpoints/{EP}/segments/basic/assign", json={"keys": ["nokey"]}), 404, "keys")
        error(a.post(f"/admin/endpoints/{EP}/segments/basic/unassign", json={"users": ["zed"]}), 404, "users")
        error(a.post("/admin/endpoints", json={"name": "acme.x::y", "lineage": "acme.xy"}), 400, "name")
        error(chat(a, "alice", **{"X-Livelora-Segment": "bad value!"}), 400)
        error(chat(a, "alice", model=SEG), 404, "model")  # a segment's binding is not a model name
        assert ok(a.get(f"/admin/endpoints/{EP}/segments")) == before

        # routing: by user, by API key, by header; anyone else gets the shared version
        assert version_of(chat(a, "alice")) == f"{SEG_LINEAGE}@1"
        assert version_of(chat(a, "carol")) == f"{LINEAGE}@1"
        assert version_of(chat(a, **{"X-Livelora-Segment": "gold"})) == f"{SEG_LINEAGE}@1"
        with client(server, keys["app"]) as app:
            assert version_of(chat(app)) == f"{SEG_LINEAGE}@1"
        models = [m["id"] for m in ok(a.get("/v1/models"))["data"]]
        assert EP in models and not any("::" in m for m in models)
        assert [e["name"] for e in ok(a.get("/admin/endpoints"))["data"]] == [EP]
        # usage is metered per segment: the segment's binding is the usage record's endpoint
        usage = lambda: a.get("/admin/usage", params={"subject": SEG}).json()["data"]  # noqa: E731
        assert wait_until(lambda: sum(r["tokens"] for r in usage()) > 0, timeout_s=30)

        # another tenant: cannot see, assign or be served by the segment; its own "alice" is someone else
        error(b.get(f"/admin/endpoints/{EP}/segments"), 404, "endpoint")
        error(b.post(f"/admin/endpoints/{EP}/segments/vip/assign", json={"users": ["mallory"]}), 404, "endpoint")
        error(chat(b, "alice"), 404, "model")
        ok(b.post("/admin/endpoints", json={"name": "beta.live", "lineage": "beta.support"}), 201)
        assert version_of(chat(b, "alice", model="beta.live", **{"X-Livelora-Segment": "gold"})) == "base"
        assert ok(a.get(f"/admin/endpoints/{EP}/segments")) == before
        # the public base endpoint's segments (tenant default's) are not named to another tenant, even in a 404
        base = server.services.registry.base_endpoint
        with client(server, keys["ops"]) as ops:
            ok(ops.post(f"/admin/endpoints/{base}/segments", json={"name": "house"}), 201)
        assert "::" not in error(b.get(f"/v1/learning/{base}"), 404, "model")["message"]
        error(b.get(f"/v1/learning/{base}::house"), 404, "model")


def test_segment_ratings_train_its_lineage_alone_with_its_gate_verdict_and_forgetting(
    server, keys, made, server_redis, base_ref
):
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.scheduler import BatchScheduler
    from livelora.trainer.settings import GateSection, TrainingSection
    from livelora.trainer.signal_governor import FeedbackGovernor
    from livelora.trainer.worker import TrainerWorker

    home, registry, layout = server.services.settings.home, server.services.registry, KeyLayout(PREFIX)
    # the gate on (conftest turns it off), no held-out ratings, no line search: one verdict per step
    gate = GateSection(gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=8, gate_min_step_scale=1.0)
    governor = FeedbackGovernor(server_redis, layout, home, max_events=0, window_s=60)
    worker = TrainerWorker(
        server_redis,
        layout,
        home,
        OnlineTrainer(base_ref, home, TrainingSection(kto_lr=1e-3), gate=gate),
        BatchScheduler(TrainingSection(kto_min_batch=2, max_wait_s=3600)),
        consumer="seg",
        block_ms=200,
        governor=governor,
    )
    with client(server, keys["acme"]) as a:
        replies = [chat(a, "alice"), chat(a, "alice")]
        assert {version_of(r) for r in replies} == {f"{SEG_LINEAGE}@1"}
        for r, up in zip(replies, (True, False), strict=True):
            ok(a.post("/v1/feedback", json={"completion_id": r.json()["id"], "rating": up, "user": "alice"}))
        notices: list = []
        deadline = time.monotonic() + 1200
        while not notices and time.monotonic() < deadline:
            notices = worker.poll()
        # alice's ratings trained the segment's lineage alone
        assert [n.name for n in notices] == [f"{SEG_LINEAGE}@2"] and notices[0].endpoint == SEG
        assert AdapterStore(home).version_numbers(LINEAGE) == [1]
        # the gate judged the new version for the segment, and the segment's history says so
        verdict = AdapterStore(home).get(SEG_LINEAGE, 2).gate["verdicts"][SEG]
        history = ok(a.get(f"/admin/endpoints/{SEG}/history"))["data"]
        [judged] = [h for h in history if h["action"] == "gate"]
        assert judged["to"] == f"{SEG_LINEAGE}@2" and judged["details"]["passed"] == verdict["passed"]
        assert judged["from"] == f"{SEG_LINEAGE}@1"
        if verdict["passed"]:  # then it serves the segment's users, and only them
            assert wait_until(lambda: registry.current.get(SEG) == f"{SEG_LINEAGE}@2")
            assert version_of(chat(a, "dave")) == f"{SEG_LINEAGE}@2"
        assert version_of(chat(a, "carol")) == f"{LINEAGE}@1"
        status = ok(a.get(f"/v1/learning/{EP}"))
        rows = {s["name"]: s for s in status["segments"]}
        assert (rows["vip"]["versions"], rows["vip"]["ratings"], rows["vip"]["liked"]) == (2, 2, 0.5)
        assert rows["vip"]["members"] == 4 and rows["basic"]["ratings"] == 0 and rows["basic"]["versions"] == 1
        assert status["lineage"] == LINEAGE and rows["vip"]["lineage"] == SEG_LINEAGE
        with console_client(server.base_url, keys["acme"]) as page:  # the console's endpoint page: one row each
            html = page.get(f"/console/endpoints/{EP}").text
        assert html.count('data-segment="') == 2 and f"{SEG_LINEAGE}@" in html

        # alice moves to basic and rates there (queued), then asks to be forgotten: both segments lose her
        ok(a.post(f"/admin/endpoints/{EP}/segments/vip/unassign", json={"users": ["alice"]}))
        ok(a.post(f"/admin/endpoints/{EP}/segments/basic/assign", json={"users": ["alice"]}))
        moved = chat(a, "alice")
        assert version_of(moved) == f"{LINEAGE}-seg-basic@1"
        ok(a.post("/v1/feedback", json={"completion_id": moved.json()["id"], "rating": True, "user": "alice"}))
        worker.poll()
        queued = [e for q in worker.scheduler._queues.values() for _, e, _ in q.items.values()]
        assert [(e.user, e.endpoint) for e in queued] == [("alice", f"{EP}::basic")]
        # the app also rates her reply without naming a user (not read yet): it holds her conversation all the same
        ok(a.post("/v1/feedback", json={"completion_id": moved.json()["id"], "rating": False}))
        gone = ok(a.post("/admin/users/alice/forget", json={"reason": "asked to be forgotten"}))
        assert gone["signals_removed"] == {SEG: 2, f"{EP}::basic": 1} and gone["segments_left"] == [f"{EP}::basic"]
        assert governor.forgotten(queued[0])  # the trainer drops her queued rating before it trains
        assert worker.poll() == []  # and the app's rating of her reply when it reads it
        hers = {r.json()["id"] for r in (*replies, moved)}  # her conversations: no event holds them any more
        assert not [
            r
            for r in read_dataset(home)
            if r["event"].get("user") == "alice" or r["event"].get("completion_id") in hers
        ]
        assert AdapterStore(home).version_numbers(f"{LINEAGE}-seg-basic") == [1]
        segments = {s["name"]: s for s in ok(a.get(f"/admin/endpoints/{EP}/segments"))["data"]}
        assert segments["basic"]["users"] == [] and segments["vip"]["users"] == ["dave"]
        assert version_of(chat(a, "alice")) == f"{LINEAGE}@1"
    worker.close()
