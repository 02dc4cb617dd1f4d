"""Stored adapter versions served on demand through one live gateway (real SmolLM2, real Redis, its own store in
key mode; gateway/services/live/on_demand.py).

Tenant ``acme`` owns lineage ``acme.bot`` (versions 1-3; endpoint ``acme.bot`` follows it and serves @3) and
lineage ``acme.solo`` (no endpoint: @1 good, @2 rejected by the evaluation gate, @3 deleted). Tenant ``beta`` owns
``beta.bot@1``. The gateway holds at most 2 versions on demand.
"""

from __future__ import annotations

import threading

import httpx
import torch
from harness.bus import new_prefix
from harness.seeds import randomize_lora_b
from harness.server import wait_until

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import LoraConfig
from livelora.core.api_keys import TENANT_ROLES
from livelora.core.owners import OwnerStore

BASE = "smollm2-135m-instruct"
PREFIX = new_prefix("ondemand")
REJECTED = {"against": "acme.solo@1", "verdicts": {"*": {"passed": False, "failed": ["probe_accuracy"]}}}


def seed_home(home, base_ref) -> None:
    """The module's store (harness ``home``): versions with different random lora_B (so each version's logprobs
    differ from the base model's and from each other's), owner records, one endpoint, one gate-rejected and one
    deleted version."""
    from livelora.trainer.model import TrainingModel

    store, owners = AdapterStore(home), OwnerStore(home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    g = torch.Generator().manual_seed(1)

    def save(lineage: str, gate: dict | None = None) -> None:
        randomize_lora_b(tm, g, 0.3)
        tm.save_weights(store, lineage, gate=gate)

    for lineage, tenant in (("acme.bot", "acme"), ("acme.solo", "acme"), ("beta.bot", "beta")):
        assert owners.claim("lineage", lineage, tenant)
    for _ in range(3):
        save("acme.bot")
    save("acme.solo")
    save("acme.solo", gate=REJECTED)
    save("acme.solo")
    store.delete("acme.solo", 3)
    save("beta.bot")
    EndpointStore(home).create("acme.bot", "acme.bot", tenant="acme", who="test")


#: the harness ``keys`` and ``server``
KEYS = {t: (t, TENANT_ROLES) for t in ("acme", "beta")}
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX, "max_on_demand_versions": 2}


