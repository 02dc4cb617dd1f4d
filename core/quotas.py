"""Per-tenant limits: training sessions and models, adapter versions kept, tokens per UTC day per kind, and the
per-request and storage ceilings (choices per request, LoRA rank, trainer memory, completion-log and adapter
bytes).

:class:`Limits` is the one place that says what a limit's value means (``None`` is unlimited); the defaults come
from :class:`~livelora.core.settings.QuotaSection`, overridden per tenant by ``<home>/quotas.json``.
:class:`QuotaStore` reads and writes that file. The gateway enforces the limits
(:mod:`livelora.gateway.services.tenants.limits`). The file format and what counts as a kept version:
``docs/internals/metering.md``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator

from livelora.clients.errors import BadRequestError
from livelora.clients.types.admin import QuotaUpdateRequest
from livelora.core.atomic import atomic_write_json, file_lock
from livelora.core.metering import KINDS

log = logging.getLogger(__name__)

QUOTAS_FILE = "quotas.json"


class Limits(BaseModel):
    """One tenant's limits (``None`` / a kind absent: unlimited).

    Attributes:
        max_sessions: training sessions alive at once (a session holds its slot until finished, or until it has
            had no heartbeat for ``LIVELORA_SESSION_TTL_S``).
        max_adapter_versions: adapter versions kept in the store (see the module docstring for what counts).
        max_n, max_n_tokens: choices of one served request, and its choices × their ``max_tokens``.
        max_lora_rank, max_models_per_session, max_models, max_trainer_bytes: a training model's rank, live
            models per session and per tenant, and their estimated trainer memory (bytes).
        max_completion_log_bytes: bytes of the tenant's completion-log records within the retention period.
        max_adapter_bytes: bytes on disk of the adapter versions it keeps (those ``max_adapter_versions`` counts).
        tokens_per_day: ``{kind: tokens}`` per UTC day (kinds of :data:`~livelora.core.metering.KINDS`).
    """

    #: the limits with one number (``tokens_per_day.<kind>`` are named per kind)
    SCALARS: ClassVar[tuple[str, ...]] = (
        "max_sessions",
        "max_adapter_versions",
        "max_n",
        "max_n_tokens",
        "max_lora_rank",
        "max_models_per_session",
        "max_models",
        "max_trainer_bytes",
        "max_completion_log_bytes",
        "max_adapter_bytes",
    )

    max_sessions: int | None = Field(None, ge=0)
    max_adapter_versions: int | None = Field(None, ge=0)
    max_n: int | None = Field(None, ge=1)
    max_n_tokens: int | None = Field(None, ge=1)
    max_lora_rank: int | None = Field(None, ge=1)
    max_models_per_session: int | None = Field(None, ge=0)
    max_models: int | None = Field(None, ge=0)
    max_trainer_bytes: int | None = Field(None, ge=0)
    max_completion_log_bytes: int | None = Field(None, ge=0)
    max_adapter_bytes: int | None = Field(None, ge=0)
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

    # ------------------------------------------------------------------ building
    @classmethod
    def from_settings(cls, section: Any) -> Limits:
        """Every tenant's defaults from a :class:`~livelora.core.settings.QuotaSection`."""
        scalars = {name: getattr(section, f"quota_{name}") for name in cls.SCALARS[2:]}
        return cls(
            max_sessions=section.quota_sessions,
            max_adapter_versions=section.quota_max_adapter_versions,
            tokens_per_day=dict(section.quota_tokens_per_day),
            **scalars,
        )

    @classmethod
    def from_update(cls, update: QuotaUpdateRequest) -> Limits:
        """The limits a ``PUT /admin/quotas`` body sets: only the fields it gives (null or left out: unchanged),
        and each name in ``unlimited`` (``max_sessions``, ``max_adapter_versions``, ``tokens_per_day.<kind>``)
        set to ``None``.

        Raises:
            BadRequestError: an unknown name in ``unlimited`` (``param: unlimited``), an unknown kind or a
                negative limit.
        """
        fields: dict[str, Any] = {
            name: getattr(update, name) for name in cls.SCALARS if getattr(update, name) is not None
        }
        tokens: dict[str, int | None] = dict(update.tokens_per_day or {})
        for name in update.unlimited:
            if name in cls.SCALARS:
                fields[name] = None
            elif name.startswith("tokens_per_day.") and name.removeprefix("tokens_per_day.") in KINDS:
                tokens[name.removeprefix("tokens_per_day.")] = None
            else:
                raise BadRequestError(
                    f"unlimited: unknown limit {name!r}; one of {', '.join(cls.SCALARS)} or "
                    f"tokens_per_day.<kind> (kinds: {', '.join(KINDS)})",
                    param="unlimited",
                )
        if tokens:
            fields["tokens_per_day"] = tokens
        try:
            return cls.model_validate(fields)
        except ValueError as exc:  # pydantic.ValidationError
            raise BadRequestError(f"invalid limits: {exc}", param="tokens_per_day") from None

    def over(self, other: Limits) -> Limits:
        """These limits with ``other``'s set fields on top (per kind for ``tokens_per_day``)."""
        fields = {name: getattr(other if name in other.model_fields_set else self, name) for name in self.SCALARS}
        return Limits(**fields, tokens_per_day={**self.tokens_per_day, **other.tokens_per_day})

    # ------------------------------------------------------------------ reading
    def limit(self, name: str) -> int | None:
        """The value of the limit ``name`` (``max_sessions``, ``max_adapter_versions`` or
        ``tokens_per_day.<kind>``); ``None``: unlimited."""
        if name.startswith("tokens_per_day."):
            return self.tokens_per_day.get(name.removeprefix("tokens_per_day."))
        return getattr(self, name)

    def allows(self, name: str, used: int, adding: int = 1) -> bool:
        """Whether ``used`` plus ``adding`` more stays within the limit ``name`` (always, when unlimited)."""
        limit = self.limit(name)
        return limit is None or used + adding <= limit

    def daily(self, kinds: tuple[str, ...]) -> dict[str, int]:
        """``{kind: limit}`` of the ``kinds`` that have a daily token limit."""
        return {k: n for k in kinds if (n := self.limit(f"tokens_per_day.{k}")) is not None}


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
