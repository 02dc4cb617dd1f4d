"""Endpoints, promotion/rollback, API keys, tenants, input limits and exports, through one live gateway on the
real SmolLM2 model and real Redis (its own store: API keys there switch that gateway to key mode, so it must
not be the session's shared store)."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
import redis
import torch
from harness.bus import new_prefix
from harness.console import console_client, login
from harness.seeds import randomize_lora_b
from harness.server import start_server
from typer.testing import CliRunner

from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import LoraConfig
from livelora.core.api_keys import ROLES, TENANT_ROLES, KeyStore
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.envelopes import is_anthropic
from livelora.gateway.middleware.auth import AUTHENTICATED, PUBLIC, app_routes, required_role

LINEAGE = "acme.support"
BASE = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Say something about the sea."}]
#: this module's store is its own install: its own Redis prefix (under the session's, cleaned up with it)
PREFIX = new_prefix("admin")


def seed_home(home, base_ref) -> None:
    """The module's store (harness ``home``): versions acme.support@1..4 (tenant acme's namespace: ``acme.<rest>``)
    with different random lora_B, and BASE@1; the ``keys`` fixture adds keys and endpoints of two tenants."""
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        randomize_lora_b(tm, g, 0.05)
        tm.save_weights(store, LINEAGE)
    tm.save_weights(store, BASE)  # the public base endpoint's lineage: trained by tenant 'default' only


def _cli(*args, env=None):
    from livelora.cli.main import app

    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def keys(home):
    """Keys made offline with the CLI (``--home``), as an admin bootstraps a server."""
    made = {}
    for role in ROLES:
        made[role] = (
            _cli("keys", "create", "--home", str(home), "--tenant", "acme", "--roles", role, "--name", f"acme-{role}")
            .strip()
            .splitlines()[-1]
        )
    made["acme"] = (
        _cli(
            "keys",
            "create",
            "--home",
            str(home),
            "--tenant",
            "acme",
            "--roles",
            ",".join(TENANT_ROLES),
            "--name",
            "acme-all",
        )
        .strip()
        .splitlines()[-1]
    )
    made["beta"] = (
        _cli(
            "keys",
            "create",
            "--home",
            str(home),
            "--tenant",
            "beta",
            "--roles",
            ",".join(TENANT_ROLES),
            "--name",
            "beta-all",
        )
        .strip()
        .splitlines()[-1]
    )
    revoked = _cli("keys", "create", "--home", str(home), "--tenant", "acme", "--roles", ",".join(TENANT_ROLES))
    made["revoked"] = revoked.strip().splitlines()[-1]
    rid = KeyStore(home).verify(made["revoked"]).key_id
    _cli("keys", "revoke", rid, "--home", str(home))
    stored = (home / "keys.json").read_text()
    assert all(k.startswith("tml-") and k not in stored for k in made.values())  # hashed only
    _cli(
        "endpoints",
        "create",
        "acme.prod",
        "--lineage",
        LINEAGE,
        "--mode",
        "pinned",
        "--version",
        "1",
        "--tenant",
        "acme",
        "--home",
        str(home),
    )
    _cli("endpoints", "create", "acme.live", "--lineage", LINEAGE, "--tenant", "acme", "--home", str(home))
    _cli(
        "endpoints",
        "create",
        "beta.ep",
        "--lineage",
        "beta.l",
        "--mode",
        "pinned",
        "--version",
        "base",
        "--tenant",
        "beta",
        "--home",
        str(home),
    )
    return made


#: the harness ``server`` (started after this module's ``keys``)
SERVER_SETTINGS = {"max_batch_size": 8, "max_waiting": 16, "max_body_bytes": 64 * 1024, "redis_prefix": PREFIX}


def client(server, key=None) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {key}"} if key else {}
    )


def chat(http, model="acme.prod", max_tokens=2, **kw):
    return http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **kw},
    )


def error_of(r, status):
    """The error object; the Messages API answers in Anthropic's envelope (whose error types are OpenAI's names
    for 401 and 403: ``authentication_error``, ``permission_error``)."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    if is_anthropic(r.request.url.path):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---------------------------------------------------------------------------------------------- roles


