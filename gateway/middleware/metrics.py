"""Request metrics and ids: :class:`MetricsMiddleware` counts every HTTP request and times it, per route template
and status (``livelora_http_requests_total``, ``livelora_http_request_duration_seconds``,
:mod:`livelora.core.metrics`), and gives it a request id (the client's ``X-Request-Id`` when it is a short
printable token, else ``req-<32 hex>``), answered in ``X-Request-Id`` and carried by every log line of the request
(:mod:`livelora.core.logs`). The route label is the matched route's template
(``/admin/endpoints/{name:path}``), ``unmatched`` for a path no route serves, so that the label set stays
bounded."""

from __future__ import annotations

import re
import time
import uuid

from livelora.core import metrics
from livelora.core.logs import log_context

REQUEST_ID_HEADER = "X-Request-Id"
_GOOD_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: a valid client ``X-Request-Id``, else a new ``req-<32 hex>``."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            given = value.decode("latin-1")
            if _GOOD_ID.fullmatch(given):
                return given
    return f"req-{uuid.uuid4().hex}"


class MetricsMiddleware:
    """Pure ASGI middleware; the duration runs from the request's arrival to the last body chunk sent.

    Args:
        app: the inner ASGI app.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = {"code": 500, "done": False}
        rid = request_id(scope.get("headers", []))
        token = log_context.set({"request_id": rid})

        def finish() -> None:
            if status["done"]:
                return
            status["done"] = True
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            labels = (scope.get("method", "GET"), route, str(status["code"]))
            metrics.REQUESTS.labels(*labels).inc()
            metrics.REQUEST_LATENCY.labels(*labels).observe(time.monotonic() - start)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))],
                }
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()  # before the last body leaves: a client that has its response sees it counted
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            finish()
            log_context.reset(token)
