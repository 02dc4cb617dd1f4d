"""Usage metering through one live gateway (real SmolLM2, real Redis, in-process op executor) in key mode with two
tenants: metered counts equal the ``usage`` fields of chat and legacy completions (streamed or not) and the
tokens of every session op kind; the hourly rollup moves counters into the store without changing a total and
they survive the loss of Redis's counters; ``/admin/usage`` is scoped to the caller's tenant; ``livelora usage``."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from harness.bus import new_prefix
from harness.server import wait_until
from typer.testing import CliRunner

from livelora.clients import (
    Datum,
    ModelInput,
    SamplingParams,
    ServiceClient,
    TensorData,
)
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.metering import Meter, Usage, UsageStore
from livelora.core.redis_keys import KeyLayout

MODEL = "smollm2-135m-instruct"
PREFIX = new_prefix("meter")
CHAT = [{"role": "user", "content": "Name a color."}]
#: a session without heartbeats expires (and frees its quota slot) this long after its last one
SESSION_TTL_S = 6


#: the harness ``keys``: tenants acme and beta with every tenant role, an operator of tenant default
KEYS = {"acme": ("acme", TENANT_ROLES), "beta": ("beta", TENANT_ROLES), "default": ("default", ["admin", "operator"])}
#: the harness ``server``
SERVER_SETTINGS = {
    "redis_prefix": PREFIX,
    "max_batch_size": 4,
    "max_waiting": 8,
    "executor_in_process": True,
    "usage_rollup_s": 0,
    "session_ttl_s": SESSION_TTL_S,
}


def _key(keys, tenant: str) -> str:
    return keys[tenant]


def _key_id(keys, tenant: str) -> str:
    return keys.records[tenant].id


def usage(server, keys, tenant="acme", **params) -> list[dict]:
    got = httpx.get(
        server.url("/admin/usage"), params=params, timeout=30, headers={"Authorization": f"Bearer {_key(keys, tenant)}"}
    )
    assert got.status_code == 200, got.text
    return got.json()["data"]


def totals(server, keys, tenant="acme", **filters) -> dict[str, int]:
    """``{kind: tokens}`` for the filters (grouped by kind)."""
    return {row["kind"]: row["tokens"] for row in usage(server, keys, tenant, group_by="kind", **filters)}


def post(server, keys, path, body, tenant="acme") -> httpx.Response:
    return httpx.post(
        server.url(path), json=body, timeout=120, headers={"Authorization": f"Bearer {_key(keys, tenant)}"}
    )


def test_served_tokens_equal_usage_fields(server, keys):
    before = totals(server, keys, subject=MODEL)
    chat = post(
        server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 7, "n": 2, "seed": 1}
    )
    assert chat.status_code == 200, chat.text
    legacy = post(
        server,
        keys,
        "/v1/completions",
        {"model": MODEL, "prompt": ["Once upon", "The sea is"], "max_tokens": 5, "seed": 2},
    )
    assert legacy.status_code == 200, legacy.text
    with httpx.stream(
        "POST",
        server.url("/v1/chat/completions"),
        timeout=120,
        headers={"Authorization": f"Bearer {_key(keys, 'acme')}"},
        json={
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    streamed = json.loads(events[-2])["usage"]
    used = [chat.json()["usage"], legacy.json()["usage"], streamed]
    after = totals(server, keys, subject=MODEL)
    assert after.get("prompt", 0) - before.get("prompt", 0) == sum(u["prompt_tokens"] for u in used)
    assert after.get("completion", 0) - before.get("completion", 0) == sum(u["completion_tokens"] for u in used)
    assert sum(u["completion_tokens"] for u in used) > 0
    # per key: the rows carry the key id that made the requests, and beta saw nothing of it
    rows = usage(server, keys, group_by="tenant,key,subject,kind")
    assert {(row["tenant"], row["key"], row["subject"]) for row in rows if row["kind"] == "prompt"} >= {
        ("acme", _key_id(keys, "acme"), MODEL)
    }
    assert totals(server, keys, "beta", subject=MODEL) == {}


def test_tenant_admin_sees_only_its_tenant(server, keys):
    post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}, tenant="beta")
    beta = usage(server, keys, "beta", group_by="tenant")
    assert [row["tenant"] for row in beta] == ["beta"]
    assert {row["tenant"] for row in usage(server, keys, "acme", group_by="tenant")} == {"acme"}
    other = httpx.get(
        server.url("/admin/usage"),
        params={"tenant": "acme"},
        timeout=30,
        headers={"Authorization": f"Bearer {_key(keys, 'beta')}"},
    )
    assert other.status_code == 403 and other.json()["error"]["param"] == "tenant"
    bad = httpx.get(
        server.url("/admin/usage"),
        params={"group_by": "colour"},
        timeout=30,
        headers={"Authorization": f"Bearer {_key(keys, 'beta')}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"


def _datum(tokenizer, text: str) -> Datum:
    ids = tokenizer.encode(text)
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(ids[1:], "int64"),
            "weights": TensorData.from_list([1.0] * (len(ids) - 1), "float32"),
        },
    )


def test_session_ops_are_metered_per_session(server, keys, tokenizer):
    svc = ServiceClient(server.base_url, api_key=_key(keys, "acme"), heartbeat_s=2.0)
    try:
        tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
        sid = svc.session_id
        batch = [_datum(tokenizer, t) for t in ("The sky is blue.", "Grass is green and soft.")]
        n = sum(d.model_input.length for d in batch)
        tc.forward(batch[:1]).result(timeout=120)
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        tc.forward_backward(batch[1:], "cross_entropy").result(timeout=120)
        sc = tc.save_weights_and_get_sampling_client()
        prompt = ModelInput.from_ints(tokenizer.encode("Colors:"))
        sample = sc.sample(prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=4, seed=3)).result(
            timeout=120
        )
        lps = sc.compute_logprobs(prompt).result(timeout=120)
        assert len(lps) == prompt.length
        expected = {
            "forward": batch[0].model_input.length,
            "trained": n + batch[1].model_input.length,
            "sample_prompt": 2 * prompt.length,
            "sampled": sum(len(s.tokens) for s in sample.sequences) + 1,  # compute_logprobs samples 1
            "scored": prompt.length,
        }
        assert wait_until(lambda: totals(server, keys, subject=sid) == expected, timeout_s=30), (
            totals(server, keys, subject=sid),
            expected,
        )
        rows = usage(server, keys, subject=sid, group_by="key")
        assert rows == [{"key": _key_id(keys, "acme"), "tokens": sum(expected.values())}]
    finally:
        svc.close()


def test_rollup_keeps_totals_and_survives_redis_losing_counters(server, keys, server_redis, home):
    before = usage(server, keys, group_by="tenant,key,subject,kind")
    assert server.services.metering.store.rollup_sync(server_redis) >= 1  # what the gateway's rollup task runs
    assert not server_redis.exists(KeyLayout(PREFIX).usage_pending)
    assert usage(server, keys, group_by="tenant,key,subject,kind") == before
    files = list((home / "usage").rglob("*.json"))
    assert files
    # Redis restarted: its counters are gone; the store still has every rolled-up count
    for key in server_redis.scan_iter(f"{PREFIX}usage:*"):
        server_redis.delete(key)
    assert usage(server, keys, group_by="tenant,key,subject,kind") == before
    # new usage after the restart adds to the rolled-up counts
    post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1})
    after = totals(server, keys, subject=MODEL)
    was = {row["kind"]: row["tokens"] for row in before if row["subject"] == MODEL and row["kind"] == "prompt"}
    assert after["prompt"] > was["prompt"]


def test_rollup_is_exact_when_redis_dies_half_way(home, server_redis):
    """A rollup whose process died after renaming (or after writing the file) is finished by the next one,
    without losing or doubling a count; reads during it see every count once."""
    keys = KeyLayout(f"{PREFIX}half-{uuid.uuid4().hex[:6]}:")
    store = UsageStore(home / "half", keys)
    meter = Meter(keys, clock=lambda: 1_700_000_000.0)
    meter.record_sync(server_redis, Usage("t", "k", "ep", {"prompt": 5, "completion": 3}))
    meter.record_sync(server_redis, Usage("t", "k", "ep", {"prompt": 2}))
    want = [row.to_dict() for row in store.query_sync(server_redis)]
    assert want == [
        {"tenant": "t", "key": "k", "subject": "ep", "kind": "completion", "tokens": 3},
        {"tenant": "t", "key": "k", "subject": "ep", "kind": "prompt", "tokens": 7},
    ]
    # step 1 only (rename into pending), as if the process died right after
    from livelora.core.metering import _ROLL

    hour = "2023111422"
    server_redis.eval(
        _ROLL, 4, keys.usage_hour(hour), keys.usage_rolling(hour, "dead1"), keys.usage_hours, keys.usage_pending, hour
    )
    assert [row.to_dict() for row in store.query_sync(server_redis)] == want
    # step 2 too (the file written), not step 3
    note = server_redis.hget(keys.usage_pending, keys.usage_rolling(hour, "dead1"))
    stamp = int(note.split(" ")[1])
    from livelora.core.atomic import atomic_write_json

    atomic_write_json(
        store._file(hour, stamp, "dead1"),
        {"hour": hour, "stamp_ms": stamp, "counts": server_redis.hgetall(keys.usage_rolling(hour, "dead1"))},
    )
    assert [row.to_dict() for row in store.query_sync(server_redis)] == want
    meter.record_sync(server_redis, Usage("t", "k", "ep", {"prompt": 1}))
    assert store.rollup_sync(server_redis) == 1  # the dead rollup's file exists: only the new hash is written
    got = {row.dims["kind"]: row.tokens for row in store.query_sync(server_redis)}
    assert got == {"completion": 3, "prompt": 8}
    assert not server_redis.exists(keys.usage_pending) and not server_redis.exists(keys.usage_hours)
    assert {row.dims["kind"]: row.tokens for row in store.query_sync(None)} == got  # the store alone


def test_usage_cli_table_and_json(server, keys, home, monkeypatch):
    from livelora.cli.main import app

    runner = CliRunner()
    out = runner.invoke(
        app, ["usage", "--url", server.base_url, "--api-key", _key(keys, "acme"), "--json", "--group-by", "tenant,kind"]
    )
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["data"]
    assert rows == usage(server, keys, group_by="tenant,kind")
    table = runner.invoke(
        app, ["usage", "--url", server.base_url, "--api-key", _key(keys, "acme"), "--group-by", "kind"]
    )
    assert table.exit_code == 0, table.output
    assert "prompt" in table.output and str(rows[0]["tokens"]) in table.output
    # --home: the store's rolled-up counts plus Redis's live ones, every tenant, no server involved
    monkeypatch.setenv("LIVELORA_REDIS_PREFIX", PREFIX)
    local = runner.invoke(app, ["usage", "--home", str(home), "--json", "--group-by", "tenant,kind"])
    assert local.exit_code == 0, local.output
    everyone = json.loads(local.output)["data"]
    assert {r["tenant"] for r in everyone} >= {"acme", "beta"}
    assert [r for r in everyone if r["tenant"] == "acme"] == rows
    # an empty answer says which prefix it read, and when that prefix is not this store's, what to set
    none = runner.invoke(app, ["usage", "--home", str(home), "--tenant", "nosuch"])
    assert (
        none.exit_code == 0
        and f"no usage found in the store {home} and under Redis prefix {PREFIX!r}" in none.output
        and "belongs to" not in none.output
    ), none.output
    monkeypatch.setenv("LIVELORA_REDIS_PREFIX", f"{PREFIX}other:")
    wrong = runner.invoke(app, ["usage", "--home", str(home), "--tenant", "nosuch"])
    assert wrong.exit_code == 0 and f"Redis prefix {PREFIX + 'other:'!r}" in wrong.output, wrong.output
    assert "belongs to no store, not this one: set LIVELORA_REDIS_PREFIX" in wrong.output


# ---------------------------------------------------------------------------------------------- /metrics
def scrape(server, keys) -> dict[tuple[str, tuple], float]:
    """Every sample of ``GET /metrics`` (the operator's key), parsed by prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    got = httpx.get(server.url("/metrics"), timeout=30, headers={"Authorization": f"Bearer {_key(keys, 'default')}"})
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(got.text)
        for s in fam.samples
    }


