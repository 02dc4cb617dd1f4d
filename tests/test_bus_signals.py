"""Signal routes on real Redis: completion log, feedback/preferences/demonstrations, idempotency, 503."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis.asyncio as aredis
from fastapi import FastAPI

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.signals import CompletionRecord, RatingEvent, parse_stream_event
from livelora.core.bus import connect_async, delete_prefix, ensure_group_async
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout
from livelora.gateway.api.deps import get_signal_service
from livelora.gateway.api.errors import install_error_handlers
from livelora.gateway.api.signals import router
from livelora.gateway.services.live.completion_log import CompletionLog
from livelora.gateway.services.live.signals import SignalService

REDIS_URL = "redis://127.0.0.1:6379/0"
ENDPOINTS = {"default", "smollm2-135m-instruct"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Endpoints:
    """The two endpoint names the signal service may name (the registry's role), every one trainable."""

    @staticmethod
    def endpoint_for(name: str, principal) -> str:
        if name not in ENDPOINTS:
            raise ModelNotFoundError(f"unknown model {name!r}", param="model")
        return name

    @staticmethod
    def check_trainable(endpoint: str, principal) -> None:
        return None


def make_app(url: str, keys: KeyLayout, retention_s: int = 3600) -> tuple[FastAPI, aredis.Redis]:
    client = connect_async(url, timeout_s=0.5)
    log = CompletionLog(client, keys, retention_s=retention_s)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    app.state.signals = SignalService(client, keys, log, registry=Endpoints())
    app.dependency_overrides[get_signal_service] = lambda: app.state.signals
    app.state.log = log
    return app, client


@pytest.fixture
async def env():
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    app, client = make_app(REDIS_URL, keys)
    await ensure_group_async(client, keys)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        yield app, client, keys, http
    await delete_prefix(client, keys.prefix)
    await client.aclose()


def record(cid: str, prompt=(1, 2, 3), completion=(7, 8), caller=None, endpoint="default") -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        endpoint=endpoint,
        model="default",
        adapter="default@3",
        messages=[{"role": "user", "content": "hi"}],
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        logprobs=[-0.5, -1.25],
        completion="ok",
        finish_reason="stop",
        created=int(time.time()),
        caller=caller,
    )


async def stream(client, keys) -> list:
    return [(sid, parse_stream_event(f)) for sid, f in await client.xrange(keys.signals)]


@pytest.mark.anyio
async def test_completion_log_roundtrip_ttl_and_unique(env):
    app, client, keys, _ = env
    log = app.state.log
    rec = record("chatcmpl-a")
    await log.record(rec)
    assert await log.get("chatcmpl-a") == rec
    ttl = await client.ttl(keys.completion("chatcmpl-a"))
    assert 3590 <= ttl <= 3600
    with pytest.raises(Exception, match="already recorded"):
        await log.record(rec)


@pytest.mark.anyio
async def test_feedback_event_carries_exact_tokens_and_rerate_replaces(env):
    app, client, keys, http = env
    await app.state.log.record(record("chatcmpl-1"))
    r1 = await http.post("/v1/feedback", json={"completion_id": "chatcmpl-1", "rating": True, "user": "u1"})
    assert r1.status_code == 200, r1.text
    b1 = r1.json()
    assert b1["object"] == "feedback" and b1["rating"] is True and b1["replaces"] is None
    assert b1["endpoint"] == "default" and b1["id"].startswith("feedback-")
    # same user re-rates: replaces the first; another user does not
    r2 = await http.post(
        "/v1/feedback",
        json={"completion_id": "chatcmpl-1", "rating": False, "score": -2.5, "comment": "wrong", "user": "u1"},
    )
    r3 = await http.post("/v1/feedback", json={"completion_id": "chatcmpl-1", "rating": True, "user": "u2"})
    assert r2.json()["replaces"] == b1["id"]
    assert r3.json()["replaces"] is None
    events = await stream(client, keys)
    assert [e.id for _, e in events] == [b1["id"], r2.json()["id"], r3.json()["id"]]
    ev = events[1][1]
    assert isinstance(ev, RatingEvent)
    assert ev.prompt_token_ids == [1, 2, 3] and ev.completion_token_ids == [7, 8]
    assert ev.logprobs == [-0.5, -1.25] and ev.adapter == "default@3"
    assert (ev.rating, ev.score, ev.comment, ev.replaces) == (False, -2.5, "wrong", b1["id"])
    assert ev.rating_key == events[0][1].rating_key != events[2][1].rating_key


