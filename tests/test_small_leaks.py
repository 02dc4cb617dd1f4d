"""The small leaks of issue 27 (item 6), on a live gateway with two tenants and on the store itself.

* ``default``'s admin ``POST /admin/users/{name}/forget`` acts on its own tenant's records only, and answers the
  same for a name that exists only in another tenant as for one that exists nowhere;
* the store's secret (``archive_secret``), key file and the directories it creates are the owner's alone;
* signed download URLs are built on ``LIVELORA_PUBLIC_URL`` or the server's own address, never the ``Host`` header.
"""

from __future__ import annotations

import json
import os
import stat
import uuid

import httpx
import pytest
import redis
from starlette.requests import Request

from livelora.core.api_keys import TENANT_ROLES, KeyStore
from livelora.core.redis_keys import KeyLayout

BASE = "smollm2-135m-instruct"
PREFIX = f"{os.environ['LIVELORA_REDIS_PREFIX']}leaks-{uuid.uuid4().hex[:8]}:"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def seed_home(home, base_ref):
    """The harness's ``home`` fixture calls this: a store made world-readable by an older version or by hand."""
    os.chmod(home, 0o755)


#: the harness's ``keys`` and ``server`` fixtures (tests/harness/plugin.py)
KEYS = {t: (t, TENANT_ROLES) for t in ("acme", "default")}
SERVER_SETTINGS = {"max_batch_size": 2, "max_waiting": 4, "redis_prefix": PREFIX, "executor_in_process": True}


def http(server, key: str, **headers) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120, headers={"X-API-Key": key, **headers})


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (str(r.request.url), r.status_code, r.text)
    return r.json()


def future(c: httpx.Client, request_id: str) -> dict:
    while True:
        r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.status_code != 408:
            return ok(r)


def chat(c: httpx.Client, user: str) -> str:
    body = {"model": BASE, "max_tokens": 1, "user": user, "messages": [{"role": "user", "content": "hi"}]}
    return ok(c.post("/v1/chat/completions", json=body))["id"]


def test_forget_acts_on_the_callers_tenant_only(server, keys):
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    layout = KeyLayout(PREFIX)
    with http(server, keys["acme"]) as a, http(server, keys["default"]) as d:
        acme_bob, acme_carol, default_bob = chat(a, "bob"), chat(a, "carol"), chat(d, "bob")
        forget = {"reason": "test"}
        out = ok(d.post("/admin/users/bob/forget", json=forget))
        assert out["completions_removed"] == 1  # default's own bob, not acme's
        assert not r.exists(layout.completion(default_bob)) and r.exists(layout.completion(acme_bob))
        # a name only another tenant has answers as a name nobody has: nothing removed, nothing learnt
        carol = ok(d.post("/admin/users/carol/forget", json=forget))
        nobody = ok(d.post("/admin/users/nobody-at-all/forget", json=forget))
        assert {k: v for k, v in carol.items() if k != "user"} == {k: v for k, v in nobody.items() if k != "user"}
        assert r.exists(layout.completion(acme_carol))
        assert ok(a.post("/admin/users/bob/forget", json=forget))["completions_removed"] == 1  # acme's own


def test_the_store_secret_keys_and_directories_are_the_owners_alone(server, keys, home):
    with http(server, keys["acme"], host="evil.example:666") as a:
        sid = ok(a.post("/api/v1/create_session", json={}))["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2}}
        model = future(a, ok(a.post("/api/v1/create_model", json=body))["request_id"])["model_id"]
        saved = ok(a.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 1, "path": "w1"}))
        assert "error" not in future(a, saved["request_id"])
        url = ok(a.get(f"/api/v1/training_runs/{model}/checkpoints/weights/w1/archive"))["url"]
    # the Host header was evil.example: the URL names the server's own address instead, and it works
    assert url.startswith(f"{server.base_url}/api/v1/checkpoint_archives/"), url
    assert httpx.get(url, timeout=60).status_code == 200
    assert mode(home / "archive_secret") == 0o600 and mode(home / "keys.json") == 0o600
    assert mode(home) & 0o007 == 0  # an existing world-readable root lost its world bits at start
    made = [p for p in home.rglob("*") if p.is_dir() and not p.is_symlink() and "models" not in p.parts]
    assert made and all(mode(p) == 0o700 for p in made), {str(p): oct(mode(p)) for p in made if mode(p) != 0o700}


def test_signed_urls_use_the_configured_public_url(tmp_path):
    from livelora.gateway.api.deps import GatewayServices, get_public_url
    from livelora.gateway.settings import GatewaySettings

    scope = {"type": "http", "server": ("10.0.0.5", 8123), "headers": [(b"host", b"evil.example")]}
    services = GatewayServices(settings=GatewaySettings(home=tmp_path), keys=KeyStore(tmp_path), auth_open=True)
    assert get_public_url(Request(scope), services) == "http://10.0.0.5:8123"
    assert get_public_url(Request({**scope, "server": ("::1", 9)}), services) == "http://[::1]:9"
    os.environ["LIVELORA_PUBLIC_URL"] = "https://lora.example.com/base/"
    try:
        services.settings = GatewaySettings(home=tmp_path)
    finally:
        os.environ.pop("LIVELORA_PUBLIC_URL")
    assert get_public_url(Request(scope), services) == "https://lora.example.com/base"
    with pytest.raises(ValueError):
        GatewaySettings(home=tmp_path, public_url="lora.example.com")  # a base URL needs its scheme


def test_forget_on_signals_keeps_other_tenants_events(tmp_path):
    from livelora.core.governance import forget_user, signals_dir

    folder = signals_dir(tmp_path)
    folder.mkdir(parents=True)
    events = [{"event": {"user": "bob", "endpoint": "ep", "caller": c, "id": c or "none"}} for c in ("acme", None)]
    (folder / "20250101.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert forget_user(tmp_path, "bob", "default", lambda ep: True, who="t") == {"ep": 1}
    left = [json.loads(line)["event"]["caller"] for line in (folder / "20250101.jsonl").read_text().splitlines()]
    assert left == ["acme"]


def test_an_open_gateway_answers_only_requests_addressed_to_loopback(tmp_path):
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 must not drive a keyless gateway."""
    from fastapi.testclient import TestClient

    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    def get(base_url: str, settings=None, path="/admin/endpoints"):
        app = create_app(settings or GatewaySettings(home=tmp_path, model="smollm2-135m-instruct"))
        return TestClient(app, base_url=base_url).get(path)  # no lifespan: these routes read the store only

    for host in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "http://app.localhost"):
        assert get(host).status_code == 200, host
    for host in ("http://attacker.example:8000", "http://127.0.0.1.nip.io", "http://10.0.0.5:8000"):
        for path in ("/admin/endpoints", "/v1/models", "/console/login"):
            r = get(host, path=path)
            assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", (host, path)
    public = GatewaySettings(home=tmp_path, model="smollm2-135m-instruct", public_url="https://lora.example.com")
    assert get("https://lora.example.com", public).status_code == 200
    assert get("http://attacker.example", public).status_code == 400
    KeyStore(tmp_path).create("acme", ["admin"])  # key mode: the key is what protects, any Host may ask
    assert get("http://attacker.example").status_code == 401
