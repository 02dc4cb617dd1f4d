"""Secrets kept in the store (``LIVELORA_HOME/<name>``, mode 0600): the keys of HMAC-signed tokens that every
process of one install must share (signed download URLs, console sessions).

Example::

    key = store_secret(home, "console_secret")   # 64 hex characters, made once, then read
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def store_secret(home: Path | str, name: str) -> bytes:
    """The secret ``<home>/<name>``, made on first use (32 random bytes as hex; the first writer wins, so every
    process signs with the same one) and kept readable by the owner only.

    Raises:
        OSError: the store is not writable.
    """
    path = Path(home) / name
    if not path.is_file():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink(missing_ok=True)
    if path.stat().st_mode & 0o077:  # a secret written by an older version: owner only
        os.chmod(path, 0o600)
    return path.read_text().strip().encode()
