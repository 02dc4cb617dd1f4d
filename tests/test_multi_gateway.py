"""Two gateways on one Redis and one store (``LIVELORA_HOME``), as in "Scaling out": each its own app and its own
TransformersEngine on the real SmolLM2 model, both in this process, behind no load balancer.

* a completion served by gateway A is rated through gateway B, and the signals stream holds A's exact tokens;
* signals posted to either gateway are read once by the ``trainers`` consumer group (two consumers, no duplicate);
* one ``version_published`` notice for a version written to the shared store moves BOTH gateways, with no restart
  (the periodic store resync is off, so only the notice can move them).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch
from harness.server import LiveServer, start_server, wait_until

from livelora.adapters.store import AdapterStore
from livelora.clients.types.signals import RatingEvent, VersionNotice, parse_stream_event
from livelora.clients.types.tinker import LoraConfig
from livelora.core.bus import connect_sync, publish_notice
from livelora.core.redis_keys import TRAINERS_GROUP, KeyLayout
from livelora.gateway.services.serving.serve import VERSION_HEADER
from livelora.gateway.settings import GatewaySettings

EP = "multi-gw"  # served base name = endpoint = lineage of both gateways


@pytest.fixture(scope="module")
def cluster(base_ref, tmp_path_factory) -> Iterator[tuple[LiveServer, LiveServer, KeyLayout, object]]:
    """Gateways A and B on one fresh store and one Redis key prefix (under the session's, so conftest's clean-up
    also covers it); yields ``(a, b, keys, sync_redis)`` and stops both gateways (closing their engines)."""
    home = tmp_path_factory.mktemp("multi-gateway-home")
    keys = KeyLayout(f"{os.environ['LIVELORA_REDIS_PREFIX']}multi-{uuid.uuid4().hex[:8]}:")
    settings = GatewaySettings(
        model=str(base_ref.path),
        served_model_name=EP,
        home=home,
        redis_prefix=keys.prefix,
        max_batch_size=2,
        device="cpu",
        resync_s=0,
    )  # endpoints read once at start-up: no catch-up loop, notices only
    servers: list[LiveServer] = []
    redis = connect_sync("redis://127.0.0.1:6379/0")
    try:
        for _ in range(2):
            servers.append(start_server(settings))  # each app builds, starts and closes its own engine
        a, b = servers
        assert a.engine is not b.engine and a.services.registry is not b.services.registry
        assert a.services.registry.resync_s == b.services.registry.resync_s == 0
        yield a, b, keys, redis
    finally:
        for server in servers:
            server.stop()
        for key in redis.scan_iter(match=keys.prefix + "*"):
            redis.delete(key)
        redis.close()


def chat(server: LiveServer, content: str, **kw) -> httpx.Response:
    response = httpx.post(
        server.url("/v1/chat/completions"),
        timeout=120,
        json={"model": EP, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw},
    )
    assert response.status_code == 200, response.text
    return response


def stream_event(redis, keys: KeyLayout, event_id: str) -> RatingEvent:
    """The signals-stream entry whose event has id ``event_id`` (exactly one must exist)."""
    found = [
        parse_stream_event(fields)
        for _, fields in redis.xrange(keys.signals)
        if json.loads(fields["event"])["id"] == event_id
    ]
    assert len(found) == 1, f"{len(found)} stream entries for {event_id}"
    return found[0]


def test_completion_from_a_is_rated_through_b_and_read_once_by_trainers(cluster, tokenizer):
    a, b, keys, redis = cluster
    served = chat(a, "What is 2+2?", user="alice")
    body = served.json()
    assert served.headers[VERSION_HEADER] == "base" and body["system_fingerprint"] == "livelora-base"
    record = json.loads(redis.get(keys.completion(body["id"])))  # A's completion log entry, in shared Redis
    assert len(record["completion_token_ids"]) == body["usage"]["completion_tokens"] > 0
    assert len(record["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert tokenizer.decode(record["completion_token_ids"]) == body["choices"][0]["message"]["content"]

    rated = httpx.post(b.url("/v1/feedback"), json={"completion_id": body["id"], "rating": True, "user": "bob"})
    assert rated.status_code == 200, rated.text
    assert rated.json()["endpoint"] == EP and rated.json()["completion_id"] == body["id"]
    event = stream_event(redis, keys, rated.json()["id"])
    assert isinstance(event, RatingEvent) and event.completion_id == body["id"] and event.rating is True
    assert event.prompt_token_ids == record["prompt_token_ids"]  # the exact tokens A saw and produced
    assert event.completion_token_ids == record["completion_token_ids"]
    assert event.logprobs == record["logprobs"] and len(event.logprobs) == len(event.completion_token_ids)
    assert (event.endpoint, event.adapter, event.user) == (EP, None, "bob")

    # the other way round: B serves, A takes the (thumbs-down) rating
    other = chat(b, "Name a colour.").json()
    down = httpx.post(a.url("/v1/feedback"), json={"completion_id": other["id"], "rating": False})
    assert down.status_code == 200, down.text
    assert (
        stream_event(redis, keys, down.json()["id"]).completion_token_ids
        == json.loads(redis.get(keys.completion(other["id"])))["completion_token_ids"]
    )

    # one `trainers` group (both gateways created it; the second found it BUSY): two consumers split the entries,
    # each signal is delivered exactly once
    assert [g["name"] for g in redis.xinfo_groups(keys.signals)] == [TRAINERS_GROUP]
    seen: list[str] = []
    for consumer, count in (("trainer-1", 1), ("trainer-2", 10), ("trainer-1", 10), ("trainer-2", 10)):
        res = redis.xreadgroup(TRAINERS_GROUP, consumer, {keys.signals: ">"}, count=count)
        entries = res[0][1] if res else []
        seen += [json.loads(fields["event"])["id"] for _, fields in entries]
        if entries:
            redis.xack(keys.signals, TRAINERS_GROUP, *[sid for sid, _ in entries])
    assert sorted(seen) == sorted([rated.json()["id"], down.json()["id"]])
    pending = redis.xpending(keys.signals, TRAINERS_GROUP)
    assert pending["pending"] == 0


def test_one_notice_moves_both_gateways(cluster, base_ref):
    from livelora.trainer.model import TrainingModel

    a, b, keys, redis = cluster
    for server in (a, b):
        assert chat(server, "Hi").headers[VERSION_HEADER] == "base"
    # both gateways listen on the notices channel before anything is announced
    assert wait_until(lambda: redis.pubsub_numsub(keys.notices)[0][1] == 2, timeout_s=30)

    store = AdapterStore(a.services.settings.home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tm.lora_params.items():
            if "lora_B" in name:  # nonzero delta: not the base model
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    manifest = tm.save_weights(store, EP)
    del tm
    assert manifest.name == f"{EP}@1"
    notice = VersionNotice(
        lineage=EP,
        version=manifest.version,
        name=manifest.name,
        sha256=manifest.sha256,
        path=str(store.version_dir(EP, manifest.version)),
        endpoint=EP,
        kind="test",
    )
    assert publish_notice(redis, keys, notice.model_dump(mode="json")) == 2  # announced once, both reached

    for server in (a, b):
        registry = server.services.registry
        assert wait_until(lambda registry=registry: registry.current.get(EP) == manifest.name, timeout_s=30), (
            f"{server.base_url} still serves {registry.current.get(EP)}"
        )
    for server in (a, b):  # same processes: no restart
        after = chat(server, "Hi")
        assert after.headers[VERSION_HEADER] == manifest.name
        assert after.json()["system_fingerprint"] == f"livelora-{manifest.name}"
        assert json.loads(redis.get(keys.completion(after.json()["id"])))["adapter"] == manifest.name
        assert manifest.name in server.engine.loaded_adapters()
