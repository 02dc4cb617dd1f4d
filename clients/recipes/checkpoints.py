"""A run directory: the whole config (``config.json``) and an append-only log of checkpoints.

Layout of ``log_dir``::

    config.json          the recipe's config, written once (atomic rename); a resume must match it
    checkpoints.jsonl    one line per saved state: {"step", "name", "state_path", "time"} (append + fsync)
    metrics.jsonl        step metrics (see metrics.py)
    mlruns/              the local MLflow file store, when MLflow is installed and no tracking URI is set

``step`` in a checkpoint is the number of optimizer steps done. Resuming opens the last complete line's
``state_path`` with ``create_training_client_from_state_with_optimizer`` (weights, Adam moments and step
count) and continues at that step (tinker-cookbook ``checkpoint_utils.py``, the same ``checkpoints.jsonl``
idea). A line torn by a kill mid-write is ignored; checkpoints are never rewritten or removed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = "config.json"
CHECKPOINTS = "checkpoints.jsonl"


class ConfigMismatchError(ValueError):
    """``log_dir`` holds a run with a different config (resuming it would mix two experiments)."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file, fsync and rename (never a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write and fsync (durable when this returns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_lenient(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of an append-only log (a torn or garbled line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def save_config(log_dir: Path, config: dict[str, Any], resumable: frozenset[str]) -> None:
    """Write ``config.json``, or check it against the one already there.

    ``resumable`` names fields that may change between a run and its resume (e.g. ``steps``, ``base_url``);
    the file keeps the latest values. A run that never recorded a checkpoint (it failed before its first one,
    e.g. on a missing data set) holds nothing to resume: its config is replaced.

    Raises: ConfigMismatchError listing every other field that differs, when the run has a checkpoint.
    """
    path = log_dir / CONFIG
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(config) if k not in resumable and old.get(k) != config.get(k))
        if diff and last_checkpoint(log_dir) is not None:
            changes = ", ".join(f"{k}: {old.get(k)!r} -> {config.get(k)!r}" for k in diff)
            raise ConfigMismatchError(
                f"{log_dir} holds a run with another config ({changes}); "
                "pass a new log_dir, or the same settings to resume it"
            )
    write_json_atomic(path, config)


def record_checkpoint(log_dir: Path, step: int, name: str, state_path: str, **extra: Any) -> dict[str, Any]:
    """Append a checkpoint line (``step`` = optimizer steps done) and return it."""
    rec = {"step": step, "name": name, "state_path": state_path, "time": time.time(), **extra}
    append_jsonl(log_dir / CHECKPOINTS, rec)
    return rec


def last_checkpoint(log_dir: Path) -> dict[str, Any] | None:
    """The last complete checkpoint line with a ``state_path``, or None for a fresh run."""
    recs = [r for r in read_jsonl_lenient(log_dir / CHECKPOINTS) if "state_path" in r and "step" in r]
    return recs[-1] if recs else None


def save_state(tc: Any, log_dir: Path, step: int) -> dict[str, Any]:
    """``tc.save_state`` (weights + optimizer) as ``step-NNNNNN`` and log it; blocks until saved."""
    name = f"step-{step:06d}"
    path = tc.save_state(name).result().path
    return record_checkpoint(log_dir, step, name, path)
