"""Bounded shared state through one live gateway (real Redis, key mode, two tenants, small limits): oversized
request fields are refused before any write, with the field and the limit named; the default session limit;
session summaries expire with nothing of the session left in Redis; sessions/search pages stay under their byte
bound and a cursor walk finds each session once; every key the gateway wrote has a TTL or is a documented
durable key. The walk over every Tinker request model's strings and metadata is a unit test."""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import shutil
import time

import httpx
import pytest
import redis
import redis.asyncio
from harness.bus import new_prefix
from harness.server import wait_until
from pydantic import ValidationError

import livelora.clients.types as client_types
from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.clients.types.tinker_data import MAX_METADATA_BYTES, MAX_TAGS, MAX_TEXT_CHARS, StrictModel
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import VERSION_BYTES, QuotaSection, machine_memory_bytes
from livelora.gateway.services.sessions.history import SessionHistory

MODEL = "smollm2-135m-instruct"
PREFIX = new_prefix("bounded")
SESSION_TTL_S = 3
HISTORY_TTL_S = 5
SEARCH_MAX_BYTES = 64 * 1024
KEYS = {"acme": ("acme", TENANT_ROLES), "beta": ("beta", TENANT_ROLES)}
SERVER_SETTINGS = {
    "redis_prefix": PREFIX,
    "max_batch_size": 2,
    "max_waiting": 4,
    "executor_in_process": True,
    "session_ttl_s": SESSION_TTL_S,
    "session_history_ttl_s": HISTORY_TTL_S,
    "session_search_max_bytes": SEARCH_MAX_BYTES,
    "quota_sessions": 3,
}
#: keys without a TTL that the gateway keeps on purpose (docs/internals/redis-keys.md, "Durable keys")
DURABLE = ("store_id", "signals", "usage:hours", "usage:pending", "usage:2", "trainer:models")


@pytest.fixture(scope="module")
def r():
    client = redis.Redis(decode_responses=True)
    yield client
    for key in client.scan_iter(f"{PREFIX}*", count=1000):
        client.delete(key)
    client.close()


def post(server, keys, path: str, body: dict, tenant: str = "acme") -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60, headers={"Authorization": f"Bearer {keys[tenant]}"})


def create(server, keys, tenant: str = "acme", **fields) -> httpx.Response:
    return post(server, keys, "/api/v1/create_session", {"tags": [], "sdk_version": "test", **fields}, tenant)


def finish(server, keys, sid: str, tenant: str = "acme") -> None:
    assert post(server, keys, f"/api/v1/sessions/{sid}/finish", {}, tenant).status_code == 200


def search(server, keys, body: dict, tenant: str = "acme") -> httpx.Response:
    return post(server, keys, "/api/v1/sessions/search", body, tenant)


def keys_of(r, sid: str) -> list[str]:
    """Every key under the prefix that names ``sid`` or holds it (sets, sorted sets, hashes, strings)."""
    found = []
    for key in r.scan_iter(f"{PREFIX}*", count=1000):
        kind = r.type(key)
        held = (
            (kind == "string" and sid in (r.get(key) or ""))
            or (kind == "zset" and r.zscore(key, sid) is not None)
            or (kind == "set" and r.sismember(key, sid))
            or (kind == "hash" and r.hexists(key, sid))
        )
        if sid in key or held:
            found.append(key)
    return found


OVERSIZED = {
    "user_metadata": {f"k{i}": "v" * 1000 for i in range(20)},  # 20 kB of JSON
    "display_name": "n" * (MAX_TEXT_CHARS + 1),
    "project_id": "p" * (MAX_TEXT_CHARS + 1),
    "sdk_version": "s" * (MAX_TEXT_CHARS + 1),
    "tags": ["t"] * (MAX_TAGS + 1),
}


