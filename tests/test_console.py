"""The admin console over HTTP (no browser): log-in, the session cookie's flags, CSRF and same-origin checks on
every POST, each page of two tenants, and actions that write the same history as the CLI, through one live
gateway on the real model and Redis (its own store: keys switch it to key mode). Browser tests:
``tests/test_console_browser.py``."""

from __future__ import annotations

import html
import re
import time
from importlib import resources

import httpx
import pytest
import torch
from harness.bus import new_prefix
from harness.console import console_client, login
from harness.seeds import randomize_lora_b

from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import LoraConfig
from livelora.core.api_keys import TENANT_ROLES, parse_key
from livelora.gateway.console import STATIC_FILES
from livelora.gateway.middleware.auth import app_routes

LINEAGE = "acme.support"
PREFIX = new_prefix("console")
KEYS = {
    "acme": ("acme", TENANT_ROLES),
    "beta": ("beta", TENANT_ROLES),
    "acme-inference": ("acme", ("inference", "feedback")),
    "ops": ("default", ("admin", "operator")),
}
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX, "executor_in_process": True}
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
    assert keys["acme"] not in value and parse_key(keys["acme"])[1] not in value
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
        for name, media in STATIC_FILES.items():  # each file the pages load, with its type; nothing else
            r = c.get(f"/console/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(media), name
            assert r.content == resources.files("livelora.gateway.console").joinpath("static", name).read_bytes()
        for other in ("../charts.py", "vendor/../../svg.py", "vendor/chart.umd.js"):
            assert c.get(f"/console/static/{other}").status_code == 404, other


def test_the_endpoint_page_counts_ratings_and_requests_across_its_versions(server, keys, endpoints):
    """A rating on @1, then @2 promoted and served once: the endpoint's liked share pools both versions, the
    serving version's own line says it has no rating yet, and the per-version table has a row for each."""
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]}, timeout=60) as a:
        cid = chat(server, keys["acme"], "acme.prod").json()["id"]
        assert a.post("/v1/feedback", json={"completion_id": cid, "rating": True, "user": "ann"}).status_code == 200
        body = {"version": f"{LINEAGE}@2", "reason": "try @2"}
        assert a.post("/admin/endpoints/acme.prod/promote", json=body).status_code == 200
        try:
            chat(server, keys["acme"], "acme.prod")
            with console_client(server.base_url, keys["acme"]) as c:
                page = c.get("/console/endpoints/acme.prod").text
        finally:
            assert a.post("/admin/endpoints/acme.prod/rollback", json={"reason": "back"}).status_code == 200
    cell = lambda id_: re.sub(r"<[^>]+>|\s+", " ", re.search(rf'id="{id_}">(.*?)</td>', page, re.S).group(1))  # noqa: E731
    ups, n, requests = re.search(r"\((\d+)/(\d+) ratings?, (\d+) requests?\)", cell("liked-all")).groups()
    assert int(n) >= 1 and int(ups) >= 1 and int(requests) >= 2
    assert "no ratings yet (1 request)" in cell("liked-serving")
    rows = re.findall(r'<tr data-version="([^"]+)">', page)
    assert f"{LINEAGE}@1" in rows and f"{LINEAGE}@2" in rows and rows[-1] == "all"
    assert "serving</span>" in page.split(f'data-version="{LINEAGE}@2"')[1].split("</tr>")[0]


def test_requests_the_base_model_answered_are_counted_with_its_ratings(server, keys, endpoints):
    """beta.ep has no version yet: its chats are served by the base model and counted on the ``base`` row."""
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["beta"]}, timeout=60) as b:
        cid = chat(server, keys["beta"], "beta.ep").json()["id"]
        assert b.post("/v1/feedback", json={"completion_id": cid, "rating": False, "user": "bo"}).status_code == 200
    with console_client(server.base_url, keys["beta"]) as c:
        page = c.get("/console/endpoints/beta.ep").text
    row = page.split('<tr data-version="base">')[1].split("</tr>")[0]
    requests, ratings = (int(n) for n in re.findall(r"<td>(\d+)</td>", row)[:2])
    assert requests >= 1 and ratings >= 1