def _fill(path: str) -> str:
    out = path
    for name, value in (
        ("{model_id:path}", "acme.prod"),
        ("{name:path}", "acme.prod"),
        ("{endpoint}", "acme.prod"),
        ("{name}", "acme.support@1"),
        ("{fmt}", "peft"),
        ("{key_id}", "nokey"),
        ("{session_id}", "nosession"),
        ("{model_id}", "nosession:train:0"),
        ("{checkpoint_id:path}", "x"),
        ("{sampler_id}", "nosession:sample:0"),
        ("{lineage}", "acme.support"),
        ("{token}", "forged.0000"),
        ("{file_name}", "adapter_config.json"),
        ("{segment}", "nosegment"),
    ):
        out = out.replace(name, value)
    assert "{" not in out, path
    return out


def console_roles(server, keys, method: str, url: str, role: str) -> None:
    """A console route's credential is a session made by logging in with a key: no, a bad or a revoked key is
    401 at log-in, a key without ``admin`` 403; an admin key's session reaches the route (anything but 401/403),
    and the route without a session is 401."""
    for who in ("none", "bad", "revoked", *ROLES):
        key = {"none": None, "bad": "tml-000000000000-not-a-key"}.get(who, keys.get(who))
        r = login(server.base_url, key)
        if who in ("none", "bad", "revoked"):
            assert error_of(r, 401)["type"] == "authentication_error", (url, who)
        elif who not in (role, "admin"):
            assert error_of(r, 403)["type"] == "permission_error", (url, who)
        else:
            assert r.status_code == 303, (url, who, r.text)
    if url == "/console/login":
        return
    with console_client(server.base_url, keys["admin"]) as c:
        form = {"version": "acme.support@99", "reason": "roles", "format": "bogus", "user": "nobody"}
        url = url.replace("acme.prod", "acme.nope") if method == "POST" else url  # an action changes nothing
        r = c.request(method, url, data=form if method == "POST" else None)
        assert r.status_code not in (401, 403), (method, url, r.status_code, r.text)
    assert error_of(httpx.request(method, server.base_url + url), 401)["type"] == "authentication_error"


def test_every_route_answers_401_403_by_role(server, keys):
    routes = [(m, p) for m, p in app_routes(server.app) if m != "HEAD"]
    assert len(routes) > 40 and ("POST", "/admin/endpoints/{name:path}/promote") in routes
    seen_roles = set()
    for method, path in routes:
        role = required_role(method, path, metrics_key=server.services.settings.observability.metrics_require_key)
        seen_roles.add(role)
        url = _fill(path)
        body = {} if method in ("POST", "PUT", "PATCH") else None
        if path == "/admin/keys" and method == "POST":
            body = {"roles": []}  # a valid admin call would mint a key: an invalid body still proves access
        if "promote" in path or "rollback" in path or path.endswith("/export"):
            body = {"version": "nope"} if "promote" in path else {"format": "bogus"}
        if path.startswith("/console") and (role != PUBLIC or path == "/console/login"):
            console_roles(server, keys, method, url, role)
            continue
        for who in ("none", "bad", "revoked", *ROLES):
            key = {"none": None, "bad": "tml-000000000000-not-a-key"}.get(who, keys.get(who))
            with client(server, key) as http:
                if method == "DELETE" and "/adapters/" in path and who == "admin":
                    url_used = url.replace("acme.support@1", "acme.support@99")
                elif path.endswith(("/pause", "/resume")) and who == "admin":  # reaches the route, changes nothing
                    url_used = url.replace("acme.prod", "acme.nope")
                else:
                    url_used = url
                r = http.request(method, url_used, json=body)
            if role == PUBLIC:
                assert r.status_code not in (401, 403), (method, path, who, r.status_code)
            elif who in ("none", "bad", "revoked"):
                assert error_of(r, 401)["type"] == "authentication_error", (method, path, who)
            elif role == AUTHENTICATED:  # any valid key, whatever its roles
                assert r.status_code not in (401, 403), (method, path, who, r.status_code, r.text)
            elif who != role:
                assert error_of(r, 403)["type"] == "permission_error", (method, path, who)
            else:
                assert r.status_code not in (401, 403), (method, path, who, r.status_code, r.text)
    assert seen_roles == {PUBLIC, AUTHENTICATED, *ROLES}
    assert required_role("GET", "/some/new/route") == "admin"  # unmatched routes are never public


# ---------------------------------------------------------------------------------------------- tenants


