"""The admin console's pages (``/console``, HTML): log-in and log-out, the console's static files, and one page
per view (endpoints, an endpoint, a lineage's versions, a version, charts, feedback, sessions and usage).

Each page calls one :class:`~livelora.gateway.services.console.views.ConsoleViews` or
:class:`~livelora.gateway.services.console.reports.ConsoleReports` method (the caller's tenant only, through the
``/admin`` services) and renders its template. Who may call: :mod:`livelora.gateway.middleware.auth` (the session
cookie's key needs ``admin``); the actions (POST) are in :mod:`.console_actions`. For users: ``docs/console.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from livelora.clients.errors import LiveloraError, NotFoundError
from livelora.gateway.api.console_render import check_same_origin, error_page, render, secured, shown
from livelora.gateway.api.deps import ConsoleDep, ConsoleLoginsDep, ServicesDep
from livelora.gateway.console import STATIC_FILES
from livelora.gateway.services.console.login import COOKIE
from livelora.gateway.services.console.reports import ConsoleReports
from livelora.gateway.services.console.views import ConsoleViews

router = APIRouter(prefix="/console", tags=["console"], include_in_schema=False)


async def _page(
    request: Request, ctx, logins, template: str, nav: str, load: Callable[[], Awaitable[dict[str, Any]]]
) -> Response:
    try:
        data = await load()
    except LiveloraError as err:
        return error_page(request, err, logins, principal=ctx.principal, nav=nav)
    return render(request, template, logins, principal=ctx.principal, nav=nav, **data)


def _next(target: str | None) -> str:
    """Where to go after log-in: a console path only (never another site)."""
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/endpoints"


# ------------------------------------------------------------------------------------------------ log-in
@router.get("/login")
async def login_form(request: Request, logins: ConsoleLoginsDep, services: ServicesDep, next: str = "") -> Response:
    """The log-in form (an API key with the ``admin`` role; in open mode one button)."""
    return render(request, "login.html", logins, next=_next(next), open_mode=services.auth_open, principal=None)


@router.post("/login")
async def login(request: Request, logins: ConsoleLoginsDep, services: ServicesDep) -> Response:
    """Check the key, set the session cookie and go on (303); a wrong key shows the form again (401/403)."""
    form = await request.form()
    target = _next(str(form.get("next") or ""))
    try:
        check_same_origin(request, services.settings.server.public_url)
        token, _ = logins.log_in(str(form.get("key") or ""))
    except LiveloraError as err:
        if "text/html" not in request.headers.get("accept", "") and "hx-request" not in request.headers:
            raise
        return render(
            request,
            "login.html",
            logins,
            status=err.status,
            error=shown(err),
            next=target,
            open_mode=services.auth_open,
        )
    response = secured(RedirectResponse(target, status_code=303))
    public = services.settings.server.public_url or ""
    response.set_cookie(
        COOKIE,
        token,
        max_age=logins.ttl_s,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https" or public.startswith("https://"),
    )
    return response


@router.get("/static/{name:path}")
async def static(name: str) -> Response:
    """The console's CSS, scripts (htmx, Chart.js, the chart drawer) and licences (from the package: no CDN)."""
    if name not in STATIC_FILES:
        raise NotFoundError(f"no console file {name!r}")
    body = resources.files("livelora.gateway.console").joinpath("static", name).read_bytes()
    return Response(
        body,
        media_type=STATIC_FILES[name],
        headers={"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff"},
    )


# ------------------------------------------------------------------------------------------------ pages
@router.get("")
async def home() -> Response:
    return secured(RedirectResponse("/console/endpoints", status_code=303))


@router.get("/endpoints")
async def endpoints_page(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Every endpoint of the tenant: mode, serving version, canary, liked share, learning stage, last change."""

    async def load():
        return {"endpoints": await ConsoleViews(ctx).endpoints(), "canary_share": ctx.canary_share}

    return await _page(request, ctx, logins, "endpoints.html", "endpoints", load)


@router.get("/endpoints/{name:path}")
async def endpoint_page(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """One endpoint: its row and actions, liked share over time, statistics per version, history."""

    async def load():
        return await ConsoleViews(ctx).endpoint(name)

    return await _page(request, ctx, logins, "endpoint.html", "endpoints", load)


@router.get("/lineages/{lineage}")
async def lineage_page(lineage: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """A lineage's versions: table, parent graph, training loss per step, live statistics."""

    async def load():
        return await ConsoleViews(ctx).lineage(lineage)

    return await _page(request, ctx, logins, "lineage.html", "endpoints", load)


@router.get("/versions/{name}")
async def version_page(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """One version: data, training metrics, gate checks, live statistics, size, sha256, exports."""

    async def load():
        return await ConsoleViews(ctx).version(name)

    return await _page(request, ctx, logins, "version.html", "endpoints", load)


@router.get("/charts")
async def charts_page(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Liked share over time, training loss, requests, tokens and updates per hour (drawn by the vendored
    Chart.js)."""

    async def load():
        return await ConsoleReports(ctx).charts()

    return await _page(request, ctx, logins, "charts.html", "charts", load)


@router.get("/feedback")
async def feedback_page(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """The latest signals with completion text and rater weight, quarantined events, delete-by-user."""

    async def load():
        return await ConsoleReports(ctx).feedback()

    return await _page(request, ctx, logins, "feedback.html", "feedback", load)


@router.get("/sessions")
async def sessions_page(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Training sessions, their runs and checkpoints (signed archive links), usage against quotas."""

    async def load():
        return await ConsoleReports(ctx).sessions()

    return await _page(request, ctx, logins, "sessions.html", "sessions", load)
