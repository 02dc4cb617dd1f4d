"""The admin console for tests without a browser: log in with a key over HTTP and get a client that carries the
session cookie, the session's CSRF token (``X-CSRF-Token``) and the gateway's own ``Origin`` on every request,
as the console's pages do. Browser tests: ``tests/test_console_browser.py``."""

from __future__ import annotations

import re

import httpx

CSRF = re.compile(r'name="csrf_token" value="([0-9a-f]+)"')


def login(base_url: str, key: str | None) -> httpx.Response:
    """``POST /console/login`` as a browser form would (its ``Origin``), without following the redirect."""
    return httpx.post(
        f"{base_url}/console/login", data={"key": key or ""}, headers={"Origin": base_url}, follow_redirects=False
    )


def console_client(base_url: str, key: str | None, *, headers: dict[str, str] | None = None) -> httpx.Client:
    """A client logged into the console with ``key`` (asserts the log-in succeeded), sending the CSRF token and
    ``Origin`` with every request; ``headers`` are added (e.g. an ``X-API-Key`` for the other routes)."""
    r = login(base_url, key)
    assert r.status_code == 303, (r.status_code, r.text)
    page = httpx.get(f"{base_url}/console/endpoints", cookies=r.cookies, timeout=120)
    assert page.status_code == 200, page.text
    csrf = CSRF.search(page.text).group(1)
    return httpx.Client(
        base_url=base_url,
        timeout=120,
        cookies=r.cookies,
        headers={"Origin": base_url, "X-CSRF-Token": csrf, **(headers or {})},
    )