def test_an_operator_key_is_made_on_the_store_only(server, keys):
    with client(server, keys["admin"]) as http:
        r = http.post("/admin/keys", json={"roles": ["admin", "operator"]})
    assert error_of(r, 403)["param"] == "roles"
    assert "--home" in r.json()["error"]["message"]


def test_cli_keys_create_over_http_takes_the_callers_own_tenant(server, keys):
    """``livelora keys create --tenant T`` over HTTP: T = the admin key's tenant makes a key there; another tenant
    is refused (400 naming ``tenant``) and nothing is made."""
    from livelora.cli.main import app

    before = len(KeyStore(server.services.settings.home).all())
    common = ["--url", server.base_url, "--api-key", keys["admin"], "--roles", "inference"]
    made = CliRunner().invoke(app, ["keys", "create", "--tenant", "acme", "--name", "own", *common])
    assert made.exit_code == 0, made.output
    assert "for tenant acme, roles inference" in made.output
    assert KeyStore(server.services.settings.home).verify(made.output.strip().splitlines()[-1]).tenant == "acme"
    other = CliRunner().invoke(app, ["keys", "create", "--tenant", "beta", *common])
    assert other.exit_code == 1 and "error (400)" in other.output and "tenant acme" in other.output, other.output
    assert len(KeyStore(server.services.settings.home).all()) == before + 1


def test_cross_tenant_access_is_404(server, keys):
    acme, beta = client(server, keys["acme"]), client(server, keys["beta"])
    ok = chat(acme)
    assert ok.status_code == 200 and ok.headers["x-livelora-adapter-version"] == "acme.support@1"
    cid = ok.json()["id"]
    assert {m["id"] for m in acme.get("/v1/models").json()["data"]} >= {
        "smollm2-135m-instruct",
        "acme.prod",
        "acme.live",
    }
    beta_models = {m["id"] for m in beta.get("/v1/models").json()["data"]}
    assert "beta.ep" in beta_models and "smollm2-135m-instruct" in beta_models
    assert not beta_models & {"acme.prod", "acme.live"} and not any("@" in m for m in beta_models)
    assert error_of(chat(beta), 404)["code"] == "model_not_found"
    assert error_of(chat(beta, model="acme.support@1"), 404)["code"] == "model_not_found"
    assert chat(beta, model="beta.ep").headers["x-livelora-adapter-version"] == "base"
    error_of(chat(acme, model="beta.ep"), 404)
    error_of(beta.get("/v1/models/acme.prod"), 404)
    # rating another tenant's completion
    error_of(beta.post("/v1/feedback", json={"completion_id": cid, "rating": True}), 404)
    assert acme.post("/v1/feedback", json={"completion_id": cid, "rating": True}).status_code in (200, 201, 202)
    # admin objects
    acme_key_id = KeyStore(server.services.settings.home).verify(keys["acme"]).key_id
    for method, url, body in [
        ("GET", "/admin/endpoints/acme.prod", None),
        ("POST", "/admin/endpoints/acme.prod/promote", {"version": 2}),
        ("POST", "/admin/endpoints/acme.prod/rollback", {}),
        ("GET", "/admin/endpoints/acme.prod/history", None),
        ("GET", "/admin/adapters/acme.support@1", None),
        ("DELETE", "/admin/adapters/acme.support@3", None),
        ("POST", "/admin/adapters/acme.support@1/export", {"format": "peft"}),
        ("GET", "/admin/exports/acme.support@1/peft", None),
        ("GET", "/admin/adapters?lineage=acme.support", None),
        ("DELETE", f"/admin/keys/{acme_key_id}", None),
    ]:
        error_of(beta.request(method, url, json=body), 404)
    assert [e["name"] for e in beta.get("/admin/endpoints").json()["data"]] == ["beta.ep"]
    assert beta.get("/admin/adapters").json()["data"] == []
    assert {k["tenant"] for k in beta.get("/admin/keys").json()["data"]} == {"beta"}
    assert all(h["endpoint"] == "beta.ep" for h in beta.get("/admin/history").json()["data"])
    # names are per tenant: acme's lineage lies in acme's namespace, so beta's try is the rule's 400
    stolen = error_of(beta.post("/admin/endpoints", json={"name": "beta.steal", "lineage": LINEAGE}), 400)
    assert stolen["param"] == "lineage" and stolen["code"] == "name_not_in_namespace"
    # training sessions: X-API-Key, as the tinker SDK sends it
    s = httpx.post(server.url("/api/v1/create_session"), json={}, headers={"X-API-Key": keys["train"]})
    assert s.status_code == 200, s.text
    sid = s.json()["session_id"]
    beta_hdr = {"X-API-Key": keys["beta"]}
    error_of(httpx.post(server.url("/api/v1/session_heartbeat"), json={"session_id": sid}, headers=beta_hdr), 404)
    error_of(httpx.post(server.url(f"/api/v1/sessions/{sid}/finish"), json={}, headers=beta_hdr), 404)
    error_of(httpx.get(server.url(f"/api/v1/training_runs/{sid}:train:0"), headers=beta_hdr), 404)
    assert (
        httpx.post(
            server.url("/api/v1/session_heartbeat"), json={"session_id": sid}, headers={"X-API-Key": keys["train"]}
        ).status_code
        == 200
    )
    acme.close()
    beta.close()


