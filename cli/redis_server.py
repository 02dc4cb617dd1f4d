"""The Redis that ``livelora serve`` starts when none is reachable (a private, non-durable ``redis-server``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from livelora.adapters.bus import connect_sync
from livelora.clients.errors import UnavailableError


def redis_reachable(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis at ``url`` answers PING within ``timeout_s`` seconds."""
    client = connect_sync(url, timeout_s=timeout_s)
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_redis(timeout_s: float = 10.0) -> tuple[str, subprocess.Popen]:
    """Start a private, non-durable ``redis-server`` on a free local port; returns ``(url, process)``.

    Raises:
        UnavailableError: no ``redis-server`` binary on PATH, or it did not answer in ``timeout_s`` seconds.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise UnavailableError("no Redis is reachable and no redis-server binary is installed; start Redis "
                               "(e.g. `docker compose up redis`) or set LIVELORA_REDIS_URL")
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="livelora-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if redis_reachable(url, 0.2):
            return url, proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise UnavailableError(f"embedded redis-server did not start on port {port}")
