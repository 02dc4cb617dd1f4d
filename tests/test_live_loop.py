"""The live loop end to end on a live gateway, real Redis and the real SmolLM2 model:
chat completion → completion log → feedback → trainer worker (KTO) → new version → notice → the gateway
serves the new version, and a request leased before the swap still reports the old one."""

from __future__ import annotations

import json
import uuid

import httpx
from _server import start_server, wait_until

from livelora.adapters.bus import connect_sync
from livelora.adapters.redis_keys import KeyLayout
from livelora.gateway.services.serving import VERSION_HEADER
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.worker import TrainerWorker

EP = "live-e2e"


def chat(server, content: str, **kw) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), timeout=120, json={
        "model": EP, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw})


def test_feedback_trains_a_version_the_gateway_then_serves(base_ref, tmp_path):
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    settings = GatewaySettings(model=str(base_ref.path), served_model_name=EP, home=tmp_path,
                               redis_prefix=keys.prefix, max_batch_size=4, device="cpu")
    server = start_server(settings)
    redis = connect_sync("redis://127.0.0.1:6379/0")
    try:
        first = chat(server, "What is 2+2?", user="alice")
        assert first.status_code == 200, first.text
        assert first.headers[VERSION_HEADER] == "base"
        assert first.json()["choices"][0].get("logprobs") is None          # recorded, not returned unasked
        second = chat(server, "Name a colour.", stream=True)
        assert second.status_code == 200
        cid1 = first.json()["id"]
        cid2 = json.loads(second.text.split("\n\n")[0][len("data: "):])["id"]
        # the completion log holds the exact served tokens and their logprobs
        rec = json.loads(redis.get(keys.completion(cid1)))
        assert rec["endpoint"] == EP and rec["adapter"] is None and rec["user"] == "alice"
        assert len(rec["completion_token_ids"]) == len(rec["logprobs"]) == first.json()["usage"]["completion_tokens"]
        assert len(rec["prompt_token_ids"]) == first.json()["usage"]["prompt_tokens"]
        assert rec["completion"] == first.json()["choices"][0]["message"]["content"]
        assert 0 < redis.ttl(keys.completion(cid1)) <= 7 * 24 * 3600
        assert redis.exists(keys.completion(cid2))
        # feedback
        up = httpx.post(server.url("/v1/feedback"), json={"completion_id": cid1, "rating": True})
        down = httpx.post(server.url("/v1/feedback"), json={"completion_id": cid2, "rating": False})
        assert up.status_code == down.status_code == 200 and up.json()["endpoint"] == EP
        gone = httpx.post(server.url("/v1/feedback"), json={"completion_id": "chatcmpl-unknown", "rating": True})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "completion_id"
        # a request admitted now holds the base version through the swap
        registry = server.services.registry
        held = registry.acquire(EP)
        assert held.adapter is None
        # the trainer consumes the two ratings: one KTO step, version live-e2e@1, notice
        worker = TrainerWorker(redis, keys, tmp_path, OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3)),
                               BatchScheduler(TrainingSection(kto_min_batch=2)), consumer="e2e", block_ms=200)
        [notice] = worker.poll()
        assert notice.name == f"{EP}@1" and notice.endpoint == EP
        assert wait_until(lambda: registry.current.get(EP) == f"{EP}@1", timeout_s=300)
        after = chat(server, "What is 2+2?")
        assert after.headers[VERSION_HEADER] == f"{EP}@1"
        assert after.json()["system_fingerprint"] == f"livelora-{EP}@1"
        assert json.loads(redis.get(keys.completion(after.json()["id"])))["adapter"] == f"{EP}@1"
        assert held.version == "base"
        held.release()
    finally:
        server.stop()
        for k in redis.scan_iter(match=keys.prefix + "*"):
            redis.delete(k)
        redis.close()