@pytest.mark.parametrize("field", sorted(OVERSIZED))
def test_an_oversized_session_field_is_refused_naming_it_before_any_write(server, keys, r, field):
    before = set(r.scan_iter(f"{PREFIX}*", count=1000))
    got = create(server, keys, **{field: OVERSIZED[field]})
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error"
    limit = {"user_metadata": MAX_METADATA_BYTES, "tags": MAX_TAGS}.get(field, MAX_TEXT_CHARS)
    assert str(limit) in err["message"]
    assert set(r.scan_iter(f"{PREFIX}*", count=1000)) - before == set()


def test_the_default_session_limit_answers_429_naming_it(server, keys):
    assert QuotaSection().quota_sessions == 16  # the shipped default; this server runs with 3
    sids = [create(server, keys, tenant="beta").json()["session_id"] for _ in range(3)]
    over = create(server, keys, tenant="beta")
    assert over.status_code == 429, over.text
    err = over.json()["error"]
    assert err["param"] == "max_sessions" and "3 of its 3" in err["message"]
    for sid in sids:
        finish(server, keys, sid, "beta")


def test_a_session_leaves_nothing_in_redis_after_its_history_expires(server, keys, r):
    finished = create(server, keys, user_metadata={"run": "a"}).json()["session_id"]
    abandoned = create(server, keys, user_metadata={"run": "b"}).json()["session_id"]
    finish(server, keys, finished)
    assert post(server, keys, "/api/v1/session_heartbeat", {"session_id": abandoned}).status_code == 200
    got = search(server, keys, {"user_metadata": {"run": "a"}}).json()["sessions"]
    assert [s["session_id"] for s in got] == [finished] and got[0]["status"]["type"] == "client_finished"
    assert keys_of(r, finished) and keys_of(r, abandoned)
    left = lambda: keys_of(r, finished) + keys_of(r, abandoned)  # noqa: E731
    assert wait_until(lambda: not left(), timeout_s=60, interval_s=1), left()
    assert search(server, keys, {"user_metadata": {"run": "a"}}).json()["sessions"] == []
    gone = httpx.get(server.url(f"/api/v1/sessions/{finished}"), headers={"Authorization": f"Bearer {keys['acme']}"})
    assert gone.status_code == 404


def test_search_pages_stay_under_the_byte_bound_and_a_cursor_walk_finds_each_session_once(server, keys):
    meta = {f"k{i}": "m" * 1000 for i in range(15)}  # ~15 kB each: under the 16 KiB bound
    made = set()
    for _ in range(8):
        sid = create(server, keys, user_metadata={**meta, "batch": "big"}).json()["session_id"]
        finish(server, keys, sid)
        made.add(sid)
    seen, cursor, pages = [], None, 0
    while True:
        got = search(server, keys, {"user_metadata": {"batch": "big"}, "limit": 200, "cursor": cursor})
        assert got.status_code == 200, got.text
        assert len(got.content) <= SEARCH_MAX_BYTES + 1024  # the sessions' JSON plus the envelope
        body, pages = got.json(), pages + 1
        seen += [s["session_id"] for s in body["sessions"]]
        if (cursor := body.get("next_cursor")) is None:
            break
    assert pages >= 2 and sorted(seen) == sorted(made) and len(seen) == len(set(seen))


def test_every_key_a_session_wrote_has_a_ttl_or_is_durable(server, keys, r, tokenizer):
    svc = ServiceClient(server.base_url, api_key=keys["acme"], heartbeat_s=1.0)
    try:
        tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
        ids = tokenizer.encode("The sky is blue.")
        datum = Datum(
            model_input=ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_list(ids[1:], "int64"),
                "weights": TensorData.from_list([1.0] * (len(ids) - 1), "float32"),
            },
        )
        tc.forward_backward([datum], "cross_entropy").result(timeout=120)
        tc.optim_step(AdamParams(learning_rate=1e-4)).result(timeout=120)
        sampler = tc.save_weights_and_get_sampling_client()
        sampler.sample(ModelInput.from_ints(ids[:3]), 1, SamplingParams(max_tokens=2)).result(timeout=120)
        search(server, keys, {})
    finally:
        svc.close()
    time.sleep(SESSION_TTL_S + 1)  # the session's own keys expire; the executor frees its model
    lasting = [k for k in r.scan_iter(f"{PREFIX}*", count=1000) if r.pttl(k) == -1]
    stray = [k for k in lasting if not k.removeprefix(PREFIX).startswith(DURABLE)]
    assert stray == [], f"keys without TTL that are not on the durable list: {stray}"


