"""Per-version live statistics and the automatic rollback (sequential test on the thumbs-up rate) on real Redis
and the real SmolLM2 transformers engine: an injected regression rolls the endpoint back, a request running on
the bad version finishes on it, new requests get the predecessor, the history records the test's statistics,
and the rolled-back version is never taken again."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from harness.seeds import saved_versions

from livelora.adapters.endpoints import EndpointStore
from livelora.core.bus import connect_async
from livelora.core.rails import sprt_thumbs, wilson_interval
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines import create_engine
from livelora.gateway.engines.base import SamplingParams
from livelora.gateway.services.live.live_stats import LiveStats
from livelora.gateway.services.live.registry import AdapterRegistry
from livelora.gateway.settings import LiveSection

EP = "smollm2-135m-instruct"


def test_sequential_test_and_interval_values():
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    # predecessor liked 80 %: four thumbs down in a row cross ln((1-β)/α) = ln 16 = 2.77
    assert [sprt_thumbs(0, n, 0.8)[0] for n in (1, 2, 3, 4)] == ["continue", "continue", "continue", "rollback"]
    assert sprt_thumbs(16, 20, 0.8)[0] == "keep"  # as good as before: kept
    assert sprt_thumbs(5, 10, 0.8)[0] == "continue"  # 50 % after 10: not sure yet (LLR 2.03)
    assert sprt_thumbs(3, 10, 0.8)[0] == "rollback"  # 30 % after 10: worse with confidence


def test_injected_regression_rolls_back_with_no_failed_request(base_ref, tmp_path):
    saved_versions(base_ref, tmp_path, EP, seed=1)
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    loop = asyncio.new_event_loop()
    engine = create_engine("transformers", model=base_ref.name, max_batch_size=4)

    async def body():
        await engine.start()
        client = connect_async("redis://127.0.0.1:6379/0")
        try:
            reg = AdapterRegistry(engine, tmp_path, EP, client=client, keys=keys, resync_s=0)
            reg.stats = stats = LiveStats(client, keys, LiveSection(rollback_min_ratings=10))
            await reg.install(EP, 1)
            for i in range(20):  # v1: 16 of 20 thumbs up
                await stats.count_rating(EP, f"{EP}@1", f"c{i}:u", i % 5 != 0)
            await reg.install(EP, 2)
            assert reg.current[EP] == f"{EP}@2" and reg.predecessor[EP] == f"{EP}@1"
            lease = reg.acquire(EP)  # a request running on v2
            prompt = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
            running = asyncio.create_task(_generate(engine, lease.adapter, prompt))
            rolled, n = None, 0
            while rolled is None and n < 20:  # v2's raters dislike it
                await stats.count_rating(EP, f"{EP}@2", f"d{n}:u", False)
                n += 1
                rolled = await stats.after_rating(reg, EP)
            assert n == 4 and rolled["predecessor"]["thumbs_up"] == 16 and rolled["serving"]["ratings"] == 4
            assert reg.current[EP] == f"{EP}@1" and reg.acquire(EP).adapter == f"{EP}@1"
            assert f"{EP}@2" in engine.loaded_adapters()  # still leased: the running request finishes
            assert len(await running) == 6  # ... and it did, on v2
            lease.release()
            for _ in range(600):
                if f"{EP}@2" not in engine.loaded_adapters():
                    break
                await asyncio.sleep(0.05)
            assert f"{EP}@2" not in engine.loaded_adapters()
            await reg.sync_from_store()  # catch-up never takes v2 again
            assert reg.current[EP] == f"{EP}@1"
            binding = EndpointStore(tmp_path).get(EP)
            assert binding.blocked == [2]
            hist = [h for h in EndpointStore(tmp_path).history(EP) if h.action == "auto_rollback"]
            assert len(hist) == 1 and (hist[0].from_, hist[0].to) == (f"{EP}@2", f"{EP}@1")
            assert hist[0].details["test"] == "sprt" and hist[0].details["llr"] >= 2.77
            shown = {v["version"]: v for v in await stats.endpoint(EP)}
            assert shown[f"{EP}@1"]["thumbs_up_rate"] == 0.8 and shown[f"{EP}@2"]["ratings"] == 4
            assert shown[f"{EP}@2"]["requests"] == 1 and shown[f"{EP}@1"]["requests"] >= 1
            assert shown[f"{EP}@1"]["ci95"][0] < 0.8 < shown[f"{EP}@1"]["ci95"][1]
            await reg.close()
        finally:
            async for k in client.scan_iter(match=keys.prefix + "*"):
                await client.delete(k)
            await client.aclose()
            await engine.close()

    loop.run_until_complete(body())
    loop.close()


async def _generate(engine, adapter, prompt, n=6):
    toks = []
    async for c in engine.generate(
        prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapter=adapter
    ):
        toks += c.token_ids
    return toks


def test_canary_serves_its_share_counted_and_completes_without_regression(base_ref, tmp_path):
    import random

    saved_versions(base_ref, tmp_path, EP, seed=2)
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    loop = asyncio.new_event_loop()
    engine = create_engine("transformers", model=base_ref.name, max_batch_size=4)
    v1, v2 = f"{EP}@1", f"{EP}@2"

    async def body():
        await engine.start()
        client = connect_async("redis://127.0.0.1:6379/0")
        try:
            reg = AdapterRegistry(engine, tmp_path, EP, client=client, keys=keys, resync_s=0)
            live = LiveSection(canary_share=0.25, canary_min_ratings=10, rollback_min_ratings=10)
            await reg.install(EP, 1)  # served before canarying is switched on
            reg.stats = stats = LiveStats(client, keys, live, home=tmp_path, rng=random.Random(0))
            assert reg.current[EP] == v1
            for i in range(20):
                await stats.count_rating(EP, v1, f"c{i}:u", i % 5 != 0)  # v1: 80 % thumbs up
            await reg.install(EP, 2)
            assert reg.current[EP] == v1 and stats.canaries[EP]["version"] == v2  # canary, not switched
            served = []
            for _ in range(400):
                lease = reg.acquire(EP)
                served.append(lease.adapter)
                lease.release()
            n2 = served.count(v2)
            assert 60 < n2 < 140 and served.count(v1) == 400 - n2  # ≈ 25 % of requests
            shown = {v["version"]: v for v in await stats.endpoint(EP)}
            assert shown[v1]["requests"] == 400 - n2 and shown[v2]["requests"] == n2  # counted
            assert v2 in engine.loaded_adapters()  # the canary stays loaded between requests
            for i in range(10):  # the canary is liked as much
                await stats.count_rating(EP, v2, f"k{i}:u", i % 5 != 0)
                out = await stats.after_rating(reg, EP)
                assert (out is None) == (i < 9)
            assert out["state"] == "completed" and reg.current[EP] == v2 and EP not in stats.canaries
            hist = [h for h in EndpointStore(tmp_path).history(EP) if h.action == "canary"]
            assert [h.details["state"] for h in hist] == ["started", "completed"] and hist[1].to == v2
            await stats.close()
            await reg.close()
        finally:
            async for k in client.scan_iter(match=keys.prefix + "*"):
                await client.delete(k)
            await client.aclose()
            await engine.close()

    loop.run_until_complete(body())
    loop.close()
