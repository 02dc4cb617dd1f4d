"""Graceful drain: what a gateway does between SIGTERM/SIGINT and its exit (docs/scaling-out.md).

New requests get 503 with ``Retry-After`` and ``/health`` says ``draining``; running requests get
``drain_grace_s`` to finish; what is still open then ends with an error (a stream: an error event and
``[DONE]``). The process wiring (:mod:`livelora.cli.processes`) turns the first signal into :meth:`Drain.begin`
and a second one into an immediate exit; this module holds the state and the ASGI middleware.
"""

from __future__ import annotations

import json
import logging
import time

from livelora.clients.errors import UnavailableError
from livelora.gateway.envelopes import error_body

log = logging.getLogger(__name__)

#: Paths still served while draining (the readiness probe answers "draining" itself).
_ALWAYS_SERVED = ("/health",)


class DrainExpired(UnavailableError):
    """The gateway's grace period ended before this request finished (503; retry elsewhere)."""


class Drain:
    """The drain state of one gateway (event-loop confined).

    Args:
        grace_s: seconds running requests get to finish after :meth:`begin` (``drain_grace_s``).
        retry_after_s: the ``Retry-After`` (seconds) sent with the 503s.
        clock: monotonic time source, seconds (tests pass their own).
    """

    def __init__(self, grace_s: float, retry_after_s: float = 1.0, clock=time.monotonic):
        self.grace_s = float(grace_s)
        self.retry_after_s = float(retry_after_s)
        self.clock = clock
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        """Whether :meth:`begin` was called (new requests are refused)."""
        return self.deadline is not None

    @property
    def expired(self) -> bool:
        """Whether the grace period is over (requests still running are ended)."""
        return self.deadline is not None and self.clock() >= self.deadline

    def begin(self, grace_s: float | None = None) -> None:
        """Stop admitting; running requests have ``grace_s`` (default: the setting) seconds left. Idempotent."""
        if self.deadline is None:
            grace = self.grace_s if grace_s is None else float(grace_s)
            self.deadline = self.clock() + grace
            log.warning("draining: new requests get 503; running ones have %.1f s to finish", grace)

    def refusal(self) -> UnavailableError:
        """The 503 a new request gets while draining."""
        return UnavailableError(
            "this gateway is shutting down and admits no new requests; retry (another instance will answer)",
            retry_after=self.retry_after_s,
        )

    def check_running(self) -> None:
        """Called by a running request between chunks.

        Raises:
            DrainExpired: the grace period is over.
        """
        if self.expired:
            raise DrainExpired(
                f"this gateway shut down before the request finished (grace period "
                f"{self.grace_s:g} s); retry the request",
                retry_after=self.retry_after_s,
            )


class DrainMiddleware:
    """ASGI middleware: while draining, every new HTTP request but ``GET /health`` gets 503 + ``Retry-After``
    in the route's error envelope (:mod:`livelora.gateway.envelopes`), before any other work (authentication,
    body reading)."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.drain.draining or scope.get("path") in _ALWAYS_SERVED:
            return await self.app(scope, receive, send)
        err = self.drain.refusal()
        body = json.dumps(error_body(err, scope.get("path"))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(max(1, round(err.retry_after))).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
