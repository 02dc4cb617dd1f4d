"""Recorded ownership: which tenant owns each object, written once when the object is created.

:class:`OwnerStore` keeps one record per object under ``LIVELORA_HOME/owners/<kind>/``, claimed atomically (two
creators of one name never both win) and never rewritten. Kinds: :data:`KINDS`. The policy
(:meth:`OwnerStore.check`) denies by default: a missing record, another tenant's object and a missing object
all raise the same :class:`NotFoundError`, so a caller cannot tell them apart. What each kind's record covers:
``docs/internals/tenancy.md``.

Example::

    owners = OwnerStore(home)
    owners.claim("lineage", "support", "acme")        # True: acme owns it now
    owners.claim("lineage", "support", "beta")        # False: taken (it does not say by whom)
    owners.check("lineage", "support", "beta")        # NotFoundError("lineage 'support' does not exist")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from livelora.clients.errors import NotFoundError
from livelora.core.atomic import private_dir

OWNERS_DIR = "owners"
#: Object kinds with an owner record.
KINDS = ("lineage", "endpoint", "session", "model")
#: what the ``param`` of a 404 names, per kind
_PARAM = {"lineage": "lineage", "endpoint": "endpoint", "session": "session_id", "model": "model_id"}


class OwnerStore:
    """Owner records under ``<home>/owners`` (layout and policy: docs/internals/tenancy.md).

    Args:
        home: ``LIVELORA_HOME``.
    """

    def __init__(self, home: Path | str):
        self.root = Path(home) / OWNERS_DIR

    def _path(self, kind: str, name: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown owned kind {kind!r}; one of {', '.join(KINDS)}")
        return self.root / kind / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"

    def owner(self, kind: str, name: str) -> str | None:
        """The tenant that owns ``kind`` ``name`` (``None``: no record)."""
        path = self._path(kind, name)
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return data.get("tenant") if data.get("name") == name else None

    def claim(self, kind: str, name: str, tenant: str) -> bool:
        """Record ``tenant`` as the owner of ``kind`` ``name`` unless a record exists.

        Returns:
            ``True`` when ``tenant`` owns it now (just claimed, or already its own); ``False`` when another
            tenant holds it (the caller must answer without saying so).
        """
        path = self._path(kind, name)
        private_dir(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".claim-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"kind": kind, "name": name, "tenant": tenant, "created": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic create-if-absent of a complete file
            except FileExistsError:
                return self.owner(kind, name) == tenant
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def owns(self, kind: str, name: str, tenant: str | None) -> bool:
        """Whether ``tenant`` owns ``kind`` ``name`` (``tenant=None``: local store access, every object)."""
        return tenant is None or self.owner(kind, name) == tenant

    def check(self, kind: str, name: str, tenant: str | None) -> None:
        """The one owner check: pass when ``tenant`` owns the object (or is ``None``: local store access).

        Raises:
            NotFoundError: no record, or another tenant's object: one message for both,
                ``<kind> '<name>' does not exist``.
        """
        if not self.owns(kind, name, tenant):
            raise not_found(kind, name)

    def release(self, kind: str, name: str) -> None:
        """Remove the record of a deleted object (no-op when there is none)."""
        with contextlib.suppress(FileNotFoundError):
            self._path(kind, name).unlink()


def not_found(kind: str, name: str, param: str | None = None) -> NotFoundError:
    """The one 404 for a missing or another tenant's object of ``kind``."""
    label = {"model": "training model"}.get(kind, kind)
    return NotFoundError(f"{label} {name!r} does not exist", param=param or _PARAM.get(kind, kind))
