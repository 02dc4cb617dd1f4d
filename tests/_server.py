"""Kept for ``from _server import ...`` in tests written before the harness: see :mod:`harness.server`."""

from harness.plugin import live_server
from harness.server import MODEL, TEST_SETTINGS, LiveServer, sse_events, start_server, wait_until

__all__ = ["MODEL", "TEST_SETTINGS", "LiveServer", "live_server", "sse_events", "start_server", "wait_until"]
