"""Crash-safe file-system writes: temporary path, fsync, rename.

A process killed at any point leaves either the old content or the new one,
never a half-written file or directory visible under the final name. Files are
written mode 0600 (``mkstemp``) and directories the store creates are 0700
(:func:`private_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: mode of every directory the store creates: owner only (adapters, sessions, signals and keys are private)
PRIVATE_DIR_MODE = 0o700


def private_dir(path: Path | str) -> Path:
    """Create ``path`` and its missing parents with mode :data:`PRIVATE_DIR_MODE` (existing ones are left as they
    are); returns it."""
    path = Path(path)
    missing, p = [], path
    while not p.is_dir() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=PRIVATE_DIR_MODE)
    return path


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def append_line(path: Path, line: str) -> None:
    """Append one line (a JSONL record) and fsync; used for append-only logs."""
    path = Path(path)
    private_dir(path.parent)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root``."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Build a directory in a hidden temporary sibling and rename it to ``final`` on success.

    Yields the temporary directory to fill. On any exception (or if the process
    dies) the temporary directory is discarded and ``final`` is untouched.

    Raises:
        FileExistsError: ``final`` already exists (versions are immutable).
    """
    final = Path(final)
    private_dir(final.parent)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        os.rename(tmp, final)  # fails if final appeared meanwhile (non-empty dir)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (``flock``) held for the ``with`` block; works across processes."""
    path = Path(path)
    private_dir(path.parent)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