def test_the_legacy_history_hash_moves_into_expiring_keys(r):
    keys = KeyLayout(f"{PREFIX}legacy:")
    summary = {"created": 1.5, "tenant": "acme", "user_metadata": {"a": "b"}, "status": None}
    r.hset(keys.legacy_session_history, mapping={"s1": json.dumps(summary), "s2": "not json"})

    async def move():
        client = redis.asyncio.Redis(decode_responses=True)
        try:
            history = SessionHistory(client, keys, ttl_s=60)
            return await history.migrate_legacy(), await history.newest("acme")
        finally:
            await client.aclose()

    moved, newest = asyncio.run(move())
    assert moved == 1 and newest == [("s1", summary)] and not r.exists(keys.legacy_session_history)
    assert 0 < r.pttl(keys.session_summary("s1")) <= 60_000 and 0 < r.pttl(keys.session_index("acme")) <= 60_000


def test_machine_derived_defaults(livelora_home, monkeypatch):
    monkeypatch.setenv("LIVELORA_HOME", str(livelora_home))
    before = shutil.disk_usage(livelora_home).free
    quotas = QuotaSection()
    after = shutil.disk_usage(livelora_home).free
    assert quotas.quota_max_trainer_bytes == min(16 * 1024**3, machine_memory_bytes() // 4)
    assert quotas.quota_max_adapter_versions in {max(64, f // 10 // VERSION_BYTES) for f in (before, after)}


# ------------------------------------------------------------------ unit: every request model's bounds
def _request_models() -> list[type[StrictModel]]:
    found: dict[str, type[StrictModel]] = {}
    for info in pkgutil.iter_modules(client_types.__path__):
        module = importlib.import_module(f"{client_types.__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, StrictModel) and obj is not StrictModel:
                found[obj.__qualname__] = obj
    return [found[k] for k in sorted(found)]


def _fields(kind: str) -> list[tuple[type, str]]:
    out = []
    for model in _request_models():
        for name, info in model.model_fields.items():
            text = str(info.annotation)
            if kind == "metadata" and name == "user_metadata":
                out.append((model, name))
            elif kind == "str" and "str" in text and name != "user_metadata" and "Literal" not in text:
                out.append((model, name))
    return out


def _errors_at(model: type, field: str, value) -> list[dict]:
    try:
        model.model_validate({field: value})
    except ValidationError as exc:
        return [e for e in exc.errors() if e["loc"] and e["loc"][0] == field]
    return []


@pytest.mark.unit
@pytest.mark.parametrize(("model", "field"), _fields("str"), ids=lambda v: getattr(v, "__name__", v))
def test_every_request_string_field_is_bounded(model, field):
    long = "x" * (MAX_TEXT_CHARS + 1)
    values = [long, [long], {"k": long}, {long: {}}, [{long: 1}]]  # itself, in a list, a dict value or key
    assert any(any(e["type"] == "string_too_long" for e in _errors_at(model, field, v)) for v in values), (
        f"{model.__name__}.{field} takes a string longer than {MAX_TEXT_CHARS}"
    )


@pytest.mark.unit
@pytest.mark.parametrize(("model", "field"), _fields("metadata"), ids=lambda v: getattr(v, "__name__", v))
def test_every_request_user_metadata_is_bounded(model, field):
    errors = _errors_at(model, field, {f"k{i}": "v" * 1000 for i in range(20)})
    assert errors and str(MAX_METADATA_BYTES) in errors[0]["msg"]