def sample(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move_as_requests_are_served(server, keys):
    before = scrape(server, keys)
    chat = post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4})
    assert chat.status_code == 200
    denied = httpx.post(server.url("/v1/chat/completions"), json={}, timeout=30)  # no key: 401
    assert denied.status_code == 401
    after = scrape(server, keys)
    # /metrics names every tenant's endpoints: with keys it needs the operator role, a tenant's admin gets 403
    assert httpx.get(server.url("/metrics"), timeout=30).status_code == 401
    assert (
        httpx.get(
            server.url("/metrics"), timeout=30, headers={"Authorization": f"Bearer {_key(keys, 'acme')}"}
        ).status_code
        == 403
    )
    route = {"method": "POST", "route": "/v1/chat/completions"}
    assert (
        sample(after, "livelora_http_requests_total", **route, status="200")
        == sample(before, "livelora_http_requests_total", **route, status="200") + 1
    )
    assert (
        sample(after, "livelora_http_requests_total", method="POST", route="unmatched", status="401")
        == sample(before, "livelora_http_requests_total", method="POST", route="unmatched", status="401") + 1
    )
    assert (
        sample(after, "livelora_http_request_duration_seconds_count", **route, status="200")
        == sample(before, "livelora_http_request_duration_seconds_count", **route, status="200") + 1
    )
    usage_ = chat.json()["usage"]
    assert (
        sample(after, "livelora_generated_tokens_total", kind="chat")
        - sample(before, "livelora_generated_tokens_total", kind="chat")
        == usage_["completion_tokens"]
    )
    assert (
        sample(after, "livelora_prompt_tokens_total", kind="chat")
        - sample(before, "livelora_prompt_tokens_total", kind="chat")
        == usage_["prompt_tokens"]
    )
    assert (
        sample(after, "livelora_time_to_first_token_seconds_count", kind="chat")
        == sample(before, "livelora_time_to_first_token_seconds_count", kind="chat") + 1
    )
    assert (
        sample(after, "livelora_inter_token_latency_seconds_count", kind="chat")
        - sample(before, "livelora_inter_token_latency_seconds_count", kind="chat")
        == usage_["completion_tokens"] - 1
    )
    assert sample(after, "livelora_engine_batch_size_count") > sample(before, "livelora_engine_batch_size_count")
    assert sample(after, "livelora_admission_sequences") == 0  # every admitted sequence was released
    # session ops ran earlier in this module: their counters and queue times are there
    assert sample(after, "livelora_session_ops_total", kind="forward_backward", outcome="done") >= 2
    assert sample(after, "livelora_session_op_queue_seconds_count", kind="forward_backward") >= 2


