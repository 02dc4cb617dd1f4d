"""Feedback governance records on disk, shared by the trainer (which enforces them) and the gateway's admin API.

Files under ``LIVELORA_HOME/data/signals`` (the dataset of record's folder):

* ``quarantine.jsonl``: one line per event the trainer kept out of training because its rater exceeded a
  limit (``{"event_id", "endpoint", "rater", "reason", "time"}``). The event itself stays in the dataset of
  record; ``GET /admin/quarantine`` lists these lines.
* ``forgotten.jsonl``: one line per delete-by-user request (``{"user", "tenant", "time", "who"}``; tenant
  ``null``: every tenant). The trainer drops queued and later events of a forgotten user on the endpoints that
  tenant administers, and neither records nor trains the user's later events there; :func:`forget_user` has
  already removed the user's events from the dataset of record.

The rater of an event is its ``user`` field, else its ``caller`` (the API key), else ``(anonymous)``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from livelora.adapters.atomic import append_line, file_lock

#: Folder of the dataset of record, relative to ``LIVELORA_HOME``.
DATASET_SUBDIR = ("data", "signals")
#: Lock file serialising writers of the dataset of record.
DATASET_LOCK = ".dataset.lock"
QUARANTINE_FILE = "quarantine.jsonl"
FORGOTTEN_FILE = "forgotten.jsonl"
ANONYMOUS = "(anonymous)"


def signals_dir(home: Path | str) -> Path:
    """``LIVELORA_HOME/data/signals``."""
    return Path(home).joinpath(*DATASET_SUBDIR)


def rater_of(event: Any) -> str:
    """The rater an event counts against (``user``, else ``caller``, else ``(anonymous)``); works on an event
    object or its JSON dict."""
    get = event.get if isinstance(event, dict) else (lambda k: getattr(event, k, None))
    return get("user") or get("caller") or ANONYMOUS


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return out


def read_quarantine(home: Path | str, endpoints: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Quarantined events, oldest first (only those of ``endpoints`` when given)."""
    allowed = None if endpoints is None else set(endpoints)
    return [r for r in _read_jsonl(signals_dir(home) / QUARANTINE_FILE) if allowed is None or r.get("endpoint")
            in allowed]


def record_quarantine(home: Path | str, records: list[dict[str, Any]]) -> None:
    """Append quarantine lines (durable on return)."""
    path = signals_dir(home) / QUARANTINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    for r in records:
        append_line(path, json.dumps(r))


def forgotten(home: Path | str) -> dict[str, set[str | None]]:
    """user → tenants (``None``: all) whose endpoints must not train on that user's data any more."""
    out: dict[str, set[str | None]] = {}
    for r in _read_jsonl(signals_dir(home) / FORGOTTEN_FILE):
        out.setdefault(r["user"], set()).add(r.get("tenant"))
    return out


def forget_user(home: Path | str, user: str, tenant: str | None, owns: Callable[[str], bool], *,
                who: str) -> dict[str, int]:
    """Delete ``user``'s events on the endpoints ``owns(endpoint)`` accepts from the dataset of record (every
    day file rewritten atomically under the dataset lock), after recording the request in ``forgotten.jsonl``,
    so that trainers drop the user's queued and later events even if this process dies midway.

    Returns:
        ``{endpoint: events removed}``.
    """
    folder = signals_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    append_line(folder / FORGOTTEN_FILE, json.dumps({"user": user, "tenant": tenant, "time": time.time(),
                                                     "who": who}))
    removed: dict[str, int] = {}
    with file_lock(folder / DATASET_LOCK):
        for path in sorted(folder.glob("[0-9]*.jsonl")):
            keep, changed = [], False
            for line in path.read_text().splitlines():
                try:
                    ev = json.loads(line).get("event")
                except json.JSONDecodeError:
                    keep.append(line)
                    continue
                if isinstance(ev, dict) and ev.get("user") == user and owns(ev.get("endpoint", "")):
                    removed[ev["endpoint"]] = removed.get(ev["endpoint"], 0) + 1
                    changed = True
                    continue
                keep.append(line)
            if changed:
                tmp = path.with_name(f".{path.name}.tmp")
                with open(tmp, "w") as f:
                    f.write("".join(x + "\n" for x in keep))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
    return removed
