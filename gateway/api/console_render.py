"""Rendering and request checks shared by the console's routers: the Jinja environment over the package's
templates, the security headers of every page, the same-origin and CSRF checks of every POST, and errors as
HTML pages for browsers (the OpenAI envelope for other clients).
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from livelora.clients.errors import LiveloraError, PermissionDeniedError
from livelora.gateway.console import charts
from livelora.gateway.services.console.login import COOKIE, CSRF_FIELD, CSRF_HEADER, ConsoleLogins

#: Headers of every console answer: no framing (clickjacking), scripts and styles from the gateway only, no
#: caching of pages that show a tenant's data.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _num(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4g}"


def _ci(right: int, n: int) -> str:
    """The 95 % Wilson interval of ``right`` of ``n`` as percentages."""
    from livelora.core.rails import wilson_interval

    got = wilson_interval(right, n)
    return "-" if got is None else f"{100 * got[0]:.0f}–{100 * got[1]:.0f} %"


def _unix(t: float | str | datetime | None) -> float | None:
    """Unix seconds of ``t``: a number, an ISO 8601 string (a training session's times) or a datetime (naive:
    UTC); None when absent or unreadable."""
    if isinstance(t, str):
        try:
            t = datetime.fromisoformat(t)
        except ValueError:
            return None
    if isinstance(t, datetime):
        return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()
    return float(t) if isinstance(t, int | float) and t else None


def _when(t: float | str | datetime | None) -> str:
    """``2026-12-07 02:31 UTC`` (``-`` for none)."""
    u = _unix(t)
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(u)) if u is not None else "-"


def _ago(t: float | str | datetime | None, now: float | None = None) -> str:
    """How long ago ``t`` was: ``just now``, ``3 min ago``, ``5 h ago``, ``2 days ago`` (``in 3 min`` ahead)."""
    u = _unix(t)
    if u is None:
        return "-"
    d = (time.time() if now is None else now) - u
    s = abs(d)
    if s < 60:
        return "just now"
    n, unit = (s // 60, "min") if s < 3600 else (s // 3600, "h") if s < 86400 else (s // 86400, "day")
    text = f"{n:.0f} {unit}" + ("s" if unit == "day" and n >= 2 else "")
    return f"{text} ago" if d > 0 else f"in {text}"


#: Words for machine names the pages show (learning stages, history actions, limits); others: underscores → spaces.
LABELS = {
    "gate": "evaluation gate",
    "waiting": "waiting for ratings",
    "auto_rollback": "automatic rollback",
    "client_finished": "finished by the client",
    "max_sessions": "training sessions",
    "max_adapter_versions": "adapter versions",
    "max_n": "choices per request",
    "max_n_tokens": "choices × max_tokens per request",
    "max_lora_rank": "LoRA rank",
    "max_models_per_session": "models per session",
    "max_models": "training models",
    "max_trainer_bytes": "trainer memory",
    "max_completion_log_bytes": "completion log",
    "max_adapter_bytes": "adapter storage",
}


def _label(name: Any) -> str:
    """A machine name for people: :data:`LABELS`, else its underscores as spaces (``length_ratio`` → ``length
    ratio``); a ``snake_case:`` prefix of a sentence likewise (``rate_limit: 5 events`` → ``rate limit: 5
    events``)."""
    text = "" if name is None else str(name)
    if text in LABELS:
        return LABELS[text]
    return re.sub(r"^([a-z0-9]+(?:_[a-z0-9]+)+)(?=:|$)", lambda m: m.group(1).replace("_", " "), text)


def _record(rec: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """A stored record as ``key: value`` pairs for people, less the keys in ``skip`` (shown beside it): times as
    :func:`_when`, keys as :func:`_label`."""
    times = ("time", "received", "created", "at")
    return "; ".join(
        f"{_label(k)}: {_when(v) if k in times or k.endswith('_at') else v}"
        for k, v in rec.items()
        if v is not None and k not in skip
    )


ENV = Environment(loader=PackageLoader("livelora.gateway.console", "templates"), autoescape=select_autoescape())
ENV.filters.update(pct=_pct, size=_size, num=_num, when=_when, ago=_ago, label=_label, record=_record, ci=_ci)
ENV.globals.update(charts=charts)


def wants_html(request: Request) -> bool:
    """A browser navigation or an htmx request (else: an API client, answered in the OpenAI envelope)."""
    return "text/html" in request.headers.get("accept", "") or "hx-request" in request.headers


def secured(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def render(
    request: Request, template: str, logins: ConsoleLogins | None, status: int = 200, **context: Any
) -> HTMLResponse:
    """The page ``template`` with ``context``, the caller's CSRF token (``csrf``) and the security headers."""
    token = request.cookies.get(COOKIE)
    csrf = logins.csrf_token(token) if logins is not None and token else ""
    html = ENV.get_template(template).render(request=request, csrf=csrf, csrf_field=CSRF_FIELD, **context)
    return secured(HTMLResponse(html, status_code=status))


def error_page(request: Request, err: LiveloraError, logins: ConsoleLogins | None, **context: Any) -> HTMLResponse:
    """``err`` as a page for a browser. Raises it again for an API client (the app's OpenAI envelope)."""
    if not wants_html(request):
        raise err
    return render(request, "error.html", logins, status=err.status, error=shown(err), **context)


def shown(err: LiveloraError) -> dict[str, Any]:
    """What a page shows of an error: its status and OpenAI error object (server paths redacted)."""
    return {"status": err.status, **err.to_dict()}


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def check_same_origin(request: Request, public_url: str | None) -> None:
    """A POST must come from a page of this gateway: its ``Origin`` (else its ``Referer``) is the address the
    request was sent to (``Host``) or ``LIVELORA_PUBLIC_URL``'s.

    Raises:
        PermissionDeniedError: another site's, an opaque (``null``) or no origin (403, code ``cross_site``).
    """
    referer = request.headers.get("referer")
    sent = request.headers.get("origin") or (origin_of(referer) if referer else "") or "(none)"
    own = {f"{request.url.scheme}://{request.headers.get('host', '')}".lower()}
    if public_url:
        own.add(origin_of(public_url))
    if sent.lower() not in own:
        raise PermissionDeniedError(
            f"cross-site request refused: a console form is posted from its own pages (origin {sent}; a script "
            "sends Origin: this server's address)",
            code="cross_site",
        )


async def check_post(request: Request, logins: ConsoleLogins, public_url: str | None) -> dict[str, str]:
    """Same origin, then the session's CSRF token (form field ``csrf_token`` or header ``X-CSRF-Token``);
    returns the form's fields.

    Raises:
        PermissionDeniedError: cross-site, or a missing or wrong CSRF token (403).
    """
    check_same_origin(request, public_url)
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    logins.check_csrf(request.cookies.get(COOKIE), form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER))
    return form