# ---------------------------------------------------------------------------------------------- CSRF


def console_posts(app) -> list[str]:
    """Every console POST route but the log-in, with acme's names filled in."""
    paths = [p for m, p in app_routes(app) if m == "POST" and p.startswith("/console/") and p != "/console/login"]
    return [p.replace("{name:path}", "acme.prod").replace("{name}", f"{LINEAGE}@2") for p in paths]


def test_every_console_post_needs_its_own_origin_and_the_sessions_csrf_token(server, keys, endpoints, home):
    """Generated from the route table: another origin, an opaque or missing one, no token, a wrong token and another
    session's token are each refused (403) with the session cookie present, and nothing changes."""
    from livelora.adapters.endpoints import EndpointStore

    posts = console_posts(server.app)
    assert len(posts) >= 8 and "/console/endpoints/acme.prod/promote" in posts
    before = EndpointStore(home).history()
    form = {"version": f"{LINEAGE}@2", "reason": "csrf", "format": "peft", "user": "ann"}
    with console_client(server.base_url, keys["acme"]) as a, console_client(server.base_url, keys["beta"]) as b:
        cookies, token = a.cookies, a.headers["X-CSRF-Token"]
        for url in posts:
            for origin in ("http://evil.example", "null", server.base_url.replace("127.0.0.1", "localhost")):
                r = a.post(url, data=form, headers={"Origin": origin})
                assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", (url, origin, r.text)
            r = httpx.post(server.base_url + url, data=form, cookies=cookies, headers={"X-CSRF-Token": token})
            assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", (url, "no origin", r.text)
            assert "(origin (none);" in r.json()["error"]["message"]
            referer = {"Referer": f"{server.base_url}/console/endpoints", "X-CSRF-Token": "0" * 64}
            r = httpx.post(server.base_url + url, data=form, cookies=cookies, headers=referer)
            assert r.status_code == 403 and r.json()["error"]["code"] == "csrf", (url, "referer, wrong token")
            for given in ("", "0" * 64, b.headers["X-CSRF-Token"]):
                r = a.post(url, data=form, headers={"X-CSRF-Token": given})
                assert r.status_code == 403 and r.json()["error"]["code"] == "csrf", (url, given, r.text)
        page = a.get("/console/endpoints/acme.prod", headers={"Accept": "text/html"}).text
    assert EndpointStore(home).history() == before
    assert f'id="serving"><a href="/console/versions/{LINEAGE}%401">{LINEAGE}@1' in page.replace("\n", "")


