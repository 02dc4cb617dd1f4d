"""API keys, roles and tenants, stored hashed in the store; plus the name rules for endpoints and sessions.

:class:`KeyStore` creates, verifies and revokes keys in ``LIVELORA_HOME/keys.json``; a key is
``tml-<id>-<secret>`` (:func:`parse_key`) and only its sha256 is kept, so it is shown once, when created.
:data:`ROLES` is a closed set (``inference``, ``feedback``, ``train``, ``admin``, ``operator``) and roles do not
imply each other; :class:`Principal` is the authenticated caller. File layout and what each role grants:
``docs/internals/tenancy.md``.

Example::

    store = KeyStore(home)
    record, key = store.create(tenant="acme", roles=["inference", "feedback"], name="web")
    assert store.verify(key).tenant == "acme"
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.core.atomic import atomic_write_json, file_lock

KEYS_FILE = "keys.json"
Role = Literal["inference", "feedback", "train", "admin", "operator"]
ROLES: tuple[str, ...] = ("inference", "feedback", "train", "admin", "operator")
#: Every role a tenant's own key may have (all but ``operator``, which spans tenants).
TENANT_ROLES: tuple[str, ...] = ("inference", "feedback", "train", "admin")
#: Tenant of the open-mode caller and owner of objects made without a key.
DEFAULT_TENANT = "default"
KEY_PREFIX = "tml-"

_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_ENDPOINT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def is_tenant_name(name: object) -> bool:
    """Whether ``name`` is a valid tenant name (``[a-z0-9][a-z0-9_-]{0,63}``; so it contains no ``.``)."""
    return isinstance(name, str) and _TENANT_RE.fullmatch(name) is not None


def validate_tenant(name: str) -> str:
    """Return ``name`` if it is a valid tenant (``[a-z0-9][a-z0-9_-]{0,63}``).

    Raises:
        BadRequestError: anything else.
    """
    if not isinstance(name, str) or not _TENANT_RE.fullmatch(name):
        raise BadRequestError(f"invalid tenant {name!r}: use 1-64 characters of a-z, 0-9, '_', '-'", param="tenant")
    return name


def validate_endpoint_name(name: str, param: str = "endpoint") -> str:
    """Return ``name`` if it is a valid endpoint name: 1-128 printable ASCII characters of
    ``A-Za-z0-9._:/-`` starting with a letter or digit, with no empty, ``.`` or ``..`` path segment
    (so ``HuggingFaceTB/SmolLM2-135M-Instruct`` is fine and ``a/../b``, ``a//b``, control characters are not).

    Raises:
        BadRequestError: anything else.
    """
    if (
        not isinstance(name, str)
        or not _ENDPOINT_RE.fullmatch(name)
        or any(seg in ("", ".", "..") for seg in name.split("/"))
    ):
        raise BadRequestError(
            f"invalid endpoint name {name!r}: use 1-128 characters of A-Z, a-z, 0-9, "
            "'.', '_', ':', '/', '-', starting with a letter or digit, no '..' segments",
            param=param,
        )
    return name


def validate_roles(roles: list[str] | tuple[str, ...]) -> list[str]:
    """Sorted unique roles.

    Raises:
        BadRequestError: empty, or a role outside :data:`ROLES`.
    """
    roles = sorted(set(roles))
    bad = [r for r in roles if r not in ROLES]
    if not roles or bad:
        raise BadRequestError(f"invalid roles {bad or roles!r}: choose from {', '.join(ROLES)}", param="roles")
    return roles


@dataclass(frozen=True)
class Principal:
    """Who makes a request.

    Attributes:
        tenant: the tenant whose objects the caller sees.
        roles: granted roles.
        key_id: id of the API key (``None`` in open mode or for local CLI use).
        name: human label for audit logs (key name, or ``open`` / ``local:<user>``).
        segment: the request's ``X-Livelora-Segment`` header value (a segment of the caller's own tenant's
            endpoints may list it; ``docs/endpoints-and-keys.md``).
    """

    tenant: str
    roles: frozenset[str] = field(default_factory=lambda: frozenset(ROLES))
    key_id: str | None = None
    name: str = "open"
    segment: str | None = None

    @property
    def who(self) -> str:
        """Audit-log label: ``<tenant>/<name>`` (plus the key id when there is one)."""
        return f"{self.tenant}/{self.name}" + (f" ({self.key_id})" if self.key_id else "")


#: The caller in open mode (no keys configured): tenant ``default``, every role.
OPEN_PRINCIPAL = Principal(DEFAULT_TENANT, frozenset(ROLES), None, "open")


class KeyRecord(BaseModel):
    """One stored key (never the key itself)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    name: str = ""
    tenant: str
    roles: list[str]
    sha256: str = Field(description="hex sha256 of the whole key string")
    created: float = Field(description="Unix time (seconds).")
    revoked: float | None = Field(default=None, description="Unix time of revocation, if revoked.")

    def principal(self) -> Principal:
        return Principal(self.tenant, frozenset(self.roles), self.id, self.name or self.id)


