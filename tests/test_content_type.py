"""A body not declared as JSON gets a 400 that says so, on every JSON route (issue 14).

``curl -d '{...}'`` sends ``content-type: application/x-www-form-urlencoded``; FastAPI then validates the raw
bytes and the answer used to be "Input should be a valid dictionary" with ``param: null``. The routes are taken
from the app's OpenAPI (every POST; the Tinker routes decode their bodies themselves), so a new route is covered.
"""

from __future__ import annotations

import re

import httpx
import pytest
from harness.server import MODEL

from livelora.gateway.envelopes import is_anthropic

#: POST routes that take no body at all (the tinker SDK's configuration probes).
NO_BODY = {"/api/v1/client/config", "/api/v1/client/dynamic_config"}


def json_routes(app) -> list[str]:
    paths = [path for path, ops in app.openapi()["paths"].items() if "post" in ops and path not in NO_BODY]
    return [re.sub(r"\{[^}]+\}", "x", path) for path in paths]


def test_every_json_route_names_the_wrong_content_type(live_server):
    routes = json_routes(live_server.app)
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/feedback",
        "/admin/endpoints",
        "/api/v1/asample",
        "/api/v1/forward_backward",
    } <= set(routes)
    for path in routes:
        for ctype, body in (
            ("application/x-www-form-urlencoded", "model=x&prompt=hi"),
            ("text/plain", f'{{"model": "{MODEL}", "prompt": "hi"}}'),
        ):
            r = httpx.post(live_server.url(path), content=body, headers={"content-type": ctype}, timeout=30)
            assert r.status_code == 400, (path, ctype, r.text)
            err = r.json()["error"]
            assert ctype in err["message"] and "content-type: application/json" in err["message"], err
            assert err["type"] == "invalid_request_error"
            if is_anthropic(path):  # Anthropic's envelope: {"type": "error", "error": {"type", "message"}}
                assert r.json()["type"] == "error" and set(err) == {"type", "message"}, (path, err)
            else:
                assert err["code"] == "unsupported_content_type" and err["param"] is None, (path, err)


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_bodies_are_read_under_a_json_content_type(live_server, ctype):
    body = f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1}}'
    r = httpx.post(live_server.url("/v1/completions"), content=body, headers={"content-type": ctype}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_body_without_content_type_is_told_to_declare_json(live_server):
    for path in ("/v1/chat/completions", "/v1/feedback", "/admin/keys", "/api/v1/asample"):
        r = httpx.post(live_server.url(path), content=f'{{"model": "{MODEL}"}}', timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_content_type" and "no content-type header" in err["message"], err
    # a JSON content-type with a body that is not JSON is a JSON error
    r = httpx.post(
        live_server.url("/v1/chat/completions"),
        content="model=x",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