def test_shared_base_model_serves_other_tenants_untouched_base_weights(server, keys):
    """The base model's name is public, but the versions its feedback trained belong to tenant 'default'."""
    acme = client(server, keys["acme"])
    deadline = time.monotonic() + 60  # the gateway installs BASE@1 at start-up (store catch-up)
    while f"{BASE}@1" not in server.services.registry.loaded and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"{BASE}@1" in server.services.registry.loaded
    r = chat(acme, model=BASE)
    assert r.status_code == 200 and r.headers["x-livelora-adapter-version"] == "base"
    assert r.json()["system_fingerprint"].endswith("base")
    error_of(chat(acme, model=f"{BASE}@1"), 404)
    err = error_of(acme.post("/v1/feedback", json={"completion_id": r.json()["id"], "rating": True}), 409)
    assert err["code"] == "not_trainable" and err["param"] == "model"
    demo = {"model": BASE, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi!"}]}
    assert error_of(acme.post("/v1/demonstrations", json=demo), 409)["code"] == "not_trainable"
    acme.close()


def test_admin_promote_needs_a_version_or_follow(server, keys):
    acme = client(server, keys["acme"])
    assert error_of(acme.post("/admin/endpoints/acme.prod/promote", json={}), 400)["param"] == "version"
    assert (
        error_of(acme.post("/admin/endpoints/acme.prod/promote", json={"version": 2, "follow": True}), 400)["param"]
        == "follow"
    )
    acme.close()


def test_bad_names_and_oversize_bodies_are_rejected(server, keys):
    with client(server, keys["acme"]) as http:
        for name in ("../x", "a/../b", "a//b", "x\x01y", "x" * 200, "", "/abs", "a b"):
            error_of(http.post("/admin/endpoints", json={"name": name, "lineage": "acme.ok"}), 400)
        for lineage in ("../etc", "a/b", "..", "A" * 70, "x\x00"):
            assert (
                error_of(http.post("/admin/endpoints", json={"name": "acme.fine", "lineage": lineage}), 400)["param"]
                == "lineage"
            )
        for name in ("..%2F..%2Fetc@1", "acme.support@0", "acme.support@x", "UP@1"):
            assert http.get(f"/admin/adapters/{name}").status_code in (400, 404)
        error_of(http.post("/admin/endpoints/acme.prod/promote", json={"version": "../../x@1"}), 400)
        err = error_of(
            http.post(
                "/v1/chat/completions",
                content=b"{" + b" " * (70 * 1024) + b"}",
                headers={"content-type": "application/json"},
            ),
            413,
        )
        assert err["code"] == "payload_too_large"
    for sid in ("../../etc", "a/b", "x\ny", "s" * 200):
        r = httpx.post(
            server.url("/api/v1/session_heartbeat"), json={"session_id": sid}, headers={"X-API-Key": keys["train"]}
        )
        assert r.status_code in (400, 404) and r.status_code != 200
        if "/" in sid or "\n" in sid or len(sid) > 128:
            assert r.status_code == 400, (sid, r.text)
    assert not any(".." in p.name for p in (server.services.settings.home / "adapters").iterdir())


def test_served_version_is_reported_by_redis_completion_log(server, keys):
    """Completions are kept per tenant: the log's record carries the tenant as caller."""
    with client(server, keys["acme"]) as http:
        r = chat(http, model="acme.live")
    rec = redis.Redis.from_url(os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0")).get(
        KeyLayout(PREFIX).completion(r.json()["id"])
    )
    assert json.loads(rec)["caller"] == "acme" and json.loads(rec)["adapter"] == "acme.support@4"


def test_rating_the_bare_id_of_an_n2_response_names_its_choice_ids(server, keys):
    """Choice k of an n>1 response is logged as ``{id}-k``: rating the bare id is a 404 that says so (to the tenant
    that made it; another tenant gets the plain unknown-id answer), and ``{id}-1`` is accepted."""
    with client(server, keys["acme"]) as http:
        r = chat(http, model="acme.live", n=2)
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        assert len(r.json()["choices"]) == 2
        err = error_of(http.post("/v1/feedback", json={"completion_id": cid, "rating": True}), 404)
        assert err["param"] == "completion_id"
        assert "had 2 choices" in err["message"] and f"'{cid}-0' to '{cid}-1'" in err["message"], err
        ok = http.post("/v1/feedback", json={"completion_id": f"{cid}-1", "rating": True})
        assert ok.status_code == 200, ok.text
        assert ok.json()["completion_id"] == f"{cid}-1"
    with client(server, keys["beta"]) as http:
        err = error_of(http.post("/v1/feedback", json={"completion_id": cid, "rating": True}), 404)
        unknown = error_of(http.post("/v1/feedback", json={"completion_id": "chatcmpl-nosuch", "rating": True}), 404)
        assert "choices" not in err["message"]
        assert err["message"].replace(cid, "X") == unknown["message"].replace("chatcmpl-nosuch", "X")


def test_sdk_without_a_key_says_none_was_configured(server, keys, monkeypatch):
    """livelora's SDK with no key configured sends the open-server placeholder; a server with keys refuses it, and
    the error says that no key was configured and which variables to set (a wrong key keeps the server's answer)."""
    from livelora.clients import ServiceClient
    from livelora.clients.errors import AuthenticationError

    for var in ("LIVELORA_API_KEY", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AuthenticationError) as info:
        ServiceClient(server.base_url).get_server_capabilities()
    message = str(info.value)
    assert message.startswith("no API key configured") and "'tml-local'" in message
    assert "LIVELORA_API_KEY or TINKER_API_KEY" in message and "invalid or revoked API key" in message
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong")
    with pytest.raises(AuthenticationError) as info:
        ServiceClient(server.base_url).get_server_capabilities()
    assert str(info.value) == "invalid or revoked API key"
    monkeypatch.setenv("LIVELORA_API_KEY", keys["acme"])  # read first
    caps = ServiceClient(server.base_url).get_server_capabilities()
    assert caps.supported_models[0].model_name == BASE


# ---------------------------------------------------------------------------------------------- promotion


def _streams(server, key, n, results, started, max_tokens=24):
    def one(i):
        try:
            with (
                httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as http,
                http.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "acme.prod",
                        "messages": PROMPT,
                        "stream": True,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                    },
                ) as r,
            ):
                version = r.headers.get("x-livelora-adapter-version")
                fingerprints, ok = set(), r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        ok = ok and "error" not in data
                        fingerprints.add(data.get("system_fingerprint"))
                        started[i].set()
                    elif line == "data: [DONE]":
                        results[i] = (ok, version, fingerprints)
        except Exception as exc:  # recorded as a failure
            results[i] = (False, repr(exc), set())
        finally:
            started[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _change_under_load(server, keys, action, body, before, after):
    n = 8
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]
    threads = _streams(server, keys["acme"], n, results, started)
    assert all(e.wait(120) for e in started)
    with client(server, keys["admin"]) as admin:
        r = admin.post(f"/admin/endpoints/acme.prod/{action}", json=body)
        assert r.status_code == 200, r.text
        entry = r.json()["history"]
        assert (entry["from"], entry["to"], entry["action"]) == (before, after, action)
    for t in threads:
        t.join(300)
    assert all(res is not None and res[0] for res in results), results  # zero failed requests
    for _ok, version, fps in results:  # each stream names one version, the one it started on
        assert version == before and fps == {f"livelora-{before}"}
    after_results: list = [None] * n
    threads = _streams(server, keys["acme"], n, after_results, [threading.Event() for _ in range(n)], 4)
    for t in threads:
        t.join(300)
    assert all(ok and version == after and fps == {f"livelora-{after}"} for ok, version, fps in after_results)