def hash_key(key: str) -> str:
    """hex sha256 of the key string."""
    return hashlib.sha256(key.encode()).hexdigest()


#: ``tml-<id>-<secret>``: the id is 12 hex digits, the secret URL-safe base64 (``secrets.token_urlsafe``)
_KEY_RE = re.compile(rf"{KEY_PREFIX}(?P<id>[0-9a-f]{{12}})-(?P<secret>[A-Za-z0-9_-]+)")


def parse_key(key: str) -> tuple[str, str]:
    """``(key_id, secret)`` of a key ``tml-<id>-<secret>``. The secret's alphabet holds ``-`` and ``_``, so it may
    begin or end with the separator or hold several in a row: the key is cut after the fixed-length id, never split
    on ``-``.

    Raises:
        ValueError: ``key`` is not of that form.
    """
    m = _KEY_RE.fullmatch(key)
    if m is None:
        raise ValueError("not an API key of the form tml-<12 hex digits>-<secret>")
    return m["id"], m["secret"]


class KeyStore:
    """``keys.json`` under ``home``; re-read when the file changes (so revocations reach every process).

    Args:
        home: ``LIVELORA_HOME``.
    """

    def __init__(self, home: Path | str):
        self.path = Path(home) / KEYS_FILE
        self._cache: tuple[float, int, dict[str, KeyRecord]] | None = None

    def all(self) -> dict[str, KeyRecord]:
        """Every record (revoked ones too), by id."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return {}
        if self._cache is not None and self._cache[:2] == (st.st_mtime, st.st_size):
            return self._cache[2]
        raw = json.loads(self.path.read_text())
        records = {k: KeyRecord.model_validate(v) for k, v in raw.get("keys", {}).items()}
        self._cache = (st.st_mtime, st.st_size, records)
        return records

    def active(self) -> list[KeyRecord]:
        """Keys not revoked."""
        return [r for r in self.all().values() if r.revoked is None]

    def create(self, tenant: str, roles: list[str], name: str = "") -> tuple[KeyRecord, str]:
        """Make a key. Returns ``(record, key)``; ``key`` is not stored anywhere and cannot be shown again.

        Raises:
            BadRequestError: invalid tenant, roles or name (at most 64 printable characters).
        """
        validate_tenant(tenant)
        roles = validate_roles(roles)
        if len(name) > 64 or not name.isprintable():
            raise BadRequestError("key name must be at most 64 printable characters", param="name")
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        record = KeyRecord(id=key_id, name=name, tenant=tenant, roles=roles, sha256=hash_key(key), created=time.time())
        with file_lock(self.path.with_suffix(".lock")):
            current = {k: v.model_dump() for k, v in self.all().items()}
            current[key_id] = record.model_dump()
            atomic_write_json(self.path, {"keys": current})
        return record, key

    def revoke(self, key_id: str, tenant: str | None = None) -> KeyRecord:
        """Revoke a key (idempotent). With ``tenant``, only that tenant's keys are visible.

        Raises:
            NotFoundError: no such key (or another tenant's).
        """
        with file_lock(self.path.with_suffix(".lock")):
            records = self.all()
            rec = records.get(key_id)
            if rec is None or (tenant is not None and rec.tenant != tenant):
                raise NotFoundError(f"API key {key_id!r} does not exist", param="key_id")
            if rec.revoked is None:
                rec = rec.model_copy(update={"revoked": time.time()})
                current = {k: v.model_dump() for k, v in records.items()}
                current[key_id] = rec.model_dump()
                atomic_write_json(self.path, {"keys": current})
            return rec

    def verify(self, key: str | None) -> Principal | None:
        """The principal of a valid, unrevoked key; ``None`` for a missing, unknown or revoked key."""
        try:
            key_id, _secret = parse_key(key or "")
        except ValueError:
            return None
        rec = self.all().get(key_id)
        if rec is None or not hmac.compare_digest(rec.sha256, hash_key(key or "")):
            return None
        return rec.principal() if rec.revoked is None else None
