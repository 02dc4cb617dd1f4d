"""Watchable learning on a live gateway with a trainer (real Redis, real SmolLM2, the evaluation gate on): the
feedback answer counts down the ratings that start a step, ``GET /v1/learning/{endpoint}`` follows the step
through training and the gate to the published version (the trainer logs the same stages), ``livelora
endpoints show`` prints it, and another tenant's endpoint is a 404 like on every route."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
import uuid

import httpx
import pytest
from _doc_blocks import REPO, blocks
from harness.server import start_server
from typer.testing import CliRunner

from livelora.adapters.endpoints import EndpointStore
from livelora.cli.main import app as cli
from livelora.clients.types.learning import LearningStatus
from livelora.core.api_keys import TENANT_ROLES, KeyStore
from livelora.core.base_models import resolve_base_model
from livelora.core.bus import connect_sync
from livelora.core.governance import held_out
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import DEFAULT_MODEL
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.gate_base import BASE_CACHE_DIR
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import GateSection, TrainingSection
from livelora.trainer.worker import TrainerWorker, run_loop

EP = "acme.learn"
BATCH = 4
ORDER = ["waiting", "training", "gate", "published"]
PROMPTS = ["What is 2+2?", "Name a colour.", "Say hello.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def gate_base(tmp_path_factory):
    """One folder for the gate's base-model measurement (``models/gate-base``) of this module's stores: the first
    store's trainer measures the base model, the next one's reads it (the same probe set and base weights), as a
    trainer restarted on one store does (tests/test_gate_base_cache.py)."""
    return tmp_path_factory.mktemp("gate-base")


@pytest.fixture
def live(request, tmp_path, livelora_home, gate_base):
    """A fresh store (the converted base model and the module's gate-base folder linked in), keys of tenants acme
    and beta, acme's endpoint, a gateway and a trainer thread with the gate on. ``request.param``: ``(max_wait_s,
    gate_holdout_every[, batch])``, default ``(3600, 0)``: no partial batch, no held-out ratings (every rating
    counts toward the batch of :data:`BATCH`)."""
    max_wait_s, holdout_every, batch = (*getattr(request, "param", (3600, 0)), BATCH)[:3]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL).symlink_to(livelora_home / "models" / DEFAULT_MODEL)
    (tmp_path / BASE_CACHE_DIR).symlink_to(gate_base, target_is_directory=True)
    store = KeyStore(tmp_path)
    keys = {t: store.create(t, list(TENANT_ROLES), t)[1] for t in ("acme", "beta")}
    EndpointStore(tmp_path).create(EP, EP, tenant="acme", who="test")
    layout = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    server = start_server(
        GatewaySettings(
            model=DEFAULT_MODEL, home=tmp_path, redis_prefix=layout.prefix, device="cpu", executor_in_process=True
        )
    )
    redis = connect_sync("redis://127.0.0.1:6379/0")
    backend = OnlineTrainer(
        resolve_base_model(DEFAULT_MODEL, tmp_path),
        tmp_path,
        TrainingSection(kto_lr=1e-3),
        gate=GateSection(gate_enabled=True, gate_holdout_every=holdout_every),
    )
    scheduler = BatchScheduler(TrainingSection(kto_min_batch=batch, max_wait_s=max_wait_s))
    worker = TrainerWorker(redis, layout, tmp_path, backend, scheduler, consumer="learn", block_ms=200)
    stop = threading.Event()
    thread = threading.Thread(target=run_loop, args=(worker, stop), daemon=True)
    thread.start()
    try:
        yield server, keys
    finally:
        stop.set()
        thread.join(timeout=120)
        server.stop()
        for k in redis.scan_iter(match=layout.prefix + "*"):
            redis.delete(k)
        redis.close()


@pytest.mark.live
def test_rating_to_a_published_version_is_watchable(live, caplog):
    server, keys = live
    caplog.set_level(logging.INFO, logger="livelora.trainer.learning_status")
    acme = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=300)
    beta = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {keys['beta']}"}, timeout=300)

    before = acme.get(f"/v1/learning/{EP}")
    assert before.status_code == 200, before.text
    assert LearningStatus.model_validate(before.json()).ratings_waiting == 0

    to_step, notes = [], []
    for prompt in PROMPTS:
        r = acme.post(
            "/v1/chat/completions",
            json={"model": EP, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        fb = acme.post("/v1/feedback", json={"completion_id": r.json()["id"], "rating": len(to_step) % 2 == 0})
        assert fb.status_code == 200, fb.text
        assert fb.json()["endpoint"] == EP and fb.json()["rating"] == (len(to_step) % 2 == 0)
        to_step.append(fb.json()["ratings_to_step"])
        notes.append(fb.json()["training"])
    # 3, 2, 1 more; after the 4th none (or, once the trainer took the batch, the next step's 4)
    assert to_step[:3] == [3, 2, 1] and to_step[3] in (0, BATCH)
    rule = f"a step starts at {BATCH}, or on fewer (a partial batch) once the oldest has waited 3600 s"
    assert notes[:3] == [f"queued: {n} of {BATCH} ratings; {rule}" for n in (1, 2, 3)], notes
    if to_step[3] == 0:  # the rating that fills the batch (before the trainer took it)
        assert notes[3] == f"queued: {BATCH} of {BATCH} ratings, a full batch: a step starts now", notes

    seen: list[str] = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        st = LearningStatus.model_validate(acme.get(f"/v1/learning/{EP}").json())
        if not seen or seen[-1] != st.stage:
            seen.append(st.stage)
        if st.stage in ("published", "rejected"):
            break
        time.sleep(0.2)
    assert st.stage == "published", st.model_dump()
    assert [ORDER.index(s) for s in seen] == sorted(ORDER.index(s) for s in seen), seen  # never backwards
    assert st.version == f"{EP}@1" and st.last.version == f"{EP}@1" and st.last.stage == "published"
    assert st.ratings_waiting == 0 and st.ratings_to_step == BATCH and st.eta_s is None
    assert st.step_seconds is not None and st.step_seconds > 0
    assert st.step_times == []  # the trainer's first step (warm-up) is the estimate until a later step is timed
    marks = st.stages
    assert [m.at for m in marks] == sorted(m.at for m in marks)
    stages = [m.stage for m in marks]
    assert stages[0] == "waiting" and stages[-1] == "published"
    assert stages.index("training") < stages.index("gate")
    full = f"kto step on {BATCH} event(s): a full batch ({BATCH} start a step)"
    assert full in [m.detail for m in marks] and st.detail == st.last.detail == full
    assert "forward/backward and optimizer step" in [m.detail for m in marks]
    assert [m.check for m in marks if m.stage == "gate"] == ["probes", "replies", "verdict"]
    assert {m.step_scale for m in marks if m.stage == "gate"} == {1.0}  # the full step passed: no line search
    assert st.step_scale == st.last.step_scale == 1.0
    logged = [r.getMessage() for r in caplog.records if r.name == "livelora.trainer.learning_status"]
    for what in (f"training ({full})", "gate (probes)", "gate (verdict)", f"published ({EP}@1)"):
        assert f"learning {EP}: {what}" in logged, logged

    # the page's example (docs/live-loop.md), against this server, for tenant acme
    [block] = [b for b in blocks(REPO / "docs" / "live-loop.md") if "/v1/learning/" in b.code and b.lang == "bash"]
    code = block.code.replace("localhost:8000", server.base_url).replace("smollm2-135m-instruct", EP)
    code = code.replace("curl -s ", f"curl -s -H 'Authorization: Bearer {keys['acme']}' ")
    doc = json.loads(subprocess.run(["bash", "-c", code], capture_output=True, text=True, check=True).stdout)
    assert doc["stage"] == "published" and doc["version"] == f"{EP}@1"

    st = wait_serving(acme, f"{EP}@1")
    assert st.summary().startswith(f"serving {EP}@1; trained: {full}")
    shown = CliRunner().invoke(cli, ["endpoints", "show", EP, "--url", server.base_url, "--api-key", keys["acme"]])
    assert shown.exit_code == 0, shown.output
    assert f"serving {EP}@1" in shown.output and "learning" in shown.output

    # another tenant: the 404 of every route (here the chat route's), for a name that exists and one that does not
    theirs = beta.get(f"/v1/learning/{EP}")
    chat = beta.post("/v1/chat/completions", json={"model": EP, "messages": [{"role": "user", "content": "x"}]})
    assert theirs.status_code == chat.status_code == 404
    assert theirs.json() == chat.json() and theirs.json()["error"]["code"] == "model_not_found"
    unknown = acme.get("/v1/learning/acme.nosuch")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def wait_serving(client: httpx.Client, version: str) -> LearningStatus:
    """The status once the gateway serves ``version`` ("published, loading" until then)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = LearningStatus.model_validate(client.get(f"/v1/learning/{EP}").json())
        if st.serving == version:
            assert st.loading is None
            return st
        assert st.loading == version and f"published, loading {version}" in st.summary(), st.summary()
        time.sleep(0.2)
    raise AssertionError(f"{version} not served within 300 s")