def test_promote_and_rollback_under_eight_streams(server, keys):
    _change_under_load(
        server, keys, "promote", {"version": "acme.support@2", "reason": "better"}, "acme.support@1", "acme.support@2"
    )
    _change_under_load(server, keys, "rollback", {"reason": "regression"}, "acme.support@2", "acme.support@1")
    with client(server, keys["admin"]) as admin:
        hist = admin.get("/admin/endpoints/acme.prod/history").json()["data"]
        assert [(h["action"], h["from"], h["to"], h["reason"]) for h in hist] == [
            ("create", None, "acme.support@1", ""),
            ("promote", "acme.support@1", "acme.support@2", "better"),
            ("rollback", "acme.support@2", "acme.support@1", "regression"),
        ]
        assert hist[1]["who"].startswith("acme/acme-admin") and hist[0]["who"].startswith("local:")
        assert all(h["tenant"] == "acme" and h["time"] > 0 for h in hist)
        # a version an endpoint targets cannot be deleted: prod pins @1, live follows the newest (@4)
        for name in ("acme.support@1", "acme.support@4"):
            assert error_of(admin.delete(f"/admin/adapters/{name}"), 409)["code"] == "version_in_use"
        assert admin.delete("/admin/adapters/acme.support@3").status_code == 200
        error_of(admin.get("/admin/adapters/acme.support@3"), 404)
        error_of(admin.post("/admin/endpoints/acme.prod/rollback", json={}), 409)  # nothing left to undo
        listed = {a["name"]: a["serving"] for a in admin.get("/admin/adapters").json()["data"]}
        assert listed == {"acme.support@1": ["acme.prod"], "acme.support@2": [], "acme.support@4": ["acme.live"]}


