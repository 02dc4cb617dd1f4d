"""Fair share and per-tenant ceilings on one live gateway in key mode (real SmolLM2, real Redis, its own store).

Tenant ``acme`` floods the engine with the largest requests it may send while tenant ``beta`` sends ordinary
chats: every one of beta's succeeds. Requests over a tenant's ``max_n`` / ``max_n_tokens`` answer 400 naming the
limit; training models over ``max_lora_rank``, ``max_models_per_session`` or ``max_trainer_bytes`` are refused
(400 / 429 naming the limit) and nothing is created.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import httpx
import pytest
import redis
from harness.server import start_server

from livelora.core.api_keys import TENANT_ROLES, KeyStore
from livelora.core.quotas import Limits, QuotaStore
from livelora.core.redis_keys import KeyLayout

BASE = "smollm2-135m-instruct"
PREFIX = f"{os.environ['LIVELORA_REDIS_PREFIX']}fair-{uuid.uuid4().hex[:8]}:"
MAX_N, MAX_N_TOKENS = 8, 8 * 24
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def home(livelora_home, base_ref, tmp_path_factory):
    home = tmp_path_factory.mktemp("fair-home")
    (home / "models").symlink_to(livelora_home / "models", target_is_directory=True)
    return home


@pytest.fixture(scope="module")
def keys(home):
    store = KeyStore(home)
    return {t: store.create(t, list(TENANT_ROLES), t)[1] for t in ("acme", "beta", "gamma")}


@pytest.fixture(scope="module")
def server(home, keys):
    from livelora.gateway.settings import GatewaySettings

    live = start_server(
        GatewaySettings(
            model=BASE,
            home=home,
            device="cpu",
            max_batch_size=4,
            max_waiting=8,
            redis_prefix=PREFIX,
            executor_in_process=True,
            quota_max_n=MAX_N,
            quota_max_n_tokens=MAX_N_TOKENS,
        )
    )
    yield live
    live.stop()


def http(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {key}"})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def chat(**extra) -> dict:
    return {"model": BASE, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, **extra}


def test_a_flooding_tenant_leaves_room_for_another(server, keys):
    stop = threading.Event()
    flood = {"ok": 0, "busy": 0, "other": []}
    largest = chat(n=MAX_N, max_tokens=MAX_N_TOKENS // MAX_N, ignore_eos=True, stream=True)

    def flooder() -> None:
        with http(server, keys["acme"]) as a:
            while not stop.is_set():
                with a.stream("POST", CHAT, json=largest) as r:
                    if r.status_code == 200:
                        for _ in r.iter_lines():
                            pass
                        flood["ok"] += 1
                    elif r.status_code == 429:
                        flood["busy"] += 1
                        time.sleep(0.05)
                    else:
                        flood["other"].append((r.status_code, r.read()))

    threads = [threading.Thread(target=flooder, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    admission = server.admission
    try:
        deadline = time.monotonic() + 120
        while admission.admitted.tenants.get("acme", 0) < MAX_N and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admission.admitted.tenants.get("acme", 0) >= MAX_N  # acme holds a full-size request
        answers, acme_during = [], []
        with http(server, keys["beta"]) as b:
            for i in range(4):
                acme_during.append(admission.admitted.tenants.get("acme", 0))
                answers.append(b.post(CHAT, json=chat(seed=i)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"] for r in answers)
    assert max(acme_during) >= MAX_N  # beta was served while acme's flood held the engine
    assert flood["busy"] > 0 and flood["ok"] > 0 and flood["other"] == []  # acme itself was held to its share
    assert admission.active == 0 and admission.running.pool.total == 0


def test_request_shape_over_a_tenant_ceiling_is_400_naming_it(server, keys):
    with http(server, keys["beta"]) as b:
        err = error_of(b.post(CHAT, json=chat(n=MAX_N + 1)), 400)
        assert err["param"] == "n" and err["code"] == "integer_above_max_value" and "max_n" in err["message"]
        err = error_of(b.post(CHAT, json=chat(n=2, max_tokens=MAX_N_TOKENS // 2 + 1)), 400)
        assert err["param"] == "max_tokens" and "max_n_tokens" in err["message"]
        assert f"{MAX_N_TOKENS}" in err["message"]
        err = error_of(b.post(CHAT, json=chat(n=2, max_tokens=None, max_completion_tokens=MAX_N_TOKENS)), 400)
        assert err["param"] == "max_completion_tokens" and "max_n_tokens" in err["message"]
        r = b.post(
            "/v1/completions", json={"model": BASE, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
        )  # 3 prompts × n 3 = 9 sequences
        err = error_of(r, 400)
        assert err["param"] == "n" and "max_n" in err["message"]
        # unset max_tokens: each of n choices gets at most max_n_tokens / n
        r = b.post(CHAT, json=chat(n=MAX_N, max_tokens=None, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_N_TOKENS
    assert server.admission.active == 0


def _future(c: httpx.Client, request_id: str) -> dict:
    while True:
        r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.status_code != 408:
            assert r.status_code == 200, r.text
            return r.json()


def _create(c: httpx.Client, sid: str, seq: int, rank: int) -> httpx.Response:
    lora = {"rank": rank, "train_mlp": False, "train_unembed": False}
    return c.post(
        "/api/v1/create_model", json={"session_id": sid, "model_seq_id": seq, "base_model": BASE, "lora_config": lora}
    )


def test_training_models_over_a_ceiling_are_refused_and_nothing_is_created(server, keys, home):
    QuotaStore(home).set("gamma", Limits(max_lora_rank=8, max_models_per_session=1))
    client = redis.Redis.from_url(server.services.settings.redis_url, decode_responses=True)
    layout = KeyLayout(PREFIX)
    with http(server, keys["gamma"]) as g:
        sid = g.post("/api/v1/create_session", json={}).json()["session_id"]
        err = error_of(_create(g, sid, 0, 16), 400)
        assert err["param"] == "lora_config.rank" and "max_lora_rank" in err["message"] and "8" in err["message"]
        assert not client.exists(layout.model(f"{sid}:train:0"))
        created = _create(g, sid, 0, 2)
        assert created.status_code == 200, created.text
        assert _future(g, created.json()["request_id"])["model_id"] == f"{sid}:train:0"
        err = error_of(_create(g, sid, 1, 2), 429)
        assert err["param"] == "max_models_per_session" and err["code"] == "quota_exceeded"
        assert not client.exists(layout.model(f"{sid}:train:1"))
        QuotaStore(home).set("gamma", Limits(max_trainer_bytes=1))  # the live model already holds more
        other = g.post("/api/v1/create_session", json={}).json()["session_id"]
        err = error_of(_create(g, other, 0, 2), 429)
        assert err["param"] == "max_trainer_bytes" and "MiB" in err["message"]
        assert not client.exists(layout.model(f"{other}:train:0"))
        assert len([m for m in client.smembers(layout.models) if m.startswith(sid) or m.startswith(other)]) == 1
    with http(server, keys["beta"]) as b:  # another tenant's ceilings are its own
        sid_b = b.post("/api/v1/create_session", json={}).json()["session_id"]
        created = _create(b, sid_b, 0, 2)
        assert created.status_code == 200, created.text
    client.close()
