"""A rating's side effects where the rating is handled: :meth:`SignalService.feedback` counts each accepted rating
under the version that served the rated completion and runs the endpoint's rollback test, on real Redis, the
real SmolLM2 transformers engine and a real adapter registry. A replayed rating counts nothing."""

from __future__ import annotations

import asyncio
import time
import uuid

from harness.seeds import saved_versions

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.types.signals import CompletionRecord, FeedbackRequest
from livelora.core.bus import connect_async, ensure_group_async
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines import create_engine
from livelora.gateway.services.live.completion_log import CompletionLog
from livelora.gateway.services.live.live_stats import LiveStats
from livelora.gateway.services.live.registry import AdapterRegistry
from livelora.gateway.services.live.signals import SignalService
from livelora.gateway.settings import LiveSection

EP = "smollm2-135m-instruct"


def _completion(cid: str, adapter: str) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        endpoint=EP,
        model=EP,
        adapter=adapter,
        messages=[{"role": "user", "content": "hi"}],
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[7, 8],
        logprobs=[-0.5, -1.25],
        completion="ok",
        finish_reason="stop",
        created=int(time.time()),
    )


def test_thumbs_down_on_the_new_version_roll_it_back_through_the_signal_service(base_ref, tmp_path):
    saved_versions(base_ref, tmp_path, EP, seed=1)
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    loop = asyncio.new_event_loop()
    engine = create_engine("transformers", model=base_ref.name, max_batch_size=4)
    v1, v2 = f"{EP}@1", f"{EP}@2"

    async def body():
        await engine.start()
        client = connect_async("redis://127.0.0.1:6379/0")
        try:
            await ensure_group_async(client, keys)
            reg = AdapterRegistry(engine, tmp_path, EP, client=client, keys=keys, resync_s=0)
            reg.stats = stats = LiveStats(client, keys, LiveSection(rollback_min_ratings=10))
            log = CompletionLog(client, keys, retention_s=3600)
            svc = SignalService(client, keys, log, registry=reg, stats=stats)
            await reg.install(EP, 1)
            for i in range(20):  # v1: 16 of 20 thumbs up, through the service
                await log.record(_completion(f"chatcmpl-a{i}", v1))
                await svc.feedback(FeedbackRequest(completion_id=f"chatcmpl-a{i}", rating=i % 5 != 0))
            await reg.install(EP, 2)
            assert reg.current[EP] == v2
            for i in range(4):
                await log.record(_completion(f"chatcmpl-b{i}", v2))
            _, replayed = await svc.feedback(
                FeedbackRequest(completion_id="chatcmpl-b0", rating=False), idempotency_key="k"
            )
            assert not replayed and reg.current[EP] == v2  # one thumbs down: not sure yet
            _, replayed = await svc.feedback(
                FeedbackRequest(completion_id="chatcmpl-b0", rating=False), idempotency_key="k"
            )
            assert replayed and (await stats.version(EP, v2))["ratings"] == 1  # the replay counted nothing
            for i in (1, 2):
                await svc.feedback(FeedbackRequest(completion_id=f"chatcmpl-b{i}", rating=False))
            assert reg.current[EP] == v2  # three of them: still not sure
            await svc.feedback(FeedbackRequest(completion_id="chatcmpl-b3", rating=False))
            assert reg.current[EP] == v1  # the fourth rating's handling rolled the endpoint back
            assert (await stats.version(EP, v1))["thumbs_up"] == 16
            assert EndpointStore(tmp_path).get(EP).blocked == [2]
            hist = [h for h in EndpointStore(tmp_path).history(EP) if h.action == "auto_rollback"]
            assert len(hist) == 1 and (hist[0].from_, hist[0].to) == (v2, v1)
            await reg.close()
        finally:
            async for k in client.scan_iter(match=keys.prefix + "*"):
                await client.delete(k)
            await client.aclose()
            await engine.close()

    loop.run_until_complete(body())
    loop.close()