def test_bindings_survive_restart(server, keys, home):
    with client(server, keys["admin"]) as admin:
        assert admin.post("/admin/endpoints/acme.prod/promote", json={"version": 2}).status_code == 200
    server.stop()
    from livelora.gateway.settings import GatewaySettings

    again = start_server(GatewaySettings(model="smollm2-135m-instruct", home=home, device="cpu", redis_prefix=PREFIX))
    try:
        with client(again, keys["acme"]) as http:
            assert chat(http).headers["x-livelora-adapter-version"] == "acme.support@2"
            assert chat(http, model="acme.live").headers["x-livelora-adapter-version"] == "acme.support@4"
    finally:
        again.stop()
    # a fresh process (as a restarted trainer) reads the same bindings from the store
    listed = _cli("endpoints", "list", "--home", str(home))
    assert "acme.prod" in listed and "(public)" in listed  # the base model's own endpoint is listed too
    from livelora.cli.admin_common import Backend

    serving = {e["name"]: e["serving"] for e in Backend("http://unused", None, home).list_endpoints()}
    assert serving["acme.prod"] == "acme.support@2" and serving["acme.live"] == "acme.support@4"
    assert "smollm2-135m-instruct" in serving
    versions = _cli("adapters", "list", "--home", str(home), env={"COLUMNS": "80"})  # version names never shortened
    assert max(map(len, versions.splitlines())) <= 80 and "│ smollm2-135m-instruct@1 │" in versions, versions
    from livelora.adapters.endpoints import EndpointStore

    assert EndpointStore(home).get("acme.prod").lineage == LINEAGE  # what the trainer maps events with


# ---------------------------------------------------------------------------------------------- export


