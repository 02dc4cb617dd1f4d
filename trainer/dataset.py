"""The dataset of record and the trained-event record, on disk, shared by every trainer worker of a store.

* ``LIVELORA_HOME/data/signals/<UTC date>.jsonl``: every accepted event, **once** per event id (invalid
  stream entries once per stream id). :class:`JsonlIdLog` appends under a file lock
  (``data/signals/.dataset.lock``) after reading what other workers appended since its last look, so two
  workers (or one worker after a redelivery) never write an event twice.
* ``LIVELORA_HOME/data/signals/trained.jsonl``: one line per trained version, ``{"version", "event_ids",
  "stream_ids", "started_at", "written_at"}`` (the last two: Unix seconds when the worker took the batch and when
  the version was written, so train + gate + save time is their difference). :class:`JsonlIdLog` reads its new
  lines incrementally, so a worker sees what its peers trained since it started.

Writes are appended with one ``write`` and an ``fsync``; a torn last line (a process killed mid-write) is
skipped by readers and the next append starts on a fresh line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from livelora.core import metrics
from livelora.core.atomic import file_lock, private_dir

#: Which events each version was trained on (``{"version", "event_ids", "stream_ids"}`` per line), written
#: after the version and before the ack: events redelivered after a crash in between are not trained twice.
TRAINED_FILE = "trained.jsonl"
LOCK_FILE = ".dataset.lock"


def dataset_dir(home: Path) -> Path:
    """``LIVELORA_HOME/data/signals``: the dataset of record."""
    return Path(home) / "data" / "signals"


def append_lines(path: Path, lines: Iterable[str]) -> None:
    """Append JSONL lines with one write and one fsync (the lines are durable when this returns). A file whose
    last line is torn (no final newline) gets a newline first, so the new lines stay whole."""
    private_dir(path.parent)
    data = "".join(line.rstrip("\n") + "\n" for line in lines)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = "\n" + data
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class JsonlIdLog:
    """The ids recorded in a set of JSONL files, kept up to date by reading only what was appended since.

    Args:
        folder: where the files are.
        pattern: glob of the files (``[0-9]*.jsonl`` for the dataset, ``trained.jsonl``).
        ids_of: the ids one parsed line records.
    """

    def __init__(self, folder: Path, pattern: str, ids_of: Callable[[dict[str, Any]], Iterable[str]]):
        self.folder = Path(folder)
        self.pattern = pattern
        self.ids_of = ids_of
        self.ids: set[str] = set()
        self._offsets: dict[str, int] = {}

    def refresh(self) -> set[str]:
        """Read the complete lines appended since the last call; returns the whole id set."""
        if not self.folder.is_dir():
            return self.ids
        for path in sorted(self.folder.glob(self.pattern)):
            start = self._offsets.get(path.name, 0)
            if path.stat().st_size < start:  # rewritten shorter (a user's data deleted): read it again
                start = 0
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # a torn or still-being-written last line is read next time
            for line in chunk[:end].splitlines():
                try:
                    self.ids.update(self.ids_of(json.loads(line)))
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    continue
            self._offsets[path.name] = start + end
        return self.ids


def _dataset_ids(rec: dict[str, Any]) -> list[str]:
    event = rec.get("event")
    return [event["id"] if isinstance(event, dict) else rec["stream_id"]]


class DatasetOfRecord:
    """Appends accepted events to ``<UTC date>.jsonl``, each event id once across all workers of the store."""

    def __init__(self, home: Path):
        self.folder = dataset_dir(home)
        self.log = JsonlIdLog(self.folder, "[0-9]*.jsonl", _dataset_ids)

    def append(self, day: str, records: list[tuple[str, dict[str, Any]]]) -> int:
        """Append ``(id, record)`` pairs whose id is not recorded yet (under the dataset lock); returns how many
        were written. The lines are durable when this returns."""
        private_dir(self.folder)
        with file_lock(self.folder / LOCK_FILE):
            known = self.log.refresh()
            new, seen = [], set()
            for rid, rec in records:
                if rid in known or rid in seen:
                    continue
                seen.add(rid)
                new.append(json.dumps(rec))
                event_type = (rec.get("event") or {}).get("type", "invalid")
                metrics.SIGNALS.labels("recorded", event_type).inc()
            if new:
                append_lines(self.folder / f"{day}.jsonl", new)
                known.update(seen)
        return len(new)


def trained_log(home: Path) -> JsonlIdLog:
    """The event ids in ``trained.jsonl`` (call ``refresh()`` for the current set)."""
    return JsonlIdLog(dataset_dir(home), TRAINED_FILE, lambda rec: rec["event_ids"])


def read_dataset(home: Path) -> list[dict[str, Any]]:
    """Every accepted event in the dataset of record, oldest file first, one record per event id.

    Each record: ``{"stream_id", "received" (Unix s), "event" (the event as JSON object)}``.
    A partial last line (the process died mid-write, before the fsync returned) is skipped.
    """
    out: dict[str, dict[str, Any]] = {}
    d = dataset_dir(home)
    if not d.is_dir():
        return []
    for path in sorted(d.glob("[0-9]*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.setdefault(rec["event"]["id"] if isinstance(rec.get("event"), dict) else rec["stream_id"], rec)
    return list(out.values())
