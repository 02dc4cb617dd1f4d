"""AdapterRegistry on the real SmolLM2 transformers engine: checked installs, leases across a hot-swap,
drained unloads, refused versions, Redis notices, pinned endpoints and catch-up from the store."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import torch

from livelora.adapters.endpoints import EndpointBinding, EndpointStore
from livelora.adapters.store import WEIGHTS_FILE, AdapterStore
from livelora.clients.errors import BadRequestError, ModelNotFoundError
from livelora.clients.types.tinker import LoraConfig
from livelora.core.bus import connect_async, connect_sync, delete_prefix
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import SamplingParams
from livelora.gateway.services.live.registry import AdapterRegistry

EP = "smollm2-135m-instruct"  # the served base name is an endpoint; its lineage has the same name


#: the harness ``engine`` (transformers)
ENGINE_OPTIONS = {"max_batch_size": 4}


@pytest.fixture(scope="module")
def versions(base_ref, tmp_path_factory):
    """Versions 1-4 of lineage EP in a fresh store: 1 and 2 good (different random lora_B), 3 with its
    weights file altered after saving (sha256 mismatch), 4 with NaN weights (fails the canary)."""
    from livelora.trainer.model import TrainingModel

    home = tmp_path_factory.mktemp("registry-home")
    store = AdapterStore(home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    g = torch.Generator().manual_seed(0)
    for v in (1, 2, 3, 4):
        with torch.no_grad():
            for k, p in tm.lora_params.items():
                if "lora_B" in k:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05 if v != 4 else torch.full(p.shape, float("nan")))
        tm.save_weights(store, EP)
    weights = store.version_dir(EP, 3) / WEIGHTS_FILE
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    return home


async def generate(engine, adapter, prompt, n=6):
    toks = []
    async for c in engine.generate(
        prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapter=adapter
    ):
        toks += c.token_ids
    return toks


def test_install_lease_hot_swap_drain_and_refusals(engine, versions, loop, tmp_path):
    async def body():
        reg = AdapterRegistry(engine, tmp_path, EP, resync_s=0)  # empty store: base model
        await reg.start()
        with pytest.raises(ModelNotFoundError):
            reg.acquire("nope")
        async with reg.lease(EP) as lease:
            assert (lease.endpoint, lease.adapter, lease.version) == (EP, None, "base")
        reg = AdapterRegistry(engine, versions, EP, resync_s=0)
        reg.refused["smollm2-135m-instruct@4"] = "skip"  # start() takes the newest good one
        reg.refused["smollm2-135m-instruct@3"] = "skip"
        await reg.install(EP, 1)
        assert reg.current[EP] == f"{EP}@1" and f"{EP}@1" in engine.loaded_adapters()
        prompt = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
        v1_alone = await generate(engine, f"{EP}@1", prompt)
        # a request leased on v1 keeps v1 through the swap to v2, and v1 is unloaded once it finishes
        lease = reg.acquire(EP)
        assert lease.adapter == f"{EP}@1" and reg.leases[f"{EP}@1"] == 1
        running = asyncio.create_task(generate(engine, lease.adapter, prompt))
        await asyncio.sleep(0)
        await reg.install(EP, 2)
        assert reg.current[EP] == f"{EP}@2"
        assert reg.acquire(EP).adapter == f"{EP}@2"  # new requests get v2 (lease never released)
        assert f"{EP}@1" in engine.loaded_adapters()  # still leased
        assert await running == v1_alone
        lease.release()
        lease.release()  # idempotent
        for _ in range(600):  # the unload runs in the background
            if f"{EP}@1" not in engine.loaded_adapters() and f"{EP}@1" not in reg.loaded:
                break
            await asyncio.sleep(0.05)
        assert f"{EP}@1" not in engine.loaded_adapters() and f"{EP}@1" not in reg.loaded
        s1 = await engine.score(prompt, adapter=f"{EP}@2")
        s0 = await engine.score(prompt)
        assert any(abs(a.logprob - b.logprob) > 1e-4 for a, b in zip(s1[1:], s0[1:]))  # v2 is not the base
        # tampered weights and NaN weights are refused; the endpoint stays on v2 and nothing stays loaded
        reg.refused.clear()
        with pytest.raises(BadRequestError, match="sha256"):
            await reg.install(EP, 3)
        with pytest.raises(BadRequestError, match="canary"):
            await reg.install(EP, 4)
        assert reg.current[EP] == f"{EP}@2"
        assert {f"{EP}@3", f"{EP}@4"}.isdisjoint(engine.loaded_adapters())
        assert set(reg.refused) == {f"{EP}@3", f"{EP}@4"}
        # a second gateway starting on this store skips refused newer versions and serves v2
        fresh = AdapterRegistry(engine, versions, EP, resync_s=0)
        fresh.refused.update(reg.refused)
        await fresh.start()
        assert fresh.current[EP] == f"{EP}@2"
        # an operator pins the endpoint to v1: the next catch-up moves it there
        EndpointStore(versions).set(EP, EndpointBinding(lineage=EP, mode="pinned", version=1))
        await fresh.sync_from_store()
        assert fresh.current[EP] == f"{EP}@1"
        assert fresh.acquire(f"{EP}@1").endpoint == EP  # a loaded version name is servable too
        (versions / "endpoints.json").unlink()

    loop.run_until_complete(body())


def test_notice_moves_endpoint(engine, base_ref, loop, tmp_path):
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(tmp_path)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    keys = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")

    async def body():
        client = connect_async("redis://127.0.0.1:6379/0")
        reg = AdapterRegistry(engine, tmp_path, "live", client=client, keys=keys, resync_s=0)
        await reg.start()
        assert reg.current["live"] is None
        for _ in range(100):  # subscriber is listening
            if (await client.pubsub_numsub(keys.notices))[0][1] == 1:
                break
            await asyncio.sleep(0.05)
        manifest = tm.save_weights(store, "live")
        sync = connect_sync("redis://127.0.0.1:6379/0")
        sync.publish(
            keys.notices,
            json.dumps(
                {
                    "type": "version_published",
                    "lineage": "live",
                    "version": 1,
                    "name": manifest.name,
                    "sha256": manifest.sha256,
                    "path": str(store.version_dir("live", 1)),
                }
            ),
        )
        sync.close()
        for _ in range(1200):  # install = load + sha256 + forward pass
            if reg.current["live"] == "live@1":
                break
            await asyncio.sleep(0.05)
        assert reg.current["live"] == "live@1"
        await reg.close()
        await delete_prefix(client, keys.prefix)
        await client.aclose()
        await engine.unload_adapter("live@1")

    loop.run_until_complete(body())