def test_export_round_trips(home, keys, base_ref, tokenizer, tmp_path):
    """The PEFT export scores like the stored version; the merged model's logits match base+adapter."""
    from peft import PeftModel

    from livelora.core.base_models import load_model
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    _cli("adapters", "export", "acme.support@2", "--format", "peft", "--out", str(peft_dir), "--home", str(home))
    _cli("adapters", "export", "acme.support@2", "--format", "merged", "--out", str(merged_dir), "--home", str(home))
    stored = AdapterStore(home).version_dir(LINEAGE, 2)
    assert (peft_dir / "adapter_model.safetensors").read_bytes() == (stored / "adapter_model.safetensors").read_bytes()
    ids = torch.tensor([tokenizer("An exported adapter must say what the served one says.")["input_ids"]])
    with torch.no_grad():
        exported = PeftModel.from_pretrained(load_model(base_ref), str(peft_dir)).eval()
        lp_exported = torch.log_softmax(exported(ids).logits.float(), -1)
        served = PeftModel.from_pretrained(load_model(base_ref), str(stored)).eval()
        lp_served = torch.log_softmax(served(ids).logits.float(), -1)
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        logits_merged = merged(ids).logits
        logits_adapter = exported(ids).logits
        # the exported weights themselves: both models evaluated in float64, so only the export's one
        # rounding to float32 remains
        exact = PeftModel.from_pretrained(load_model(base_ref, dtype=torch.float64), str(peft_dir)).eval()
        diff64 = (merged.to(torch.float64)(ids).logits - exact(ids).logits).abs().max().item()
    assert torch.equal(lp_exported, lp_served)
    assert diff64 < 1e-4
    # in float32 the two evaluation orders (W·x + B·A·x vs (W + B·A)·x) add rounding noise on logits of ~20
    assert (logits_merged - logits_adapter).abs().max().item() < 1e-3
    # the base model differs: the adapter really is in the merged weights
    with torch.no_grad():
        assert (load_model(base_ref)(ids).logits - logits_merged).abs().max().item() > 1e-3
    # the API export path writes the same directory once (versions are immutable)
    svc = StoreAdmin(home, tenant="acme")
    first = svc.versions.export("acme.support@2", "peft")
    assert svc.versions.export("acme.support@2", "peft") == first and (first / "adapter_config.json").is_file()


def test_open_mode_and_public_bind_rules(tmp_path):
    from livelora.clients.errors import BadRequestError
    from livelora.gateway.middleware.auth import check_bind

    store = KeyStore(tmp_path)
    assert check_bind("127.0.0.1", store, False) is True and check_bind("::1", store, False) is True
    with pytest.raises(BadRequestError, match="--allow-open"):
        check_bind("0.0.0.0", store, False)
    assert check_bind("0.0.0.0", store, True) is True
    store.create("default", ["admin"])
    assert check_bind("0.0.0.0", store, False) is False


def test_the_served_base_models_own_endpoint_is_administered_like_the_others(base_ref, tmp_path):
    """The base model's served name is an implicit endpoint (it follows the lineage of the same name): admin
    lists it with the version it serves, shows its history, marks its version as served, and may promote and
    roll it back (a change makes it explicit); it belongs to tenant default, so another tenant sees none of it."""
    from livelora.adapters.endpoints import record_install_owners
    from livelora.clients.errors import NotFoundError
    from livelora.gateway.services.tenants.store_admin import StoreAdmin
    from livelora.trainer.model import TrainingModel

    base = "smollm2-135m-instruct"
    record_install_owners(tmp_path, base)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    for _ in (1, 2):
        tm.save_weights(AdapterStore(tmp_path), base)
    svc = StoreAdmin(tmp_path, tenant="default", base_endpoints=(base,))
    [shown] = svc.list_endpoints()
    assert (shown["name"], shown["lineage"], shown["mode"], shown["serving"]) == (base, base, "follow", f"{base}@2")
    assert svc.get_endpoint(base)["serving"] == f"{base}@2"
    assert [(a["name"], a["serving"]) for a in svc.versions.list_adapters(base)] == [
        (f"{base}@1", []),
        (f"{base}@2", [base]),
    ]
    entry = svc.promote(base, "1", who="key:test", reason="pin the first")
    assert (entry.action, entry.from_, entry.to) == ("promote", f"follow:{base}@2", f"{base}@1")
    assert svc.get_endpoint(base)["serving"] == f"{base}@1"
    assert svc.rollback(base, who="key:test").to == f"{base}@2"
    assert [h.action for h in svc.history(base)] == ["promote", "rollback"]
    other = StoreAdmin(tmp_path, tenant="acme", base_endpoints=(base,))
    assert other.list_endpoints() == [] and other.history(base) == []
    with pytest.raises(NotFoundError):
        other.get_endpoint(base)
    with pytest.raises(NotFoundError):
        other.promote(base, "1", who="key:acme")
    # the promotion made it explicit: listed even by an admin view that does not know the served name
    assert [e["name"] for e in StoreAdmin(tmp_path, tenant="default").list_endpoints()] == [base]
