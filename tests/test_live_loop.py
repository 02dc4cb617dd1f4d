"""The live loop end to end on a live gateway, real Redis and the real SmolLM2 model:
chat completion → completion log → feedback → trainer worker (KTO) → new version → notice → the gateway
serves the new version, and a request leased before the swap still reports the old one."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from harness.server import start_server, wait_until

from livelora.adapters.store import AdapterStore
from livelora.core.bus import connect_sync
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.services.serving.serve import VERSION_HEADER
from livelora.gateway.settings import GatewaySettings
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.signal_governor import FeedbackGovernor
from livelora.trainer.worker import TrainerWorker

EP = "live-e2e"


def chat(server, content: str, **kw) -> httpx.Response:
    return httpx.post(
        server.url("/v1/chat/completions"),
        timeout=120,
        json={"model": EP, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **kw},
    )


def test_feedback_trains_a_version_the_gateway_then_serves(base_ref, tmp_path):
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    settings = GatewaySettings(
        model=str(base_ref.path),
        served_model_name=EP,
        home=tmp_path,
        redis_prefix=keys.prefix,
        max_batch_size=4,
        device="cpu",
    )
    server = start_server(settings)
    redis = connect_sync("redis://127.0.0.1:6379/0")
    try:
        first = chat(server, "What is 2+2?", user="alice")
        assert first.status_code == 200, first.text
        assert first.headers[VERSION_HEADER] == "base"
        assert first.json()["choices"][0].get("logprobs") is None  # recorded, not returned unasked
        second = chat(server, "Name a colour.", stream=True)
        assert second.status_code == 200
        cid1 = first.json()["id"]
        cid2 = json.loads(second.text.split("\n\n")[0][len("data: ") :])["id"]
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
        for user, rating in (("bob", True), ("mallory", False)):  # two more raters of the first completion
            r = httpx.post(server.url("/v1/feedback"), json={"completion_id": cid1, "rating": rating, "user": user})
            assert r.status_code == 200, r.text
        gone = httpx.post(server.url("/v1/feedback"), json={"completion_id": "chatcmpl-unknown", "rating": True})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "completion_id"
        # a request admitted now holds the base version through the swap
        registry = server.services.registry
        held = registry.acquire(EP)
        assert held.adapter is None
        # the trainer consumes the two ratings: one KTO step, version live-e2e@1, notice
        worker = TrainerWorker(
            redis,
            keys,
            tmp_path,
            OnlineTrainer(base_ref, tmp_path, TrainingSection(kto_lr=1e-3)),
            BatchScheduler(TrainingSection(kto_min_batch=2)),
            consumer="e2e",
            block_ms=200,
            governor=FeedbackGovernor(redis, keys, tmp_path, max_events=0, window_s=60),
        )
        [notice] = worker.poll()
        assert notice.name == f"{EP}@1" and notice.endpoint == EP
        # rater agreement: mallory contradicted the two others on the first completion (formula: 0.563 vs 0.90)
        raters = httpx.get(server.url("/admin/raters"), timeout=30).json()["data"]
        assert [(r["rater"], round(r["weight"], 3), r["compared"]) for r in raters] == [
            ("mallory", 0.563, 1),
            ("(anonymous)", 0.9, 1),
            ("bob", 0.9, 1),
        ]
        assert raters[0]["endpoints"] == [EP]
        assert worker.published and AdapterStore(tmp_path).get(EP, 1).metrics["example_weight:mean"] == (
            pytest.approx((3 * 0.9 + 0.563) / 4, abs=2e-3)
        )
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