def test_log_in_from_another_origin_is_refused_and_next_stays_on_the_console(server, keys, endpoints):
    r = httpx.post(
        f"{server.base_url}/console/login", data={"key": keys["acme"]}, headers={"Origin": "http://x.example"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site" and "set-cookie" not in r.headers
    for target, lands in (("//evil.example/x", "/console/endpoints"), ("/console/charts", "/console/charts")):
        r = httpx.post(
            f"{server.base_url}/console/login",
            data={"key": keys["acme"], "next": target},
            headers={"Origin": server.base_url},
        )
        assert r.status_code == 303 and r.headers["location"] == lands


def test_log_out_and_a_revoked_key_end_the_session(server, keys, endpoints, home):
    from livelora.core.api_keys import KeyStore

    with console_client(server.base_url, keys["acme"]) as c:
        cookies = dict(c.cookies)
        r = c.post("/console/logout")
        assert r.status_code == 303 and 'livelora_console=""' in r.headers["set-cookie"]
        assert not c.cookies.get("livelora_console")  # cleared in the client
    r = httpx.get(f"{server.base_url}/console/endpoints", cookies=cookies)  # the old cookie, replayed
    assert r.status_code == 401
    spare_key = KeyStore(home).create("acme", ["admin"], name="spare")[1]
    with console_client(server.base_url, spare_key) as c:
        assert c.get("/console/endpoints").status_code == 200
        KeyStore(home).revoke(KeyStore(home).verify(spare_key).key_id)
        assert c.get("/console/endpoints").status_code == 401


# ---------------------------------------------------------------------------------------------- actions and data


def test_pause_and_resume_learning_are_recorded_like_the_cli(server, keys, endpoints, home):
    from livelora.adapters.endpoints import EndpointStore

    with console_client(server.base_url, keys["acme"]) as c:
        r = c.post("/console/endpoints/acme.live/pause", data={"reason": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reason"  # the console asks for a reason
        r = c.post("/console/endpoints/acme.live/pause", data={"reason": "reviewing ratings"})
        assert r.status_code == 303 and r.headers["location"] == "/console/endpoints/acme.live"
        entry = EndpointStore(home).history("acme.live")[-1]
        assert (entry.action, entry.reason, entry.tenant) == ("pause", "reviewing ratings", "acme")
        assert entry.who.startswith("acme/acme ") and EndpointStore(home).paused_lineages() == {LINEAGE}
        learning = httpx.get(f"{server.base_url}/v1/learning/acme.live", headers={"X-API-Key": keys["acme"]}).json()
        assert learning["paused"] is True and learning["eta_s"] is None
        page = c.get("/console/endpoints", headers={"Accept": "text/html"}).text
        assert "learning paused" in page and 'data-action="resume"' in page
        assert c.post("/console/endpoints/acme.live/resume", data={"reason": "done"}).status_code == 303
        assert EndpointStore(home).history("acme.live")[-1].action == "resume"
        assert EndpointStore(home).paused_lineages() == set()


def test_feedback_page_shows_the_rated_completion_and_forget_deletes_it(server, keys, endpoints):
    r = chat(server, keys["acme"], "acme.prod")
    cid, text = r.json()["id"], r.json()["choices"][0]["message"]["content"]
    rated = httpx.post(
        f"{server.base_url}/v1/feedback",
        headers={"X-API-Key": keys["acme"]},
        json={"completion_id": cid, "rating": False, "comment": "too terse", "user": "zed"},
    )
    assert rated.status_code == 200, rated.text
    with console_client(server.base_url, keys["acme"]) as c, console_client(server.base_url, keys["beta"]) as b:
        page = c.get("/console/feedback").text
        row = page[page.index(f'data-id="{rated.json()["id"]}"') :].split("</tr>")[0]
        assert "too terse" in row and ">zed<" in row.replace(" (", "<") and ">down<" in row
        assert text.strip() in row.replace("&#39;", "'").replace("&#34;", '"').replace("&amp;", "&")
        assert rated.json()["id"] not in b.get("/console/feedback").text
        r = c.post("/console/users/forget", data={"user": "zed", "reason": "asked to be forgotten"})
        assert r.status_code == 303 and r.headers["location"] == "/console/feedback"


def session_with_model(client: httpx.Client) -> tuple[str, dict]:
    """A training session of ``client``'s tenant and its ``create_model`` answer (a rank-2 LoRA on the base)."""
    sid = client.post("/api/v1/create_session", json={}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "smollm2-135m-instruct", "lora_config": {"rank": 2}}
    return sid, client.post("/api/v1/create_model", json=body).json()


def test_sessions_page_lists_the_tenants_runs_with_signed_archive_links(server, keys, endpoints):
    def future(c, request_id):
        while (r := c.post("/api/v1/retrieve_future", json={"request_id": request_id})).status_code == 408:
            pass
        assert r.status_code == 200 and "error" not in r.json(), r.text

    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]}, timeout=120) as a:
        sid, made = session_with_model(a)
        future(a, made["request_id"])
        saved = a.post("/api/v1/save_weights", json={"model_id": made["model_id"], "seq_id": 1, "path": "w1"}).json()
        future(a, saved["request_id"])
    with console_client(server.base_url, keys["acme"]) as c, console_client(server.base_url, keys["beta"]) as b:
        page = c.get("/console/sessions").text
        assert sid in page and made["model_id"] in page and "weights/w1" in page
        used = re.search(r"<td>training sessions alive now</td><td>(\d+)</td>", page).group(1)
        alive = page.count('<span class="badge ok">alive</span>')
        assert int(used) == alive >= 1  # the quota counts what the list shows alive
        url = re.search(r'href="([^"]+/api/v1/checkpoint_archives/[^"]+)"', page).group(1).replace("&amp;", "&")
        archive = httpx.get(url)
        assert archive.status_code == 200 and archive.content[257:262] == b"ustar"  # a tar file
        assert sid not in b.get("/console/sessions").text


def test_the_cookie_is_secure_over_https(tmp_path):
    """Served over https (here: the ASGI scheme of a test client), the session cookie gets ``Secure``."""
    from fastapi.testclient import TestClient

    from livelora.core.api_keys import KeyStore
    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    key = KeyStore(tmp_path).create("acme", ["admin"])[1]
    app = create_app(GatewaySettings(home=tmp_path, model="smollm2-135m-instruct"))
    web = TestClient(app, base_url="https://console.example")  # no lifespan: log-in needs no engine
    r = web.post(
        "/console/login", data={"key": key}, headers={"Origin": "https://console.example"}, follow_redirects=False
    )
    assert r.status_code == 303 and "Secure" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
    r = web.post(
        "/console/login", data={"key": key}, headers={"Origin": "http://console.example"}, follow_redirects=False
    )
    assert r.status_code == 403  # the http origin of the same host is another origin


def test_the_vendored_files_are_the_files_their_notes_name_and_ship_their_licences():
    import hashlib
    from importlib import resources

    from livelora.gateway.console import STATIC_FILES, VENDORED

    files = resources.files("livelora.gateway.console")
    for name, note in VENDORED.items():
        assert hashlib.sha256(files.joinpath("static", name).read_bytes()).hexdigest() == note["sha256"]
        assert name in STATIC_FILES and note["license"].split(", ")[1].removeprefix("static/") in STATIC_FILES
    assert "Zero-Clause BSD" in files.joinpath("static", "htmx.LICENSE").read_text()
    assert "The MIT License" in files.joinpath("static", "vendor", "chart.js.LICENSE").read_text()
    templates = [p.name for p in files.joinpath("templates").iterdir()]
    assert all("cdn" not in files.joinpath("templates", t).read_text().lower() for t in templates)


def test_the_operator_sees_every_tenants_usage_and_latency_a_tenant_does_not(server, keys, endpoints):
    chat(server, keys["beta"], "beta.ep")
    chat(server, keys["acme"], "acme.prod")
    with console_client(server.base_url, keys["ops"]) as o, console_client(server.base_url, keys["acme"]) as a:
        charts = o.get("/console/charts").text
        assert "HTTP latency of this gateway process" in charts and "POST /v1/chat/completions" in charts
        assert "HTTP latency" not in a.get("/console/charts").text
        usage = o.get("/console/sessions").text
        assert "<td>acme</td>" in usage and "<td>beta</td>" in usage and "tenant beta" in usage
        mine = a.get("/console/sessions").text
        assert "tenant acme" in mine and "beta" not in mine


def test_the_operator_sees_every_tenants_endpoints_and_versions_but_changes_none(server, keys, endpoints):
    acme = httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]})
    before = acme.get("/admin/endpoints/acme.prod").json()
    with console_client(server.base_url, keys["ops"]) as o, console_client(server.base_url, keys["beta"]) as b:
        page = o.get("/console/endpoints").text
        for name, tenant in (("acme.prod", "acme"), ("acme.live", "acme"), ("beta.ep", "beta")):
            row = re.search(rf'<tr data-endpoint="{re.escape(name)}">(.*?)</tr>', page, re.S).group(1)
            assert f'<td class="tenant">{tenant}</td>' in row and "its tenant's admins" in row
            assert "/promote" not in row  # no action forms on another tenant's endpoint
        one = o.get("/console/endpoints/acme.prod")
        assert one.status_code == 200 and "Tenant acme's endpoint" in one.text
        version = o.get(f"/console/versions/{LINEAGE}@1")
        assert (
            version.status_code == 200 and "Another tenant's version" in version.text and "/export" not in version.text
        )
        # a first version's parent is the base model, said once (not in the live statistics' empty interval cell)
        assert "<tr><th>parent</th><td>none: trained from the base model</td></tr>" in version.text
        assert version.text.count("trained from the base model") == 1
        r = o.post("/console/endpoints/acme.prod/promote", data={"version": f"{LINEAGE}@2", "reason": "not mine"})
        assert r.status_code == 404  # changes stay in the operator's own tenant
        assert o.post(f"/console/versions/{LINEAGE}@1/export", data={"format": "peft"}).status_code == 404
        assert "acme.support" not in o.get("/console/feedback").text  # end users' ids stay with their tenant
        assert "acme.prod" not in b.get("/console/endpoints").text  # a tenant's admin sees its own only
        assert b.get("/console/endpoints/acme.prod").status_code == 404
    assert acme.get("/admin/endpoints/acme.prod").json() == before  # unchanged
    acme.close()


