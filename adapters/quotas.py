"""Per-tenant limits: concurrent training sessions and tokens per UTC day per kind.

Limits come from the settings (``LIVELORA_QUOTA_SESSIONS``, ``LIVELORA_QUOTA_TOKENS_PER_DAY``: the defaults of
every tenant) and from ``<home>/quotas.json`` (``{"<tenant>": {"max_sessions": n|null, "tokens_per_day":
{kind: n}}}``, written atomically by ``PUT /admin/quotas``), whose fields override the defaults. A
missing limit (``null`` / no kind) means unlimited.

The gateway enforces them (:mod:`livelora.gateway.services.quotas`); the day's counts are the metering's
``usage:day:{day}:{tenant}`` hashes (:mod:`livelora.adapters.metering`).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from livelora.adapters.atomic import atomic_write_json, file_lock
from livelora.adapters.metering import KINDS

QUOTAS_FILE = "quotas.json"


class Limits(BaseModel):
    """One tenant's limits (``None`` / a kind absent: unlimited).

    Attributes:
        max_sessions: training sessions alive at once (a session holds its slot until finished, or until it has
            had no heartbeat for ``LIVELORA_SESSION_TTL_S``).
        tokens_per_day: ``{kind: tokens}`` per UTC day (kinds of :data:`~livelora.adapters.metering.KINDS`).
    """

    max_sessions: int | None = Field(None, ge=0)
    tokens_per_day: dict[str, int] = Field(default_factory=dict)

    @field_validator("tokens_per_day")
    @classmethod
    def _kinds(cls, value: dict[str, int]) -> dict[str, int]:
        bad = [k for k in value if k not in KINDS]
        if bad:
            raise ValueError(f"unknown kinds {bad}; kinds: {', '.join(KINDS)}")
        if any(n < 0 for n in value.values()):
            raise ValueError("token limits must be >= 0")
        return value

    def over(self, other: Limits) -> Limits:
        """These limits with ``other``'s set fields on top (per kind for ``tokens_per_day``)."""
        return Limits(max_sessions=other.max_sessions if "max_sessions" in other.model_fields_set
                      else self.max_sessions,
                      tokens_per_day={**self.tokens_per_day, **other.tokens_per_day})


class QuotaUpdate(Limits):
    """``PUT /admin/quotas`` body: the tenant and the limits to set (fields not given keep their current value)."""

    tenant: str

    def limits(self) -> Limits:
        """The limits part, keeping which fields were given."""
        given = self.model_fields_set - {"tenant"}
        return Limits.model_validate(self.model_dump(include=given))


class QuotaStore:
    """``<home>/quotas.json``: per-tenant overrides of the default limits.

    Args:
        home: the store root.
    """

    def __init__(self, home: Path | str):
        self.path = Path(home) / QUOTAS_FILE

    def _read(self) -> dict[str, dict]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, tenant: str, defaults: Limits) -> Limits:
        """The tenant's effective limits: ``defaults`` with its stored overrides on top."""
        stored = self._read().get(tenant)
        return defaults if stored is None else defaults.over(Limits.model_validate(stored))

    def set(self, tenant: str, limits: Limits) -> None:
        """Merge ``limits``' given fields into the tenant's stored overrides (``tokens_per_day`` per kind; fields
        not given keep their value); atomic write under a file lock."""
        with file_lock(self.path.with_suffix(".lock")):
            data = self._read()
            old = data.get(tenant, {})
            new = limits.model_dump(exclude_unset=True)
            if "tokens_per_day" in new:
                new["tokens_per_day"] = {**old.get("tokens_per_day", {}), **new["tokens_per_day"]}
            data[tenant] = {**old, **new}
            atomic_write_json(self.path, data)