def test_metrics_key_setting():
    from livelora.gateway.middleware.auth import PUBLIC, required_role

    assert required_role("GET", "/metrics") == PUBLIC
    assert required_role("GET", "/metrics", metrics_key=True) == "operator"
    assert required_role("GET", "/admin/usage") == "admin"


# ---------------------------------------------------------------------------------------------- quotas
def put_limits(server, keys, tenant: str, body: dict, as_tenant: str = "default") -> httpx.Response:
    return httpx.put(
        server.url("/admin/quotas"),
        json={"tenant": tenant, **body},
        timeout=30,
        headers={"Authorization": f"Bearer {_key(keys, as_tenant)}"},
    )


def quota_report(server, keys, tenant: str) -> dict:
    got = httpx.get(server.url("/admin/quotas"), timeout=30, headers={"Authorization": f"Bearer {_key(keys, tenant)}"})
    assert got.status_code == 200, got.text
    return got.json()


def create_session(server, keys, tenant="acme") -> httpx.Response:
    return post(server, keys, "/api/v1/create_session", {"tags": [], "sdk_version": "test"}, tenant=tenant)


def test_session_limit_answers_429_and_frees_on_finish_or_expiry(server, keys):
    assert put_limits(server, keys, "beta", {"max_sessions": 5}, as_tenant="beta").status_code == 403
    got = put_limits(server, keys, "acme", {"max_sessions": 1})
    assert got.status_code == 200 and got.json()["max_sessions"] == 1
    try:
        first = create_session(server, keys)
        assert first.status_code == 200, first.text
        sid = first.json()["session_id"]
        over = create_session(server, keys)
        assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
        err = over.json()["error"]
        assert err["param"] == "max_sessions" and err["code"] == "quota_exceeded" and "frees" in err["message"]
        assert quota_report(server, keys, "acme")["sessions"] == 1  # the refused one was not created
        # finishing frees the slot at once
        done = post(server, keys, "/api/v1/session_heartbeat", {"session_id": sid})
        assert done.status_code == 200
        fin = post(server, keys, f"/api/v1/sessions/{sid}/finish", {})
        assert fin.status_code == 200, fin.text
        second = create_session(server, keys)
        assert second.status_code == 200, second.text
        # no heartbeat: the session expires after SESSION_TTL_S and its slot frees (each try in between is a 429
        # that creates nothing)
        assert wait_until(lambda: create_session(server, keys).status_code == 200, timeout_s=60, interval_s=1.0)
        assert beta_can_still_create(server, keys)  # limits are per tenant
    finally:
        put_limits(server, keys, "acme", {"unlimited": ["max_sessions"]})


