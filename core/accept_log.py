"""The accepted-signal log: every signal a gateway answered 2xx for, on disk before the answer.

``LIVELORA_HOME/data/accepted/<UTC date>-<host>-<pid>.jsonl``, one file per gateway process and day; each line
``{"event": {...}, "replaces": event id or "", "accepted": Unix s, "prefix": the Redis prefix}``, appended with
one ``write`` and an ``fsync``. The trainer re-queues from it what Redis lost (``trainer/bus_recovery.py``) and
deletes a past day's file once every event in it is settled. Why and how: ``docs/scaling-out.md``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from livelora.core.atomic import private_dir


def accept_dir(home: Path) -> Path:
    """``LIVELORA_HOME/data/accepted``."""
    return Path(home) / "data" / "accepted"


class AcceptLog:
    """Appends accepted events to this process's file of the day (thread-safe; call it off the event loop).
    ``prefix``: the Redis prefix they were queued under (a trainer re-queues only its own prefix's)."""

    def __init__(self, home: Path, prefix: str):
        self.folder = accept_dir(home)
        self.prefix = prefix
        self._host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
        self._lock = threading.Lock()

    def path(self, now: float) -> Path:
        day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
        return self.folder / f"{day}-{self._host}-{os.getpid()}.jsonl"

    def append(self, event_json: str, replaces: str | None) -> None:
        """Append one accepted event (its JSON as the stream holds it); durable when this returns.

        Raises:
            OSError: the file could not be written or synced (disk full, read-only store).
        """
        now = time.time()
        line = json.dumps(
            {
                "event": json.loads(event_json),
                "replaces": replaces or "",
                "accepted": round(now, 6),
                "prefix": self.prefix,
            }
        )
        with self._lock:
            private_dir(self.folder)
            fd = os.open(self.path(now), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                data = line + "\n"
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn line left by a killed process
                    data = "\n" + data
                os.write(fd, data.encode())
                os.fsync(fd)
            finally:
                os.close(fd)


def read_accepted(home: Path, prefix: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """File name → its whole records (of Redis prefix ``prefix`` only, unless ``None``), oldest file first; a torn
    last line is skipped, a file with none of ``prefix``'s records left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    folder = accept_dir(home)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("[0-9]*.jsonl")):
        recs = []
        try:
            text = path.read_text()
        except FileNotFoundError:  # pruned meanwhile
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
                if isinstance(rec.get("event"), dict) and isinstance(rec["event"].get("id"), str):
                    if prefix is None or rec.get("prefix") == prefix:
                        recs.append(rec)
            except (json.JSONDecodeError, AttributeError):
                continue
        if recs or prefix is None:
            out[path.name] = recs
    return out
