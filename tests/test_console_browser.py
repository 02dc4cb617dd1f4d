"""The admin console in a real browser: Playwright drives Debian's headless Chromium against one live gateway
(real model, real Redis, its own store). Log in with a key, see an endpoint, promote with a reason, see the
history row and the served version change (the next chat completion's ``x-livelora-adapter-version``), roll back;
another tenant's key does not see the endpoint, a wrong key is refused, a cross-site form post is refused.

Every chart of the Charts, endpoint and lineage pages is drawn with data and no two of its text labels overlap
(boxes from Chart.js's own layout, ``window.liveloraCharts()``); those pages' screenshots go to ``docs/img/``.
Every page's screenshot is written to ``test-output/console/`` (ignored by git) for a person to look at. Without
a Chromium (``apt-get install chromium``; ``.ci/run`` installs it) the tests skip and say why.
"""

from __future__ import annotations

import http.server
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from harness.bus import new_prefix
from harness.seeds import randomize_lora_b

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import AdapterStore
from livelora.clients.types.tinker import AdamParams, LoraConfig
from livelora.core.api_keys import TENANT_ROLES

LINEAGE = "acme.support"
PREFIX = new_prefix("console-browser")
KEYS = {"acme": ("acme", TENANT_ROLES), "beta": ("beta", TENANT_ROLES)}
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX}
SHOTS = Path(__file__).resolve().parent.parent / "test-output" / "console"
DOC_SHOTS = Path(__file__).resolve().parent.parent / "docs" / "img"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def seed_home(home, base_ref) -> None:
    """acme.support@1..3: three real SFT steps on one example (each version with its step's loss and optimizer
    metrics), from random lora_B so that each version's replies differ."""
    from livelora.trainer.event_datums import completion_datum
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(home)
    tm = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    randomize_lora_b(tm, torch.Generator().manual_seed(0), 0.05)
    data = [completion_datum([504, 3060, 314], [253, 1190, 30, 2])]
    for _ in range(3):
        out = tm.forward_backward(data, "cross_entropy")
        opt = tm.optim_step(AdamParams(learning_rate=0.05))
        tm.save_weights(store, LINEAGE, metrics={**out.metrics, **opt})


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip(
            "no Chromium on this machine: the console's browser tests drive Debian's chromium package "
            "(apt-get install chromium; .ci/run installs it)"
        )
    return path


@pytest.fixture(scope="module")
def browser():
    sync = pytest.importorskip("playwright.sync_api", reason="the dev extra's playwright package is not installed")
    with sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def site(server, keys):
    """acme.prod pinned to acme.support@1 with two ratings; beta.ep of tenant beta."""
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["acme"]}, timeout=120) as a:
        body = {"name": "acme.prod", "lineage": LINEAGE, "mode": "pinned", "version": 1, "reason": "first release"}
        assert a.post("/admin/endpoints", json=body).status_code == 201
        for up in (True, False, True):
            cid = served(server, keys["acme"], "acme.prod")[0]
            assert a.post("/v1/feedback", json={"completion_id": cid, "rating": up, "user": "ann"}).status_code == 200
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": keys["beta"]}, timeout=120) as b:
        assert b.post("/admin/endpoints", json={"name": "beta.ep", "lineage": "beta.l"}).status_code == 201
    SHOTS.mkdir(parents=True, exist_ok=True)
    return server.base_url


def served(server, key: str, model: str) -> tuple[str, str]:
    """``(completion id, x-livelora-adapter-version)`` of one chat completion."""
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"X-API-Key": key},
        json={"model": model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 3},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["id"], r.headers["x-livelora-adapter-version"]


def log_in(browser, base: str, key: str):
    """A new browser context logged in with ``key`` (through the log-in form the console sends it to); every
    message the page logs goes to ``page.logged`` (a Content-Security-Policy violation would show there)."""
    context = browser.new_context(base_url=base)
    page = context.new_page()
    page.logged = []
    page.on("console", lambda m: page.logged.append(f"{page.url}: {m.text}"))
    page.goto("/console/endpoints")
    assert page.url.endswith("/console/login?next=/console/endpoints")
    page.fill("#key", key)
    page.click("#login")
    page.wait_for_url("**/console/endpoints")
    return context, page


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def history(home) -> list:
    return EndpointStore(home).history("acme.prod")