def beta_can_still_create(server, keys) -> bool:
    return create_session(server, keys, tenant="beta").status_code == 200


def test_daily_token_limit_answers_429_and_changes_nothing(server, keys, tokenizer):
    post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    today = quota_report(server, keys, "acme")["tokens_today"]
    assert today["completion"] > 0
    assert (
        put_limits(
            server,
            keys,
            "acme",
            {"tokens_per_day": {"completion": today["completion"], "forward": today.get("forward", 0)}},
        ).status_code
        == 200
    )
    try:
        before = totals(server, keys)
        over = post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert over.status_code == 429, over.text
        err = over.json()["error"]
        assert err["param"] == "tokens_per_day.completion" and "UTC" in err["message"]
        assert int(over.headers["Retry-After"]) <= 24 * 3600
        streamed = post(
            server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True}
        )
        assert streamed.status_code == 429
        # a session forward over the day's 'forward' limit: 429 before its seq is used
        svc = ServiceClient(server.base_url, api_key=_key(keys, "acme"), heartbeat_s=2.0)
        try:
            tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
            body = {
                "forward_input": {
                    "data": [_datum(tokenizer, "Hello there.").model_dump(mode="json")],
                    "loss_fn": "cross_entropy",
                },
                "model_id": tc.model_id,
                "seq_id": 1,
            }
            refused = post(server, keys, "/api/v1/forward", body)
            assert refused.status_code == 429 and refused.json()["error"]["param"] == "tokens_per_day.forward"
        finally:
            svc.close()
        assert totals(server, keys) == before  # nothing ran, nothing was counted
        # another tenant is not limited
        assert (
            post(
                server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1}, tenant="beta"
            ).status_code
            == 200
        )
    finally:
        put_limits(server, keys, "acme", {"tokens_per_day": {"completion": 10**12, "forward": 10**12}})
    assert (
        post(server, keys, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1}).status_code
        == 200
    )


