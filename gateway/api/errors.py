"""The gateway's one error handler: every failure becomes an error envelope.

``{"error": {"message", "type", "param", "code"}}`` with all four keys (Anthropic's envelope on the Messages API
routes: :mod:`livelora.gateway.envelopes`), built only from :class:`~livelora.clients.errors.LiveloraError`:
request validation errors are 400 (never FastAPI's 422), Starlette's ``HTTPException`` keeps its status, anything
else is 500 ``internal_error`` (``docs/internals/wire-types.md``). Streams that already sent their headers use
:func:`error_event` instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from livelora.clients.errors import (
    BadRequestError,
    InternalError,
    LiveloraError,
    NotFoundError,
    UnsupportedParameterError,
)
from livelora.gateway.envelopes import error_body

log = logging.getLogger(__name__)


def error_response(err: LiveloraError, path: str | None = None) -> JSONResponse:
    """The HTTP response for ``err`` on ``path``: its status, the envelope (:func:`error_body`), ``Retry-After``
    if it has one."""
    headers: dict[str, str] = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    if err.status >= 500 and retry_after is None:
        headers["x-should-retry"] = "false"
    return JSONResponse(error_body(err, path), status_code=err.status, headers=headers)


def error_event(err: BaseException) -> str:
    """The one SSE data payload sent when a stream fails after its headers: ``{"error": {...}}``."""
    if not isinstance(err, LiveloraError):
        err = InternalError(f"generation failed: {type(err).__name__}: {err}")
    return json.dumps({"error": err.to_dict()})


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` → ``"messages[0].content"``; ``None`` for the whole body."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    # pydantic adds union-member tags (``str``, ``list[int]``, ``function-after[...]``) to loc
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def content_type_error(request: Request) -> BadRequestError | None:
    """A 400 for a body not declared as JSON (``application/json`` or ``*/*+json``), else ``None``.

    FastAPI (0.165) reads a body as JSON only under a JSON content-type (none at all included) and hands anything
    else to validation as raw bytes, which fails as "not a valid dictionary" with no field to name; this says what
    is wrong instead (``curl -d`` sends ``application/x-www-form-urlencoded`` unless told otherwise). Call it for a
    request that has a body.
    """
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return None
    what = f"unsupported content-type {declared!r}" if declared else "no content-type header"
    return BadRequestError(
        f"{what}: {request.url.path} takes a JSON body; send it with the header 'content-type: application/json'",
        code="unsupported_content_type",
    )


def validation_error(exc: RequestValidationError, request: Request | None = None) -> BadRequestError:
    """Turn FastAPI's validation error into a 400 naming the first bad field (or the body's content-type, when
    it was not declared JSON: :func:`content_type_error`)."""
    if request is not None and (err := content_type_error(request)) is not None:
        return err
    errors = exc.errors()
    if not errors:
        return BadRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return BadRequestError(f"request body is not valid JSON: {detail!s}", code="invalid_json")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return BadRequestError("request body is missing; send a JSON object", code="invalid_json")
    param = param_from_loc(tuple(first.get("loc", ())))
    messages = []
    for e in errors[:3]:
        where = param_from_loc(tuple(e.get("loc", ()))) or "body"
        messages.append(f"{where}: {e.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return BadRequestError("invalid request: " + "; ".join(messages) + more, param=param, code=_range_code(first))


#: pydantic's range error types -> the side of OpenAI's ``{integer|decimal}_{below_min|above_max}_value`` codes.
_RANGE_SIDES = {
    "greater_than_equal": "below_min",
    "greater_than": "below_min",
    "less_than_equal": "above_max",
    "less_than": "above_max",
}


def _range_code(error: dict) -> str:
    """OpenAI's code for one pydantic error: a bound violated on an int field is ``integer_below_min_value`` /
    ``integer_above_max_value``, on a float field ``decimal_...`` (the bound in ``ctx`` has the field's type);
    anything else is ``invalid_value``."""
    side = _RANGE_SIDES.get(error.get("type", ""))
    bounds = list((error.get("ctx") or {}).values())
    if side is None or not bounds:
        return "invalid_value"
    return f"{'decimal' if isinstance(bounds[0], float) else 'integer'}_{side}_value"


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app`` (called once by ``create_app``)."""

    @app.exception_handler(LiveloraError)
    async def _livelora(request: Request, exc: LiveloraError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc, request), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: LiveloraError = NotFoundError(f"no route {request.method} {request.url.path}", code="unknown_url")
        elif exc.status_code == 405:
            err = UnsupportedParameterError(
                f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed"
            )
            err.status = 405
        elif exc.status_code < 500:
            err = BadRequestError(str(exc.detail), code=f"http_{exc.status_code}")
            err.status = exc.status_code
        else:
            err = InternalError(str(exc.detail))
        response = error_response(err, request.url.path)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(InternalError(f"internal error: {type(exc).__name__}"), request.url.path)