def test_log_in_see_promote_with_a_reason_and_roll_back(browser, site, server, keys, home):
    from playwright.sync_api import expect

    context, page = log_in(browser, site, keys["acme"])
    row = page.locator('tr[data-endpoint="acme.prod"]')
    assert row.locator(".serving").inner_text() == "acme.support@1"
    assert page.locator("#tenant").inner_text() == "acme"
    shot(page, "endpoints")

    row.locator("summary").click()
    promote = row.locator('form[data-action="promote"]')
    promote.locator("select").select_option("acme.support@3")
    promote.locator('input[name="reason"]').fill("liked share up on the eval set")
    promote.locator("button").click()
    page.wait_for_url("**/console/endpoints/acme.prod")
    expect(page.locator("#serving")).to_have_text("acme.support@3")
    first = page.locator("tr.history-row").first
    assert first.get_attribute("data-action") == "promote"
    assert first.locator(".reason").inner_text() == "liked share up on the eval set"
    entry = history(home)[-1]  # the CLI's history line: who, from, to, reason
    assert (entry.action, entry.from_, entry.to, entry.reason) == (
        "promote",
        "acme.support@1",
        "acme.support@3",
        "liked share up on the eval set",
    )
    assert entry.who.startswith("acme/acme ")
    assert served(server, keys["acme"], "acme.prod")[1] == "acme.support@3"
    shot(page, "endpoint")

    rollback = page.locator('.actions form[data-action="rollback"]')
    rollback.locator('input[name="reason"]').fill("complaints about tone")
    rollback.locator("button").click()
    expect(page.locator("#serving")).to_have_text("acme.support@1")
    assert page.locator("tr.history-row").first.get_attribute("data-action") == "rollback"
    entry = history(home)[-1]
    assert (entry.action, entry.from_, entry.to, entry.reason) == (
        "rollback",
        "acme.support@3",
        "acme.support@1",
        "complaints about tone",
    )
    assert served(server, keys["acme"], "acme.prod")[1] == "acme.support@1"

    with page.expect_request("**/console/charts") as nav:  # htmx (hx-boost) runs under the console's CSP
        page.click("header nav >> text=Charts")
    assert nav.value.headers.get("hx-request") == "true"
    expect(page.locator("h1")).to_have_text("Charts")
    for path, name in (
        (f"/console/lineages/{LINEAGE}", "lineage"),
        (f"/console/versions/{LINEAGE}@3", "version"),
        ("/console/charts", "charts"),
        ("/console/feedback", "feedback"),
        ("/console/sessions", "sessions"),
    ):
        response = page.goto(path)
        assert response.status == 200, (path, response.status)
        shot(page, name)
    assert page.goto(f"/console/versions/{LINEAGE}@3").status == 200
    assert page.locator("#sha256").inner_text() == AdapterStore(home).get(LINEAGE, 3).sha256
    assert not [m for m in page.logged if "Content Security Policy" in m], page.logged
    context.close()


def overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """Pairs of text boxes (``left, top, width, height`` in CSS px) that overlap by more than half a pixel."""
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            dx = min(a["left"] + a["width"], b["left"] + b["width"]) - max(a["left"], b["left"])
            dy = min(a["top"] + a["height"], b["top"] + b["height"]) - max(a["top"], b["top"])
            if dx > 0.5 and dy > 0.5:
                out.append((a["text"], b["text"]))
    return out