def test_open_mode_enters_with_one_button_and_the_first_key_ends_those_sessions(tmp_path):
    """A gateway without keys: the log-in page offers to enter, the session works (its actions still need the
    CSRF token); once a key exists, the open session is refused and a key is asked for."""
    from fastapi.testclient import TestClient

    from livelora.core.api_keys import KeyStore
    from livelora.gateway.app import create_app
    from livelora.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(home=tmp_path, model="smollm2-135m-instruct"))
    web = TestClient(app, base_url="http://localhost")  # no lifespan: the endpoints page reads the store only
    assert 'id="login">Enter the console' in web.get("/console/login").text
    r = web.post("/console/login", data={}, headers={"Origin": "http://localhost"}, follow_redirects=False)
    assert r.status_code == 303
    page = web.get("/console/endpoints", headers={"Accept": "text/html"})
    assert page.status_code == 200 and 'id="tenant">default<' in page.text
    r = web.post("/console/endpoints/x/pause", data={"reason": "r"}, headers={"Origin": "http://localhost"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf"
    KeyStore(tmp_path).create("acme", ["admin"])
    assert web.get("/console/endpoints").status_code == 401
    assert 'id="key"' in web.get("/console/login").text


# ---------------------------------------------------------------------------------------------- for people

#: What a page must not show a person: an ISO 8601 timestamp (a training session's raw times) or Unix seconds.
ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d+)?)?")
UNIX_TIME = re.compile(r"(?<![\d.])1\d{9}(\.\d+)?(?![\d.])")
#: ... nor a machine name in snake_case (file names such as adapter_config.json and URL paths aside).
SNAKE = re.compile(r"(?<![\w./-])[a-z][a-z0-9]*(_[a-z0-9]+)+(?![\w.-])")


