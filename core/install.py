"""One install per Redis prefix: the store (``LIVELORA_HOME``) and the prefix carry the same store id.

The id is created once per store, at its first start: a random hex id written to ``LIVELORA_HOME/store_id``
(temporary file, fsync, then a hard link to the final name, which fails if another process won the race:
the first writer's id is the id). At every start of every process kind (``livelora serve``, ``gateway``,
``trainer``) :func:`bind_install` writes that id to ``{prefix}store_id`` in Redis if the key is absent
(``SET NX``) and refuses to start when the key holds another store's id: two installs sharing one prefix
would execute each other's training sessions and train each other's signals.

A Redis that lost its data (no persistence) simply gets the id again at the next start.

Example::

    bind_install(redis_client, KeyLayout("livelora:"), Path("/data/livelora"), "redis://127.0.0.1:6379/0")
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

from livelora.clients.errors import ConflictError
from livelora.core.atomic import fsync_dir, private_dir
from livelora.core.bus import redis_unavailable
from livelora.core.redis_keys import KeyLayout

STORE_ID_FILE = "store_id"


class InstallMismatchError(ConflictError):
    """The store and the Redis prefix belong to different installs (the process must not start)."""

    default_code = "install_mismatch"


def store_id(home: Path | str) -> str:
    """The store's id, created at the first call on a new store (atomic, first writer wins). Every call also
    makes the store's root unreadable to other users (its world bits cleared; a new root is 0700).

    Raises:
        OSError: the store directory cannot be written.
    """
    home = Path(home)
    private_dir(home)
    if home.stat().st_mode & 0o007:  # others could read the store (and forge signed URLs with its secret)
        os.chmod(home, home.stat().st_mode & ~0o007)
    path = home / STORE_ID_FILE
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    fd, tmp = tempfile.mkstemp(prefix=f".{STORE_ID_FILE}.", suffix=".tmp", dir=home)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if the file exists: an earlier or concurrent first start won
            fsync_dir(home)
        except FileExistsError:
            pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path.read_text().strip()


def bind_install(client, keys: KeyLayout, home: Path | str, redis_url: str = "") -> str:
    """Bind the store at ``home`` to the Redis prefix of ``keys``, or check an existing binding.

    Args:
        client: a synchronous ``redis.Redis`` (``decode_responses=True``).
        redis_url: only used in the error message.

    Returns:
        The store id.

    Raises:
        InstallMismatchError: the prefix belongs to another store; the message says what to change.
        UnavailableError: Redis unreachable.
    """
    sid = store_id(home)
    with redis_unavailable():
        client.set(keys.store_id, sid, nx=True)
        bound = client.get(keys.store_id)
    if isinstance(bound, bytes):
        bound = bound.decode()
    if bound != sid:
        where = f" at {redis_url}" if redis_url else ""
        raise InstallMismatchError(
            f"the Redis prefix {keys.prefix!r}{where} belongs to another livelora install (store id {bound}); "
            f"this store ({home}) has id {sid}. Two installs must not share a prefix: give this one its own "
            f"with LIVELORA_REDIS_PREFIX (e.g. 'livelora-{sid[:8]}:'), or point LIVELORA_HOME at the store "
            "that owns this prefix."
        )
    return sid