# ---------------------------------------------------------------------------------------------- JSON logs
def test_json_log_lines_carry_request_completion_tenant_endpoint_version(server, keys):
    import io
    import logging

    from livelora.core.logs import ContextFilter, JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    logger = logging.getLogger("livelora")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    made = post(server, keys, "/admin/endpoints", {"name": "acme.bot", "lineage": "acme.lineage"})
    assert made.status_code == 201, made.text  # an endpoint of acme's own: its ratings train acme's lineage
    try:
        got = httpx.post(
            server.url("/v1/chat/completions"),
            timeout=120,
            headers={"Authorization": f"Bearer {_key(keys, 'acme')}", "X-Request-Id": "trace-123"},
            json={"model": "acme.bot", "messages": CHAT, "max_tokens": 2},
        )
        assert got.status_code == 200 and got.headers["x-request-id"] == "trace-123"
        cid = got.json()["id"]
        rated = post(server, keys, "/v1/feedback", {"completion_id": cid, "rating": True})
        anon = httpx.get(server.url("/health"), timeout=30)
        assert anon.headers["x-request-id"].startswith("req-")  # a new id when the client sent none
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    served = [x for x in lines if x["message"].startswith("served chat")]
    assert served, lines
    assert {k: served[0].get(k) for k in ("request_id", "completion_id", "tenant", "endpoint", "version")} == {
        "request_id": "trace-123",
        "completion_id": cid,
        "tenant": "acme",
        "endpoint": "acme.bot",
        "version": "base",
    }
    assert {"time", "level", "logger"} <= set(served[0])
    assert rated.status_code == 200, rated.text  # the rating's line names the completion it rates
    [accepted] = [x for x in lines if x["message"].startswith("accepted rating")]
    assert (accepted["completion_id"], accepted["tenant"], accepted["endpoint"]) == (cid, "acme", "acme.bot")
    assert accepted["event_id"].startswith("feedback-") and accepted["request_id"] != "trace-123"