def http(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def chat(c: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        **kw,
    }
    return c.post("/v1/chat/completions", json=body)


def differ(x: list[float], y: list[float]) -> bool:
    """Whether two logprob lists differ by more than float noise (merged vs. unmerged LoRA weights)."""
    return len(x) != len(y) or max(abs(u - v) for u, v in zip(x, y)) > 1e-3


def logprobs(r: httpx.Response) -> list[float]:
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_stored_version_is_loaded_once_and_served(server, keys):
    registry = server.services.registry
    assert registry.current["acme.bot"] == "acme.bot@3"
    assert "acme.bot@1" not in server.engine.loaded_adapters()
    with http(server, keys["acme"]) as a:
        listed = [m["id"] for m in a.get("/v1/models").json()["data"]]
        assert listed == [BASE, "acme.bot"]  # stored versions are not listed ...
        entry = a.get("/v1/models/acme.bot@1").json()  # ... but each can be looked up and named
        assert (entry["id"], entry["owned_by"], entry["parent"]) == ("acme.bot@1", "acme", BASE)
        base = logprobs(chat(a, BASE))
        r = chat(a, "acme.bot@1")
        one = logprobs(r)
        body = r.json()
        assert body["model"] == "acme.bot@1" and body["system_fingerprint"] == "livelora-acme.bot@1"
        assert r.headers["X-Livelora-Adapter-Version"] == "acme.bot@1"
        assert differ(one, base)  # other weights than the base model's...
        current = chat(a, "acme.bot")
        assert current.json()["system_fingerprint"] == "livelora-acme.bot@3"
        assert differ(logprobs(current), one)  # ... and than the endpoint's current version
        assert not differ(logprobs(chat(a, "acme.bot@1")), one)  # loaded now: served as is, not reloaded
        assert list(registry.on_demand.held) == ["acme.bot@1"]

        loads: list[str] = []
        engine, original = server.engine, server.engine.load_and_check

        async def counting(name, path, canary):
            loads.append(name)
            return await original(name, path, canary)

        engine.load_and_check = counting
        try:
            results: list[httpx.Response] = []
            threads = [threading.Thread(target=lambda: results.append(chat(a, "acme.bot@2"))) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            del engine.load_and_check
        assert loads == ["acme.bot@2"]  # three concurrent requests, one load
        assert [r.json()["system_fingerprint"] for r in results] == ["livelora-acme.bot@2"] * 3
        two = logprobs(results[0])
        assert not any(differ(logprobs(r), two) for r in results) and differ(two, one) and differ(two, base)
        assert wait_until(lambda: not registry.leases)  # every lease released
        assert "acme.bot@2" in server.engine.loaded_adapters()


def test_a_missing_and_another_tenants_version_get_the_same_404(server, keys):
    with http(server, keys["acme"]) as a, http(server, keys["beta"]) as b:
        assert logprobs(chat(b, "beta.bot@1"))  # beta's own version serves
        cases = {
            b: [
                "acme.bot@1",  # acme's, loaded
                "acme.solo@1",  # acme's, stored, not loaded
                "acme.solo@3",
            ],  # acme's, deleted
            a: ["beta.bot@1", f"{BASE}@1"],
        }
        for client, models in cases.items():
            missing = error_of(chat(client, "nobody.x@99"), 404)
            assert missing["code"] == "model_not_found" and "does not exist" in missing["message"]
            for model in [*models, "acme.bot@99"]:
                err = error_of(chat(client, model), 404)
                assert err == {**missing, "message": missing["message"].replace("nobody.x@99", model)}, model
                err = error_of(client.get(f"/v1/models/{model}"), 404)
                assert err == {
                    **error_of(client.get("/v1/models/nobody.x@99"), 404),
                    "message": f"model {model!r} does not exist",
                }, model
    assert "acme.solo@1" not in server.engine.loaded_adapters()


def test_another_spelling_of_a_version_number_is_unknown_and_loads_nothing(server, keys):
    """One spelling per version: ``@01``, ``@001``, a non-ASCII digit are not ``@1`` (a lenient parse once loaded
    the version behind a 404 and evicted another held one)."""
    registry = server.services.registry
    with http(server, keys["acme"]) as a:
        held_before, loaded_before = list(registry.on_demand.held), set(server.engine.loaded_adapters())
        for model in ("acme.solo@01", "acme.solo@001", "acme.solo@\u0661"):
            err = error_of(chat(a, model), 404)
            assert err["code"] == "model_not_found" and repr(model) in err["message"], model
            assert error_of(a.get(f"/v1/models/{model}"), 404)["code"] == "model_not_found"
        assert list(registry.on_demand.held) == held_before
        assert set(server.engine.loaded_adapters()) == loaded_before and "acme.solo@1" not in loaded_before


def test_a_gate_rejected_or_deleted_version_says_why(server, keys):
    with http(server, keys["acme"]) as a:
        err = error_of(chat(a, "acme.solo@2"), 409)
        assert err["code"] == "version_rejected" and err["param"] == "model"
        assert "evaluation gate rejected it" in err["message"]
        err = error_of(chat(a, "acme.solo@3"), 404)
        assert err["code"] == "model_not_found" and "was deleted" in err["message"]
        assert "acme.solo@1" in err["message"]  # what is stored instead
        legacy = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
        assert (
            error_of(a.post("/v1/completions", json={"model": "acme.solo@2", **legacy}), 409)["code"]
            == "version_rejected"
        )
        r = a.post("/v1/completions", json={"model": "acme.solo@1", **legacy})  # the legacy route loads too
        assert r.status_code == 200 and r.json()["system_fingerprint"] == "livelora-acme.solo@1", r.text
    assert "acme.solo@2" not in server.engine.loaded_adapters()


def test_feedback_on_a_version_trains_its_endpoint_or_is_refused_without_one(server, keys):
    with http(server, keys["acme"]) as a:
        bound = chat(a, "acme.bot@1").json()["id"]
        r = a.post("/v1/feedback", json={"completion_id": bound, "rating": True})
        assert r.status_code == 200 and r.json()["endpoint"] == "acme.bot", r.text
        unbound = chat(a, "acme.solo@1").json()["id"]
        err = error_of(a.post("/v1/feedback", json={"completion_id": unbound, "rating": True}), 409)
        assert err["code"] == "not_trainable" and "no endpoint serves" in err["message"]


def test_eviction_takes_the_least_recently_used_idle_version_never_one_in_use(server, keys):
    registry, engine = server.services.registry, server.engine
    with http(server, keys["acme"]) as a:
        logprobs(chat(a, "acme.bot@1"))
        logprobs(chat(a, "acme.bot@2"))
        assert list(registry.on_demand.held) == ["acme.bot@1", "acme.bot@2"]  # @1 least recently used
        stop = threading.Event()

        def stream(model: str) -> None:  # a long request holding its version until stopped
            with a.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "Count."}],
                    "max_tokens": 4000,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        busy = threading.Thread(target=stream, args=("acme.bot@1",))
        busy.start()
        try:
            assert wait_until(lambda: registry.leases.get("acme.bot@1", 0) == 1)
            logprobs(chat(a, "acme.bot@2"))  # now @1 is in use and the least recently used
            assert list(registry.on_demand.held) == ["acme.bot@1", "acme.bot@2"]
            r = chat(a, "acme.solo@1")
            assert r.json()["system_fingerprint"] == "livelora-acme.solo@1"
            assert list(registry.on_demand.held) == ["acme.bot@1", "acme.solo@1"]  # @2 evicted, not @1
            assert "acme.bot@2" not in engine.loaded_adapters() and "acme.bot@1" in engine.loaded_adapters()

            busy2 = threading.Thread(target=stream, args=("acme.solo@1",))
            busy2.start()
            assert wait_until(lambda: registry.leases.get("acme.solo@1", 0) == 1)
            err = error_of(chat(a, "acme.bot@2"), 429)  # both held versions serve running requests
            assert "LIVELORA_MAX_ON_DEMAND_VERSIONS" in err["message"]
            assert set(registry.on_demand.held) == {"acme.bot@1", "acme.solo@1"}
        finally:
            stop.set()
            busy.join(timeout=120)
        busy2.join(timeout=120)
        assert wait_until(lambda: not registry.leases)
        assert chat(a, "acme.bot@2").json()["system_fingerprint"] == "livelora-acme.bot@2"  # room again
        assert len(registry.on_demand.held) == 2 and "acme.bot@2" in registry.on_demand.held
        assert wait_until(
            lambda: sum(n in engine.loaded_adapters() for n in ("acme.bot@1", "acme.bot@2", "acme.solo@1")) == 2
        )
