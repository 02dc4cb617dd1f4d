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
from typing import Any

from pydantic import BaseModel, Field, field_validator

from livelora.adapters.atomic import atomic_write_json, file_lock
from livelora.adapters.metering import KINDS
from livelora.clients.types.admin import QuotaUpdateRequest

QUOTAS_FILE = "quotas.json"


class Limits(BaseModel):
    """One tenant's limits (``None`` / a kind absent: unlimited).

    Attributes:
        max_sessions: training sessions alive at once (a session holds its slot until finished, or until it has
            had no heartbeat for ``LIVELORA_SESSION_TTL_S``).
        tokens_per_day: ``{kind: tokens}`` per UTC day (kinds of :data:`~livelora.adapters.metering.KINDS`).
    """

    max_sessions: int | None = Field(None, ge=0)
    tokens_per_day: dict[str, int | None] = Field(default_factory=dict)

    @field_validator("tokens_per_day")
    @classmethod
    def _kinds(cls, value: dict[str, int]) -> dict[str, int]:
        bad = [k for k in value if k not in KINDS]
        if bad:
            raise ValueError(f"unknown kinds {bad}; kinds: {', '.join(KINDS)}")
        if any(n is not None and n < 0 for n in value.values()):
            raise ValueError("token limits must be >= 0")
        return value

    def over(self, other: Limits) -> Limits:
        """These limits with ``other``'s set fields on top (per kind for ``tokens_per_day``)."""
        return Limits(max_sessions=other.max_sessions if "max_sessions" in other.model_fields_set
                      else self.max_sessions,
                      tokens_per_day={**self.tokens_per_day, **other.tokens_per_day})


def limits_of(update: QuotaUpdateRequest) -> Limits:
    """The :class:`Limits` an update sets (only the fields it gives; lifted limits as ``None``).

    Raises:
        pydantic.ValidationError: an unknown kind, a negative limit, or an unknown name in ``unlimited``.
    """
    fields: dict[str, Any] = {}
    if update.max_sessions is not None:
        fields["max_sessions"] = update.max_sessions
    tokens: dict[str, int | None] = dict(update.tokens_per_day or {})
    for name in update.unlimited:
        if name == "max_sessions":
            fields["max_sessions"] = None
        elif name.startswith("tokens_per_day."):
            tokens[name.removeprefix("tokens_per_day.")] = None
        else:
            raise ValueError(f"unlimited: unknown limit {name!r} (max_sessions or tokens_per_day.<kind>)")
    if tokens:
        fields["tokens_per_day"] = tokens
    return Limits.model_validate(fields)


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
