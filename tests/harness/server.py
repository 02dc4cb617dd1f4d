"""A live gateway for tests (uvicorn on a free port, in a background thread of this process, so tests can read
the engine's and the admission's state), and helpers to poll and to read SSE bodies.

The fixtures that start one (``live_server``, ``sessions_server``, ``server``) are in :mod:`harness.plugin`.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

MODEL = "smollm2-135m-instruct"
#: Settings of the shared test server: 8 sequences decode together, 8 more may wait (16 admitted).
TEST_SETTINGS = {"max_batch_size": 8, "max_waiting": 8, "device": "cpu", "executor_in_process": True}


@dataclass
class LiveServer:
    """A running gateway: ``base_url`` is ``http://127.0.0.1:<port>``."""

    base_url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def services(self):
        """The app's :class:`~livelora.gateway.api.deps.GatewayServices` (registry, settings, engine, ...)."""
        from livelora.gateway.api.deps import services_of

        return services_of(self.app)

    @property
    def engine(self):
        return self.services.engine

    @property
    def admission(self):
        return self.services.admission

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(settings=None, engine=None, ready_timeout_s: float = 300.0) -> LiveServer:
    """Start the gateway app of a gateway process (:func:`livelora.cli.processes.gateway_app`: the app plus its
    in-process op executor) on a free port and wait until ``/health`` answers 200.

    Raises:
        RuntimeError: the server thread died or did not become ready in time.
    """
    from livelora.cli.processes import gateway_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if settings is None:
        from livelora.gateway.settings import GatewaySettings

        settings = GatewaySettings()
    app = gateway_app(settings, engine)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="livelora-test-server", daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, server, thread)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the test server exited during start-up (see the log above)")
        try:
            if httpx.get(live.url("/health"), timeout=2).status_code == 200:
                return live
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    live.stop()
    raise RuntimeError(f"the test server did not answer /health within {ready_timeout_s} s")


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the exact framing on the way.

    Raises:
        AssertionError: a CR, a line that is neither ``data: ...`` nor a comment, or a missing blank line.
    """
    body = response.text
    assert "\r" not in body, "SSE must use LF separators only"
    out = []
    for block in body.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        data = [line for line in lines if not line.startswith(":")]
        assert len(data) <= 1, f"one data line per event expected: {block!r}"
        if data:
            assert data[0].startswith("data: "), data[0]
            out.append(data[0][len("data: ") :])
    assert body.endswith("\n\n"), "every event ends with a blank line"
    return out