@pytest.mark.anyio
async def test_feedback_unknown_completion_and_bad_input_change_nothing(env):
    app, client, keys, http = env
    r = await http.post("/v1/feedback", json={"completion_id": "chatcmpl-nope", "rating": True})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "completion_id" and r.json()["error"]["code"] == "not_found"
    assert "older than the retention period (1 hour)" in r.json()["error"]["message"]  # retention_s 3600
    await app.state.log.record(record("chatcmpl-2"))
    for body in (
        {"completion_id": "chatcmpl-2"},  # no rating
        {"completion_id": "chatcmpl-2", "rating": True, "stars": 5},  # unknown field
        {"completion_id": "chatcmpl-2", "rating": "maybe"},  # not a boolean
        {"completion_id": "chatcmpl-2", "rating": "yes"},  # nor a look-alike
        {"completion_id": "chatcmpl-2", "rating": 1},
        {"completion_id": "chatcmpl-2", "rating": True, "score": True},  # a score is a number
        {"completion_id": "chatcmpl-2", "rating": True, "score": "2.5"},
    ):
        r = await http.post("/v1/feedback", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post(
        "/v1/feedback",
        content=b'{"completion_id": "chatcmpl-2", "rating": true, "score": NaN}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert await client.xlen(keys.signals) == 0


@pytest.mark.anyio
async def test_other_callers_completion_is_not_found(env):
    app, client, keys, _ = env
    from livelora.clients.types.signals import FeedbackRequest

    await app.state.log.record(record("chatcmpl-t", caller="key-a"))
    svc = app.state.signals
    with pytest.raises(KeyError):
        await svc.feedback(FeedbackRequest(completion_id="chatcmpl-t", rating=True), caller="key-b")
    out, _ = await svc.feedback(FeedbackRequest(completion_id="chatcmpl-t", rating=True), caller="key-a")
    assert out.completion_id == "chatcmpl-t"
    assert await client.xlen(keys.signals) == 1
    # one 404 for foreign and unknown ids (same message); a completion made in open mode (no caller) is tenant
    # default's: a tenant's key created later cannot rate it, default's (or open mode) can
    from livelora.clients.errors import NotFoundError

    await app.state.log.record(record("chatcmpl-open", caller=None))
    errors = []
    for cid, caller in (("chatcmpl-t", "key-b"), ("chatcmpl-open", "acme"), ("chatcmpl-none", "acme")):
        with pytest.raises(NotFoundError) as info:
            await svc.feedback(FeedbackRequest(completion_id=cid, rating=True), caller=caller)
        errors.append((info.value.message.replace(cid, "<id>"), info.value.param))
    assert errors[0] == errors[1] == errors[2], errors
    for caller in ("default", None):
        out, _ = await svc.feedback(
            FeedbackRequest(completion_id="chatcmpl-open", rating=caller is None), caller=caller
        )
        assert out.completion_id == "chatcmpl-open"
    assert await client.xlen(keys.signals) == 3


@pytest.mark.anyio
async def test_idempotency_key_replays_and_conflicts(env):
    app, client, keys, http = env
    await app.state.log.record(record("chatcmpl-3"))
    body = {"completion_id": "chatcmpl-3", "rating": True}
    h = {"Idempotency-Key": "retry-1"}
    a = await http.post("/v1/feedback", json=body, headers=h)
    b = await http.post("/v1/feedback", json=body, headers=h)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() and b.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in a.headers
    assert await client.xlen(keys.signals) == 1
    c = await http.post("/v1/feedback", json={**body, "rating": False}, headers=h)
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_key_reused"
    assert await client.xlen(keys.signals) == 1
    ttl = await client.ttl(keys.idem("feedback/-", "retry-1"))
    assert 0 < ttl <= 24 * 3600


@pytest.mark.anyio
async def test_preferences_by_id_and_inline(env):
    app, client, keys, http = env
    log = app.state.log
    await log.record(record("c-chosen", completion=(5, 6)))
    await log.record(record("c-rej", completion=(9,)))
    await log.record(record("c-other-prompt", prompt=(4, 4), completion=(9,)))
    r = await http.post("/v1/preferences", json={"chosen_completion_id": "c-chosen", "rejected_completion_id": "c-rej"})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "preference" and r.json()["endpoint"] == "default"
    bad = [
        ({"chosen_completion_id": "c-chosen", "rejected_completion_id": "c-other-prompt"}, 400),
        ({"chosen_completion_id": "c-chosen", "rejected_completion_id": "c-chosen"}, 400),
        ({"chosen_completion_id": "c-chosen"}, 400),
        ({"chosen_completion_id": "c-chosen", "rejected_completion_id": "c-gone"}, 404),
        ({"chosen_completion_id": "c-chosen", "rejected_completion_id": "c-rej", "chosen": "x"}, 400),
        ({}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "4"}, 400),
        ({"model": "nope", "messages": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}, 404),
    ]
    for body, status in bad:
        resp = await http.post("/v1/preferences", json=body)
        assert resp.status_code == status, (body, resp.text)
    r2 = await http.post(
        "/v1/preferences",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "2+2?"}],
            "chosen": "4",
            "rejected": "5",
            "user": "u",
        },
    )
    assert r2.status_code == 200
    events = [e for _, e in await stream(client, keys)]
    assert len(events) == 2
    assert events[0].prompt_token_ids == [1, 2, 3]
    assert events[0].chosen_token_ids == [5, 6] and events[0].rejected_token_ids == [9]
    assert events[1].chosen == "4" and events[1].rejected == "5" and events[1].messages[0].content == "2+2?"