def visible_text(page: str) -> str:
    """The text a person reads on ``page``: outside tags, scripts (the charts' JSON) and styles."""
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_no_page_shows_raw_timestamps_or_machine_names(server, keys, endpoints, home):
    """After a training session saved a checkpoint, a rating was quarantined and an automatic rollback was
    recorded, every page of a tenant's admin and of the operator writes times as ``2026-12-07 02:31 UTC`` (or
    ``3 min ago``) and names in words: no ISO timestamp, no Unix seconds, no snake_case label."""
    from livelora.adapters.endpoints import EndpointStore
    from livelora.core.governance import record_quarantine

    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]}, timeout=120) as a:
        sid, made = session_with_model(a)
        for request in (
            made,
            a.post("/api/v1/save_weights", json={"model_id": made["model_id"], "seq_id": 1, "path": "p1"}).json(),
        ):
            while (
                r := a.post("/api/v1/retrieve_future", json={"request_id": request["request_id"]})
            ).status_code == 408:
                pass
            assert r.status_code == 200 and "error" not in r.json(), r.text
    now = time.time()
    reason = "rate_limit: 5 events in the last 60 s (limit 4)"
    record_quarantine(
        home,
        [
            {
                "event_id": "feedback-q",
                "endpoint": "acme.live",
                "lineage": LINEAGE,
                "rater": "zed",
                "type": "rating",
                "time": now,
                "reason": reason,
            }
        ],
    )
    EndpointStore(home).record(
        "acme.live", "auto_rollback", who="gateway", to=f"{LINEAGE}@2", from_=f"{LINEAGE}@3", tenant="acme"
    )
    pages = (
        "/console/endpoints",
        "/console/endpoints/acme.live",
        f"/console/lineages/{LINEAGE}",
        f"/console/versions/{LINEAGE}@2",
        "/console/charts",
        "/console/feedback",
        "/console/sessions",
    )
    with console_client(server.base_url, keys["acme"]) as c, console_client(server.base_url, keys["ops"]) as o:
        shown = {
            (who, path): visible_text(client.get(path).text)
            for who, client in (("acme", c), ("ops", o))
            for path in pages
        }
    for (who, path), text in shown.items():
        assert not ISO_TIME.search(text), (who, path, ISO_TIME.search(text).group(0))
        assert not UNIX_TIME.search(text), (who, path, UNIX_TIME.search(text).group(0))
        # (the OpenAI field, in the quota of choices; and the path parameters of the latency table's HTTP routes,
        # e.g. /api/v1/sessions/{session_id}, which are the routes' names)
        name = SNAKE.search(re.sub(r"\{[a-z_]+\}", "{}", text.replace("max_tokens", "")))
        assert name is None, (who, path, name and name.group(0))
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC"
    sessions, feedback = shown[("acme", "/console/sessions")], shown[("acme", "/console/feedback")]
    assert re.search(rf"{sid} {stamp}", sessions), sessions  # the session's creation time
    assert re.search(rf"weights/p1 training {stamp}", sessions), sessions  # the checkpoint's kind and time
    assert "training sessions" in sessions and "choices per request" in shown[("ops", "/console/sessions")]
    assert "rate limit: 5 events in the last 60 s (limit 4)" in feedback and "rater: zed" in feedback
    assert time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now)) in feedback
    endpoint = shown[("acme", "/console/endpoints/acme.live")]
    assert re.search(rf"{stamp} (just now|\d+ min ago) gateway automatic rollback {LINEAGE}@3 {LINEAGE}@2", endpoint), (
        endpoint
    )
    assert re.search(
        r"automatic rollback \S+@3 → \S+@2 (just now|\d+ min ago) by gateway", shown[("acme", "/console/endpoints")]
    )


