"""The admin console over HTTP (no browser): log-in, the session cookie's flags, CSRF and same-origin checks on
every POST, each page of two tenants, and actions that write the same history as the CLI, through one live
gateway on the real model and Redis (its own store: keys switch it to key mode). Browser tests:
``tests/test_console_browser.py``."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from harness.bus import new_prefix
from harness.console import console_client, login
from harness.seeds import randomize_lora_b

from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import LoraConfig
from livelora.core.api_keys import TENANT_ROLES

LINEAGE = "acme.support"
PREFIX = new_prefix("console")
KEYS = {
    "acme": ("acme", TENANT_ROLES),
    "beta": ("beta", TENANT_ROLES),
    "acme-inference": ("acme", ("inference", "feedback")),
}
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX}
PROMPT = [{"role": "user", "content": "Say something about the sea."}]


def seed_home(home, base_ref) -> None:
    """acme.support@1..3 (different random lora_B)."""
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        randomize_lora_b(tm, g, 0.05)
        tm.save_weights(store, LINEAGE)


@pytest.fixture(scope="module")
def endpoints(server, keys):
    """acme.prod pinned to @1, acme.live following the lineage; beta.ep on its own lineage."""
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]}, timeout=60) as a:
        for body in (
            {"name": "acme.prod", "lineage": LINEAGE, "mode": "pinned", "version": 1, "reason": "first release"},
            {"name": "acme.live", "lineage": LINEAGE},
        ):
            assert a.post("/admin/endpoints", json=body).status_code == 201
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["beta"]}, timeout=60) as b:
        assert b.post("/admin/endpoints", json={"name": "beta.ep", "lineage": "beta.l"}).status_code == 201
    return ["acme.prod", "acme.live", "beta.ep"]


def chat(server, key, model):
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"X-API-Key": key},
        json={"model": model, "messages": PROMPT, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


# ---------------------------------------------------------------------------------------------- log-in


def test_log_in_sets_a_signed_httponly_strict_cookie_not_the_key(server, keys, endpoints):
    r = login(server.base_url, keys["acme"])
    assert r.status_code == 303 and r.headers["location"] == "/console/endpoints"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert "Secure" not in cookie  # served over plain http here: a Secure cookie would never come back
    value = re.match(r"livelora_console=([^;]+)", cookie).group(1)
    assert keys["acme"] not in value and keys["acme"].split("-")[2] not in value
    _payload, mac = value.split(".")
    assert len(mac) == 64


@pytest.mark.parametrize(
    ("key", "status"), [("tml-000000000000-wrong", 401), ("", 401), (None, 401), ("acme-inference", 403)]
)
def test_a_wrong_or_non_admin_key_is_refused(server, keys, endpoints, key, status):
    r = login(server.base_url, keys.get(key, key))
    err = r.json()["error"]
    assert r.status_code == status and set(err) == {"message", "type", "param", "code"}
    assert "set-cookie" not in r.headers
    page = httpx.post(  # a browser gets the form again, with the message
        f"{server.base_url}/console/login",
        data={"key": keys.get(key, key) or ""},
        headers={"Origin": server.base_url, "Accept": "text/html"},
    )
    assert page.status_code == status and 'id="error"' in page.text and "set-cookie" not in page.headers


def test_without_a_session_a_browser_goes_to_the_log_in_page(server, endpoints):
    r = httpx.get(f"{server.base_url}/console/endpoints", headers={"Accept": "text/html"})
    assert r.status_code == 303 and r.headers["location"] == "/console/login?next=/console/endpoints"
    api = httpx.get(f"{server.base_url}/console/endpoints")
    assert api.status_code == 401 and api.json()["error"]["type"] == "authentication_error"
    key_header = httpx.get(f"{server.base_url}/console/endpoints", headers={"X-API-Key": "tml-x"})
    assert key_header.status_code == 401  # the console's credential is its session cookie only


def test_every_console_page_answers_for_a_logged_in_admin(server, keys, endpoints):
    with console_client(server.base_url, keys["acme"]) as c:
        for path in (
            "/console/endpoints",
            "/console/endpoints/acme.prod",
            f"/console/lineages/{LINEAGE}",
            f"/console/versions/{LINEAGE}@2",
            "/console/charts",
            "/console/feedback",
            "/console/sessions",
        ):
            r = c.get(path, headers={"Accept": "text/html"})
            assert r.status_code == 200, (path, r.text[-2000:])
            assert (
                r.headers["x-frame-options"] == "DENY"
                and "frame-ancestors 'none'" in r.headers["content-security-policy"]
            )
        page = c.get("/console/endpoints").text
        assert "acme.prod" in page and "acme.live" in page and "beta.ep" not in page
