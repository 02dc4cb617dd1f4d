"""Kept for ``from _sessions_server import ...`` in tests written before the harness: see :mod:`harness.plugin`."""

from harness.bus import delete_prefix
from harness.plugin import SESSION_TTL_S, sessions_server
from harness.server import MODEL

__all__ = ["MODEL", "SESSION_TTL_S", "delete_prefix", "sessions_server"]