def test_the_version_page_counts_and_lists_the_freeform_items_lost_and_gained():
    """The gate's free-form summary on a version's page: the lost/gained counts, and each list with both replies; a
    summary written before the counts existed renders without them."""
    from harness.gate import freeform_summary

    from livelora.gateway.api.console_render import ENV

    ff = freeform_summary(
        lost=[{"id": "a", "prompt": "What is the capital of Peru?", "reply": "Peru.", "was": "Lima."}],
        gained=[{"id": "b", "prompt": "What is 7 times 6?", "reply": "42.", "was": "36."}],
        lost_count=4,
        gained_count=1,
    )
    gate = {"against": "l@1", "seconds": 1.0, "verdicts": {}, "checks": [], "measures": {"freeform": ff}}
    version = {
        "name": "l@2", "lineage": "l", "parent": 1, "step": 2, "created": 0, "base_model": "b", "rank": 8,
        "alpha": 16, "data_counts": {}, "metrics": {}, "files": {}, "sha256": "x", "verified": True, "serving": [],
        "gate": gate,
    }  # fmt: skip
    page = ENV.get_template("version.html")
    html = page.render(version=version, size=0, live=[], principal=None, nav="endpoints")
    assert "; 4 lost and 1 gained against the current version</p>" in html
    assert re.search(r'id="freeform-lost"><li>What is the capital of Peru\? → <q>Peru\.</q> \(was <q>Lima\.</q>', html)
    assert re.search(r'id="freeform-gained"><li>What is 7 times 6\? → <q>42\.</q> \(was <q>36\.</q>', html)
    old = {k: v for k, v in ff.items() if k not in ("gained", "lost_count", "gained_count")}
    html = page.render(version=version | {"gate": gate | {"measures": {"freeform": old}}}, size=0, live=[], nav="")
    assert "gained" not in html and 'id="freeform-lost"' in html
