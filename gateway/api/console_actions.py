"""The admin console's actions (``POST /console/...``, HTML forms): promote, follow, roll back, pause and resume
learning, export a version, delete a user's data, log out.

Each checks the same origin and the session's CSRF token (:func:`.console_render.check_post`) before anything
else, then calls the one :class:`~livelora.gateway.services.tenants.admin.GatewayAdmin` method the ``/admin`` route of
the same action calls (so the history line is the CLI's), and answers 303 back to the page (an error: the page with
the message, at the error's status).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from livelora.clients.errors import BadRequestError, LiveloraError
from livelora.gateway.api.console_render import check_post, error_page, secured
from livelora.gateway.api.deps import ConsoleDep, ConsoleLoginsDep
from livelora.gateway.services.console.login import COOKIE

router = APIRouter(prefix="/console", tags=["console"], include_in_schema=False)


def _reason(form: dict[str, str]) -> str:
    """The form's reason (required: the console asks for one, the history records it).

    Raises:
        BadRequestError: empty.
    """
    reason = (form.get("reason") or "").strip()
    if not reason:
        raise BadRequestError("give a reason: it is recorded in the endpoint's history", param="reason")
    return reason


async def _act(
    request: Request, ctx, logins, back: str, action: Callable[[dict[str, str]], Awaitable[object]]
) -> Response:
    try:
        form = await check_post(request, logins, ctx.public_url)
        result = await action(form)
    except LiveloraError as err:
        return error_page(request, err, logins, principal=ctx.principal, nav="endpoints", back=back)
    if isinstance(result, Response):
        return secured(result)
    return secured(RedirectResponse(back, status_code=303))


def _endpoint_page(name: str) -> str:
    return f"/console/endpoints/{quote(name)}"


@router.post("/endpoints/{name:path}/promote")
async def promote(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Pin ``name`` to the form's ``version`` (``<lineage>@<n>``, ``<n>`` or ``base``) with its ``reason``."""

    async def run(form):
        version = (form.get("version") or "").strip()
        if not version:
            raise BadRequestError("choose a version to promote", param="version")
        return await ctx.admin.promote(name, version, follow=False, reason=_reason(form))

    return await _act(request, ctx, logins, _endpoint_page(name), run)


@router.post("/endpoints/{name:path}/follow")
async def follow(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Let ``name`` follow its lineage's newest version again."""

    async def run(form):
        return await ctx.admin.promote(name, None, follow=True, reason=_reason(form))

    return await _act(request, ctx, logins, _endpoint_page(name), run)


@router.post("/endpoints/{name:path}/rollback")
async def rollback(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Back to the version served before the last promotion."""

    async def run(form):
        return await ctx.admin.rollback(name, reason=_reason(form))

    return await _act(request, ctx, logins, _endpoint_page(name), run)


@router.post("/endpoints/{name:path}/pause")
async def pause(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Pause the learning of ``name``'s lineage (its signals stay queued)."""

    async def run(form):
        return await ctx.admin.set_learning(name, True, reason=_reason(form))

    return await _act(request, ctx, logins, _endpoint_page(name), run)


@router.post("/endpoints/{name:path}/resume")
async def resume(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Resume the learning of ``name``'s lineage."""

    async def run(form):
        return await ctx.admin.set_learning(name, False, reason=_reason(form))

    return await _act(request, ctx, logins, _endpoint_page(name), run)


@router.post("/versions/{name}/export")
async def export(name: str, request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """The version exported in the form's ``format`` (``peft``, ``merged`` or ``gguf``) as a tar download (what
    ``GET /admin/exports/{name}/{format}`` answers)."""

    async def run(form):
        data, filename = await ctx.admin.export_tar(name, form.get("format") or "peft")
        return Response(
            data,
            media_type="application/x-tar",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )

    return await _act(request, ctx, logins, f"/console/versions/{quote(name)}", run)


@router.post("/users/forget")
async def forget_user(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """Delete the form's ``user``'s signals and completions on the tenant's endpoints (the ``/admin`` forget)."""

    async def run(form):
        await ctx.admin.forget_user((form.get("user") or "").strip(), reason=_reason(form))

    return await _act(request, ctx, logins, "/console/feedback", run)


@router.post("/logout")
async def logout(request: Request, ctx: ConsoleDep, logins: ConsoleLoginsDep) -> Response:
    """End the session on every gateway and clear the cookie."""

    async def run(form):
        logins.log_out(request.cookies.get(COOKIE))
        response = RedirectResponse("/console/login", status_code=303)
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
        return response

    return await _act(request, ctx, logins, "/console/login", run)