def test_every_chart_has_data_and_no_two_labels_overlap(browser, site, server, keys):
    """Runs after the promote and rollback above, so acme.prod's liked-share chart has version changes."""
    context, page = log_in(browser, site, keys["acme"])
    page.set_viewport_size({"width": 1200, "height": 900})
    expected = {
        "/console/charts": {"liked share of acme.prod", "loss:sum of acme.support", "new versions per hour"},
        "/console/endpoints/acme.prod": {"liked share of acme.prod"},
        f"/console/lineages/{LINEAGE}": {"loss:sum of acme.support"},
    }
    for path, titles in expected.items():
        assert page.goto(path).status == 200
        page.wait_for_function("() => window.liveloraCharts && document.querySelector('figure.chart canvas')")
        drawn = page.evaluate("window.liveloraCharts()")
        assert titles <= {c["title"] for c in drawn}, (path, [c["title"] for c in drawn])
        for chart in drawn:
            texts = [b["text"] for b in chart["boxes"]]
            assert chart["points"] > 0 and len(texts) >= 4, (path, chart["title"], texts)
            assert not overlaps(chart["boxes"]), (path, chart["title"], overlaps(chart["boxes"]))
            ticks = [b["text"] for b in chart["boxes"] if b["top"] > chart["height"] * 0.6]
            assert len(ticks) == len(set(ticks)), (path, chart["title"], ticks)  # x labels do not repeat
            inside = all(0 <= b["left"] and b["left"] + b["width"] <= chart["width"] + 0.5 for b in chart["boxes"])
            assert inside, (path, chart["title"], chart["boxes"])  # nothing cut off
        if path == "/console/endpoints/acme.prod":
            liked = next(c for c in drawn if c["title"] == "liked share of acme.prod")
            assert liked["marks"] >= 1  # the promote and rollback are labelled
            assert "all versions" in page.locator("#per-version").inner_text()
    shots = (
        ("/console/charts", "console-charts"),
        ("/console/endpoints/acme.prod", "console-endpoint"),
        (f"/console/versions/{LINEAGE}@3", "console-version"),
    )
    for path, name in shots:
        page.goto(path)
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(DOC_SHOTS / f"{name}.png"), full_page=True)
    assert not [m for m in page.logged if "Content Security Policy" in m], page.logged
    context.close()


def test_another_tenants_key_does_not_see_the_endpoint(browser, site, keys):
    context, page = log_in(browser, site, keys["beta"])
    names = page.locator("a.endpoint-name").all_inner_texts()
    assert names == ["beta.ep"]
    shot(page, "endpoints-beta")
    for path in ("/console/endpoints/acme.prod", f"/console/lineages/{LINEAGE}", f"/console/versions/{LINEAGE}@1"):
        assert page.goto(path).status == 404, path
        assert "acme" not in page.locator("#error").inner_text().replace(path.rsplit("/", 1)[-1], "")
    shot(page, "not-found-beta")
    context.close()


def test_a_wrong_key_is_refused(browser, site):
    context = browser.new_context(base_url=site)
    page = context.new_page()
    page.goto("/console/login")
    page.fill("#key", "tml-000000000000-not-a-key")
    page.click("#login")
    assert page.locator("#error").inner_text() == "invalid or revoked API key"
    assert not context.cookies()
    assert page.goto("/console/endpoints").url.endswith("/console/login?next=/console/endpoints")
    shot(page, "login-refused")
    context.close()


class _Attacker(http.server.BaseHTTPRequestHandler):
    """Another site's page that posts a promote form to the console as soon as it loads."""

    target = ""

    def do_GET(self):
        body = (
            f'<form method="post" action="{self.target}"><input name="version" value="acme.support@2">'
            '<input name="reason" value="cross-site"><input name="csrf_token" value="guessed"></form>'
            "<script>document.forms[0].submit()</script>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("attacker_host", ["localhost", "127.0.0.1"])
def test_a_cross_site_form_post_is_refused(browser, site, server, keys, home, attacker_host):
    """``localhost`` is another site (SameSite=Strict: the cookie is not sent, 401); ``127.0.0.1`` on another
    port is the same site but another origin (the cookie is sent; the Origin check refuses it, 403)."""
    context, page = log_in(browser, site, keys["acme"])
    before = history(home)
    _Attacker.target = f"{site}/console/endpoints/acme.prod/promote"
    evil = http.server.HTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with page.expect_response(lambda r: r.url == _Attacker.target) as answer:
            page.goto(f"http://{attacker_host}:{evil.server_port}/")
        assert answer.value.status == (401 if attacker_host == "localhost" else 403)
        page.wait_for_load_state()
        shot(page, f"cross-site-{attacker_host}")
    finally:
        evil.shutdown()
    assert history(home) == before
    assert served(server, keys["acme"], "acme.prod")[1] == "acme.support@1"
    context.close()