@pytest.mark.anyio
async def test_demonstrations(env):
    _app, client, keys, http = env
    msgs = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    r = await http.post("/v1/demonstrations", json={"model": "default", "messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "demonstration"
    for body, status in [
        ({"model": "default", "messages": msgs[:2]}, 400),  # no final reply
        ({"model": "default", "messages": [msgs[0], msgs[2]]}, 400),  # no user turn
        ({"model": "default", "messages": msgs[2:]}, 400),  # too short
        ({"model": "default", "messages": [{"role": "tool", "content": "x"}, *msgs[1:]]}, 400),
        ({"model": "missing", "messages": msgs}, 404),
    ]:
        resp = await http.post("/v1/demonstrations", json=body)
        assert resp.status_code == status, (body, resp.text)
    events = [e for _, e in await stream(client, keys)]
    assert len(events) == 1 and [m.content for m in events[0].messages] == [m["content"] for m in msgs]


@pytest.mark.anyio
async def test_redis_down_is_503_with_retry_after_and_accepts_nothing():
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    app, client = make_app("redis://127.0.0.1:1/0", keys)  # nothing listens on port 1
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        for path, body in [
            ("/v1/feedback", {"completion_id": "c", "rating": True}),
            (
                "/v1/demonstrations",
                {
                    "model": "default",
                    "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                },
            ),
        ]:
            r = await http.post(path, json=body)
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "service_unavailable"
    await client.aclose()


@pytest.mark.anyio
async def test_group_exists_for_trainers(env):
    _, client, keys, _ = env
    groups = await client.xinfo_groups(keys.signals)
    assert [g["name"] for g in groups] == [TRAINERS_GROUP]
    json.dumps(groups)  # plain data