def test_adapter_version_limit_answers_429_writes_nothing_and_frees_on_delete(server, keys, home):
    from livelora.adapters.store import AdapterStore
    from livelora.clients.errors import LiveloraError
    from livelora.clients.futures import APIFuture
    from livelora.core.session_protocol import CheckpointIndex

    bad = put_limits(server, keys, "acme", {"unlimited": ["max_versions"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "unlimited"
    svc = ServiceClient(server.base_url, api_key=_key(keys, "acme"), heartbeat_s=2.0)
    try:
        tc = svc.create_lora_training_client(MODEL, rank=2, seed=0)
        tc.save_state("a").result()
        lineage = CheckpointIndex(home, tc.model_id).lineage

        def lineage_versions() -> list[int]:
            return AdapterStore(home).version_numbers(lineage)

        kept, before = quota_report(server, keys, "acme")["adapter_versions"], lineage_versions()
        assert kept >= 1 and len(before) == 1
        got = put_limits(server, keys, "acme", {"max_adapter_versions": kept})
        assert got.status_code == 200 and got.json()["max_adapter_versions"] == kept
        assert put_limits(server, keys, "beta", {"max_adapter_versions": 0}, as_tenant="beta").status_code == 403

        def save(seq: int, **body) -> httpx.Response:
            return post(server, keys, "/api/v1/save_weights", {"model_id": tc.model_id, "seq_id": seq, **body})

        over = save(2, path="b", type="save_weights")
        assert over.status_code == 429, over.text
        err = over.json()["error"]
        assert err["param"] == "max_adapter_versions" and err["code"] == "quota_exceeded"
        assert f"keeps {kept} adapter versions" in err["message"] and f"is {kept}" in err["message"]
        assert "DELETE /api/v1/training_runs" in err["message"]
        assert int(over.headers["Retry-After"]) >= 1
        assert (
            over.status_code
            == post(
                server,
                keys,
                "/api/v1/save_weights_for_sampler",
                {"model_id": tc.model_id, "seq_id": 2, "path": "s", "type": "save_weights_for_sampler"},
            ).status_code
        )
        # nothing was written or queued: same versions, no checkpoint 'b', and seq 2 is still free
        assert lineage_versions() == before
        assert "weights/b" not in CheckpointIndex(home, tc.model_id).read()["checkpoints"]
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept
        # overwriting 'a' keeps the count: allowed at the limit (seq 2 was not used by the refusals)
        res = save(2, path="a", overwrite=True, type="save_weights")
        assert res.status_code == 200, res.text
        APIFuture.polling(svc.transport, res.json()["request_id"], dict).result()
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept
        # ephemeral sampler weights (a sampling client's snapshot) do not count: allowed at the limit
        snap = post(
            server,
            keys,
            "/api/v1/save_weights_for_sampler",
            {"model_id": tc.model_id, "seq_id": 3, "sampling_session_seq_id": 900, "type": "save_weights_for_sampler"},
        )
        assert snap.status_code == 200, snap.text
        assert APIFuture.polling(svc.transport, snap.json()["request_id"], dict).result()["sampling_session_id"]
        assert len(lineage_versions()) == 2 and quota_report(server, keys, "acme")["adapter_versions"] == kept
        # deleting a checkpoint frees room: the refused save now goes through
        gone = httpx.delete(
            server.url(f"/api/v1/training_runs/{tc.model_id}/checkpoints/weights/a"),
            timeout=30,
            headers={"Authorization": f"Bearer {_key(keys, 'acme')}"},
        )
        assert gone.status_code in (200, 204), gone.text
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept - 1
        res = save(4, path="b", type="save_weights")
        assert res.status_code == 200, res.text
        APIFuture.polling(svc.transport, res.json()["request_id"], dict).result()
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept
        # lifted: saves past the old limit go through again
        got = put_limits(server, keys, "acme", {"unlimited": ["max_adapter_versions"]})
        assert got.status_code == 200 and got.json()["max_adapter_versions"] is None
        res = save(5, path="c", type="save_weights")
        assert res.status_code == 200, res.text
        APIFuture.polling(svc.transport, res.json()["request_id"], dict).result()
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept + 1
        # two saves queued with room for one: both pass the gateway's check (seq 7 is sent first and waits for
        # seq 6, so neither has run), and the executor's check before writing refuses the second
        assert put_limits(server, keys, "acme", {"max_adapter_versions": kept + 2}).status_code == 200
        later = save(7, path="e", type="save_weights")
        first = save(6, path="d", type="save_weights")
        assert later.status_code == first.status_code == 200, (later.text, first.text)
        APIFuture.polling(svc.transport, first.json()["request_id"], dict).result()
        with pytest.raises(LiveloraError) as refused:
            APIFuture.polling(svc.transport, later.json()["request_id"], dict).result()
        assert refused.value.code == "quota_exceeded" and "max_adapter_versions" in refused.value.message
        assert "weights/e" not in CheckpointIndex(home, tc.model_id).read()["checkpoints"]
        assert quota_report(server, keys, "acme")["adapter_versions"] == kept + 2
    finally:
        put_limits(server, keys, "acme", {"unlimited": ["max_adapter_versions"]})
        svc.close()
