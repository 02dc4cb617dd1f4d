"""Request metrics: :class:`MetricsMiddleware` counts every HTTP request and times it, per route template and
status (``livelora_http_requests_total``, ``livelora_http_request_duration_seconds``,
:mod:`livelora.adapters.metrics`). The route label is the matched route's template (``/admin/endpoints/{name:path}``),
``unmatched`` for a path no route serves, so that the label set stays bounded."""

from __future__ import annotations

import time

from livelora.adapters import metrics


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
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        try:
            await self.app(scope, receive, counted)
        finally:
            finish()