@pytest.mark.live
@pytest.mark.parametrize("live", [(20, 2, 8)], indirect=True)
def test_a_partial_batch_and_held_out_ratings_say_so(live):
    """A few ratings then a pause longer than max_wait_s (a slow chat, a user who rates little): the step starts on
    the n (2 to 7) of 8 ratings queued and every answer says so; a held-out rating (1 in 2 here, by the event id's
    hash) says it is not trained on. (20 s: the ratings are all in before the oldest has waited; 8: a held-out one
    comes before a full batch but with chance 1/2^8.)"""
    batch, wait = 8, 20
    server, keys = live
    acme = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=300)
    queued, held = 0, 0
    for i in range(40):
        r = acme.post(
            "/v1/chat/completions",
            json={"model": EP, "messages": [{"role": "user", "content": PROMPTS[i % 4]}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        fb = acme.post("/v1/feedback", json={"completion_id": r.json()["id"], "rating": queued % 2 == 0}).json()
        if held_out(fb["id"], 2):
            held += 1
            assert fb["training"].startswith("held out: the evaluation gate keeps one rating in 2"), fb
        else:
            queued += 1
            assert fb["training"].startswith(f"queued: {queued} of {batch} ratings; a step starts at {batch}"), fb
        if queued >= 2 and held:
            break
    assert 2 <= queued < batch and held >= 1
    deadline = time.monotonic() + 900  # the oldest waits max_wait_s, then the step and the gate run
    while time.monotonic() < deadline:
        st = LearningStatus.model_validate(acme.get(f"/v1/learning/{EP}").json())
        if st.stage in ("published", "rejected"):
            break
        time.sleep(0.2)
    assert st.stage == "published", st.model_dump()
    partial = (
        f"kto step on {queued} event(s): a partial batch ({queued} of {batch}), started because the oldest had "
        f"waited max_wait_s {wait} s; later ratings wait for the next step"
    )
    assert st.last.detail == partial and partial in [m.detail for m in st.stages]
    assert st.ratings_held_out == held and st.ratings_quarantined == 0
    st = wait_serving(acme, f"{EP}@1")
    summary = st.summary()  # the gate may have scaled the step: "serving acme.learn@1 (step scaled by 0.5); ..."
    assert summary.startswith(f"serving {EP}@1") and f"; trained: {partial}; not trained on: {held} held out" in summary


@pytest.mark.live
def test_a_step_waiting_for_the_gates_base_measurement_says_so(tmp_path, livelora_home):
    """A fresh store's first step waits for the gate's start-up base measurement: the status says "training"
    with that check (not "waiting" with the ratings already taken), then the step runs and publishes."""
    from harness.gate import rating_batch
    from harness.server import wait_until

    from livelora.trainer.model import TrainingModel

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL).symlink_to(livelora_home / "models" / DEFAULT_MODEL)
    layout, redis = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:"), connect_sync("redis://127.0.0.1:6379/0")
    backend = OnlineTrainer(resolve_base_model(DEFAULT_MODEL, tmp_path), tmp_path, TrainingSection(kto_lr=1e-3))
    release = threading.Event()  # stands for a base measurement still running
    backend._base_thread = threading.Thread(target=release.wait, daemon=True)
    backend._base_thread.start()
    backend._fresh = TrainingModel(backend.base_ref, backend.config.lora)
    scheduler = BatchScheduler(TrainingSection(kto_min_batch=BATCH))
    worker = TrainerWorker(redis, layout, tmp_path, backend, scheduler, consumer="learn", block_ms=50)
    batch = rating_batch(backend, EP, BATCH)
    published: list = []
    step = threading.Thread(target=lambda: published.append(worker._train(batch)), daemon=True)

    def status() -> LearningStatus | None:
        raw = redis.get(layout.learning(batch.lineage))
        return LearningStatus.model_validate_json(raw) if raw else None

    try:
        step.start()
        assert wait_until(lambda: (s := status()) is not None and s.check is not None, timeout_s=120)
        st = status()
        assert (st.stage, st.check) == ("training", "waiting for the gate's base measurement (once per store)")
        assert st.detail.startswith(f"kto step on {BATCH} event(s)")
        release.set()
        step.join(timeout=600)
        assert published and published[0] is not None and status().stage == "published"
        assert [m.stage for m in status().stages][:3] == ["training", "training", "training"]  # taken, waited, ran
    finally:
        release.set()
        for k in redis.scan_iter(match=layout.prefix + "*"):
            redis.delete(k)
        redis.close()
