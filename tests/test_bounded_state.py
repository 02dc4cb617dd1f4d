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
import livelora.clients.types.signals as signal_types
from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.clients.types.tinker_data import MAX_METADATA_BYTES, MAX_TAGS, MAX_TEXT_CHARS, StrictModel
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.redis_keys import KeyLayout
from livelora.core.settings import VERSION_BYTES, QuotaSection, machine_memory_bytes
from livelora.gateway.services.live.live_stats import LiveStats
from livelora.gateway.services.sessions.history import SessionHistory
from livelora.gateway.settings import LiveSection

MODEL = "smollm2-135m-instruct"
PREFIX = new_prefix("bounded")
SESSION_TTL_S = 3
HISTORY_TTL_S = 5
SEARCH_MAX_BYTES = 64 * 1024
KEYS = {
    "acme": ("acme", TENANT_ROLES),
    "beta": ("beta", TENANT_ROLES),
    "gamma": ("gamma", TENANT_ROLES),
    "op": ("default", ["admin", "operator"]),
}
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
DURABLE = ("store_id", "layout", "bus:epoch", "signals", "usage:hours", "usage:pending", "usage:2", "trainer:models")


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
def test_an_oversized_session_field_is_refused_naming_it_before_any_write(server, keys, server_redis, field):
    before = set(server_redis.scan_iter(f"{PREFIX}*", count=1000))
    got = create(server, keys, **{field: OVERSIZED[field]})
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error"
    limit = {"user_metadata": MAX_METADATA_BYTES, "tags": MAX_TAGS}.get(field, MAX_TEXT_CHARS)
    assert str(limit) in err["message"]
    assert set(server_redis.scan_iter(f"{PREFIX}*", count=1000)) - before == set()


#: each signal request model → its route and a valid body (the oversized cases are generated from the schema)
SIGNAL_ROUTES = {
    signal_types.FeedbackRequest: ("/v1/feedback", {"completion_id": "chatcmpl-x", "rating": True}),
    signal_types.PreferenceRequest: (
        "/v1/preferences",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"},
    ),
    signal_types.DemonstrationRequest: (
        "/v1/demonstrations",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ),
}


def _bounded(prop: dict, defs: dict) -> dict:
    """The string or array branch of a JSON-schema property (``anyOf`` with null unwrapped, ``$ref`` resolved)."""
    for branch in prop.get("anyOf", [prop]):
        if "$ref" in branch:
            return defs[branch["$ref"].rsplit("/", 1)[1]]
        if branch.get("type") in ("string", "array"):
            return branch
    return {}


def _oversized_cases() -> list[tuple[str, dict, str, int]]:
    """``(route, body, param, limit)``: for each string and array of each signal request (one level into array
    items), its valid body with that one value one past its limit."""
    cases = []
    for model, (route, body) in SIGNAL_ROUTES.items():
        schema = model.model_json_schema()
        defs = schema.get("$defs", {})
        for name, prop in schema["properties"].items():
            spec = _bounded(prop, defs)
            if spec.get("type") == "string" and "enum" not in spec and "const" not in spec:
                cases.append((route, {**body, name: "x" * (spec["maxLength"] + 1)}, name, spec["maxLength"]))
            elif spec.get("type") == "array":
                first = body[name][0]
                cases.append((route, {**body, name: [first] * (spec["maxItems"] + 1)}, name, spec["maxItems"]))
                item = _bounded(spec["items"], defs)
                for field, sub in item.get("properties", {}).items():
                    if sub.get("type") == "string" and "enum" not in sub:
                        long = [{**first, field: "x" * (sub["maxLength"] + 1)}, *body[name][1:]]
                        cases.append((route, {**body, name: long}, f"{name}[0].{field}", sub["maxLength"]))
    return cases


def test_every_signal_request_model_has_a_route_here():
    requests = {v for v in vars(signal_types).values() if isinstance(v, type) and v.__name__.endswith("Request")}
    assert requests == set(SIGNAL_ROUTES)


@pytest.mark.parametrize(
    ("route", "body", "param", "limit"), _oversized_cases(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_an_oversized_signal_text_is_refused_naming_it_before_any_write(
    server, keys, server_redis, route, body, param, limit
):
    before = set(server_redis.scan_iter(f"{PREFIX}*", count=1000))
    got = post(server, keys, route, body)
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and str(limit) in err["message"]
    assert set(server_redis.scan_iter(f"{PREFIX}*", count=1000)) - before == set()
    assert limit in {
        signal_types.MAX_SIGNAL_TEXT_CHARS,
        signal_types.MAX_SIGNAL_MESSAGES,
        signal_types.MAX_SIGNAL_NAME_CHARS,
        signal_types.MAX_COMMENT_CHARS,
    }


def test_the_default_session_limit_answers_429_naming_it(server, keys):
    assert QuotaSection().quota_sessions == 16  # the shipped default; this server runs with 3
    sids = [create(server, keys, tenant="beta").json()["session_id"] for _ in range(3)]
    over = create(server, keys, tenant="beta")
    assert over.status_code == 429, over.text
    err = over.json()["error"]
    assert err["param"] == "max_sessions" and "3 of its 3" in err["message"]
    for sid in sids:
        finish(server, keys, sid, "beta")


def test_a_session_leaves_nothing_in_redis_after_its_history_expires(server, keys, server_redis):
    finished = create(server, keys, user_metadata={"run": "a"}).json()["session_id"]
    abandoned = create(server, keys, user_metadata={"run": "b"}).json()["session_id"]
    finish(server, keys, finished)
    assert post(server, keys, "/api/v1/session_heartbeat", {"session_id": abandoned}).status_code == 200
    got = search(server, keys, {"user_metadata": {"run": "a"}}).json()["sessions"]
    assert [s["session_id"] for s in got] == [finished] and got[0]["status"]["type"] == "client_finished"
    assert keys_of(server_redis, finished) and keys_of(server_redis, abandoned)
    left = lambda: keys_of(server_redis, finished) + keys_of(server_redis, abandoned)  # noqa: E731
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


def test_every_key_a_session_wrote_has_a_ttl_or_is_durable(server, keys, server_redis, tokenizer):
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
    lasting = [k for k in server_redis.scan_iter(f"{PREFIX}*", count=1000) if server_redis.pttl(k) == -1]
    stray = [k for k in lasting if not k.removeprefix(PREFIX).startswith(DURABLE)]
    assert stray == [], f"keys without TTL that are not on the durable list: {stray}"


def test_the_legacy_history_hash_moves_into_expiring_keys(server_redis):
    keys = KeyLayout(f"{PREFIX}legacy:")
    summary = {"created": 1.5, "tenant": "acme", "user_metadata": {"a": "b"}, "status": None}
    server_redis.hset(keys.legacy_session_history, mapping={"s1": json.dumps(summary), "s2": "not json"})

    async def move():
        client = redis.asyncio.Redis(decode_responses=True)
        try:
            history = SessionHistory(client, keys, ttl_s=60)
            return await history.migrate_legacy(), await history.newest("acme")
        finally:
            await client.aclose()

    moved, newest = asyncio.run(move())
    assert moved == 1 and newest == [("s1", summary)] and not server_redis.exists(keys.legacy_session_history)
    assert (
        0 < server_redis.pttl(keys.session_summary("s1")) <= 60_000
        and 0 < server_redis.pttl(keys.session_index("acme")) <= 60_000
    )


def test_the_adapter_byte_limit_answers_429_before_a_save_writes(server, keys, home):
    from livelora.adapters.store import AdapterStore
    from livelora.clients.futures import APIFuture
    from livelora.core.session_protocol import CheckpointIndex

    def admin(method: str, body: dict | None = None, tenant: str = "op") -> dict:
        got = httpx.request(
            method,
            server.url("/admin/quotas"),
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {keys[tenant]}"},
        )
        assert got.status_code == 200, got.text
        return got.json()

    svc = ServiceClient(server.base_url, api_key=keys["gamma"], heartbeat_s=1.0)
    try:
        tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
        tc.save_state("a").result(timeout=120)
        lineage = CheckpointIndex(home, tc.model_id).lineage
        used = admin("GET", tenant="gamma")["adapter_bytes"]
        weights = 355_008 * 2 * 4  # SmolLM2-135M LoRA parameters per rank × rank 2 × float32
        assert weights <= used < 3 * weights + 1_000_000  # weights, the Adam moments once stepped, small files
        limit = used + 2 * weights  # room for weights alone, not for weights with the optimizer (3 × weights)
        assert admin("PUT", {"tenant": "gamma", "max_adapter_bytes": limit})["max_adapter_bytes"] == limit
        before = AdapterStore(home).version_numbers(lineage)

        def save(seq: int, kind: str, **body) -> httpx.Response:
            return post(
                server, keys, f"/api/v1/{kind}", {"model_id": tc.model_id, "seq_id": seq, "type": kind, **body}, "gamma"
            )

        over = save(2, "save_weights", path="b")
        assert over.status_code == 429, over.text
        err = over.json()["error"]
        assert err["param"] == "max_adapter_bytes" and err["code"] == "quota_exceeded"
        assert f"{limit / 1e6:.1f} MB" in err["message"] and f"{used / 1e6:.1f} MB" in err["message"]
        assert AdapterStore(home).version_numbers(lineage) == before  # nothing written
        assert "weights/b" not in CheckpointIndex(home, tc.model_id).read()["checkpoints"]
        fits = save(2, "save_weights_for_sampler", path="s")  # weights only: within the limit
        assert fits.status_code == 200, fits.text
        APIFuture.polling(svc.transport, fits.json()["request_id"], dict).result()
        assert used + weights <= admin("GET", tenant="gamma")["adapter_bytes"] <= limit
    finally:
        admin("PUT", {"tenant": "gamma", "unlimited": ["max_adapter_bytes"]})
        svc.close()


def test_the_live_loop_prunes_unused_versions_for_the_byte_limit_or_holds_back(base_ref, tmp_path):
    from harness.seeds import saved_versions

    from livelora.adapters.kept_versions import AdapterVersions
    from livelora.core.quotas import Limits

    saved_versions(base_ref, tmp_path, "live", seed=0, n=3)
    probe = AdapterVersions(tmp_path, Limits())
    size = probe.version_bytes("live", 3)
    assert size > 0 and probe.bytes_kept("default", also="live") == sum(
        probe.version_bytes("live", v) for v in (1, 2, 3)
    )
    # room for three versions of this size: writing a fourth deletes the oldest unused one (v1)
    room = AdapterVersions(tmp_path, Limits(max_adapter_bytes=3 * size + 100)).make_room("live")
    assert room.ok and room.pruned == ["live@1"] and probe.store.version_numbers("live") == [2, 3]
    # room for one: only v2 can go (v3, the newest, is what the loop trains from), and that is not enough
    tight = AdapterVersions(tmp_path, Limits(max_adapter_bytes=size + 100))
    held = tight.make_room("live")
    assert not held.ok and held.pruned == [] and "max_adapter_bytes" in held.reason
    assert probe.store.version_numbers("live") == [2, 3]  # nothing deleted when it cannot make enough room


def test_a_versions_rating_hashes_keep_their_newest_and_expire(server_redis):
    keys = KeyLayout(f"{PREFIX}stats:")
    live = LiveSection(stats_max_ratings=5, stats_ttl_s=600)

    async def rate():
        client = redis.asyncio.Redis(decode_responses=True)
        try:
            stats = LiveStats(client, keys, live)
            for i in range(7):  # 7 > 5 + a tenth (at least 1): trimmed back to the newest 5
                await stats.count_rating("ep", "ep@1", f"c{i}:u", i % 2 == 0)
                await asyncio.sleep(0.01)  # distinct rating times, so "newest" is one set
            return await stats.version("ep", "ep@1"), await stats.ratings_over_time("ep")
        finally:
            await client.aclose()

    row, over_time = asyncio.run(rate())
    ratings, rated_at = keys.version_ratings("ep", "ep@1"), keys.version_rated_at("ep", "ep@1")
    assert (
        sorted(server_redis.hkeys(ratings)) == sorted(server_redis.hkeys(rated_at)) == [f"c{i}:u" for i in range(2, 7)]
    )
    assert row["ratings"] == 5 and row["thumbs_up"] == 3  # c2, c4, c6
    assert [up for _, _, up in over_time] == [True, False, True, False, True]
    assert 0 < server_redis.ttl(ratings) <= 600 and 0 < server_redis.ttl(rated_at) <= 600
    assert LiveSection().stats_max_ratings == 10_000 and LiveSection().stats_ttl_s == 90 * 86400


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
