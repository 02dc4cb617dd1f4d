"""The ``max_adapter_versions`` limit on the adapter store: count a tenant's kept versions, refuse a save over
it, and make room for the live loop by deleting the oldest versions nothing uses.

What is kept when room is made: :meth:`AdapterVersions.protected` and ``docs/internals/store-layout.md``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from livelora.adapters.endpoints import EndpointBinding, EndpointStore, version_label
from livelora.adapters.store import AdapterStore, parse_version_name
from livelora.clients.errors import LiveloraError, RateLimitError
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.owners import OwnerStore
from livelora.core.quotas import Limits, QuotaStore
from livelora.core.rails import gate_allows

log = logging.getLogger(__name__)

#: ``Retry-After`` of a 429 for ``max_adapter_versions`` (s): nothing frees on its own, the tenant deletes versions.
VERSIONS_RETRY_AFTER_S = 60.0


@dataclass
class Room:
    """What :meth:`AdapterVersions.make_room` found.

    Attributes:
        ok: a new version may be written (within the limit, unlimited, or room was made).
        tenant: the tenant the versions were counted for.
        limit: its ``max_adapter_versions`` (``None``: unlimited).
        kept: versions it kept before any pruning.
        pruned: versions deleted to make room (``<lineage>@<n>``, oldest first).
        protected: versions of the lineage that could not be deleted, with why (``{"<lineage>@<n>": reason}``).
    """

    ok: bool
    tenant: str
    limit: int | None
    kept: int
    pruned: list[str] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)


class AdapterVersions:
    """The ``max_adapter_versions`` limit on the store: count a tenant's kept versions, refuse a save over it,
    and (the live loop) delete the oldest versions of a lineage that nothing uses.

    Args:
        home: ``LIVELORA_HOME``.
        defaults: every tenant's default limits (:meth:`Limits.from_settings`).
    """

    def __init__(self, home: Path | str, defaults: Limits):
        self.home = Path(home)
        self.defaults = defaults
        self.store = AdapterStore(home)
        self.owners = OwnerStore(home)
        self.endpoints = EndpointStore(home)
        self.quotas = QuotaStore(home)

    def limit(self, tenant: str) -> int | None:
        """The tenant's ``max_adapter_versions`` (``None``: unlimited)."""
        return self.quotas.get(tenant, self.defaults).limit("max_adapter_versions")

    # ------------------------------------------------------------------ counting
    def _named_checkpoints(self, lineage: str) -> set[int] | None:
        """Versions the lineage's session checkpoint index references; ``None`` when it is no session's."""
        path = self.home / "sessions" / f"{lineage}.json"
        try:
            index = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return {int(e["version"]) for e in index.get("checkpoints", {}).values() if "version" in e}

    def kept(self, lineage: str) -> list[int]:
        """The versions of ``lineage`` that count, oldest first (a session's ephemeral sampler weights do not)."""
        versions = self.store.version_numbers(lineage)
        named = self._named_checkpoints(lineage)
        return versions if named is None else [v for v in versions if v in named]

    def lineages_of(self, tenant: str) -> list[str]:
        """The lineages in the store that ``tenant`` owns (recorded owner)."""
        return [name for name in self.store.lineages() if self.owners.owner("lineage", name) == tenant]

    def count(self, tenant: str, *, also: str | None = None) -> int:
        """Versions ``tenant`` keeps; ``also``: a lineage counted for it even without an owner record (an
        implicit endpoint's lineage the live loop trains)."""
        lineages = set(self.lineages_of(tenant)) | ({also} if also else set())
        return sum(len(self.kept(name)) for name in lineages)

    def tenant_of(self, lineage: str, endpoint: str | None = None) -> str:
        """The tenant whose limit a new version of ``lineage`` counts against: its recorded owner, else the
        tenant of ``endpoint`` (``default`` for a public one)."""
        owner = self.owners.owner("lineage", lineage)
        if owner is not None:
            return owner
        return (self.endpoints.get(endpoint).tenant if endpoint else None) or DEFAULT_TENANT

    def over_limit_error(self, tenant: str, kept: int, limit: int) -> RateLimitError:
        """The 429 for a save that would pass ``max_adapter_versions`` (names the limit, the count and how to
        free it)."""
        return RateLimitError(
            f"tenant {tenant!r} keeps {kept} adapter versions, its limit max_adapter_versions is {limit} "
            f"(LIVELORA_QUOTA_MAX_ADAPTER_VERSIONS or PUT /admin/quotas); nothing was saved. Free room by "
            "deleting versions: a session checkpoint with DELETE /api/v1/training_runs/<model_id>/checkpoints/"
            "<checkpoint_id>, or any version no endpoint serves with DELETE /admin/adapters/<lineage>@<n> "
            "(GET /admin/adapters lists them)",
            param="max_adapter_versions",
            code="quota_exceeded",
            retry_after=VERSIONS_RETRY_AFTER_S,
        )

    def check(self, tenant: str, adding: int = 1) -> None:
        """Refuse a request that would write ``adding`` more counted versions for ``tenant``.

        Raises:
            RateLimitError: ``kept + adding`` would pass ``max_adapter_versions`` (429 ``quota_exceeded``).
        """
        limits = self.quotas.get(tenant, self.defaults)
        if limits.limit("max_adapter_versions") is None or adding <= 0:
            return
        kept = self.count(tenant)
        if not limits.allows("max_adapter_versions", kept, adding):
            raise self.over_limit_error(tenant, kept, limits.limit("max_adapter_versions"))

    # ------------------------------------------------------------------ the live loop
    def protected(self, lineage: str, endpoint: str | None = None, keep: tuple[int, ...] = ()) -> dict[int, str]:
        """Versions of ``lineage`` that must not be deleted, with why: for every endpoint bound to it (and
        ``endpoint``, also when implicit) its pinned or currently served version, the allowed version before that
        (what gateways serve until they switch, and the automatic rollback's target), its rollback stack and an
        open canary's incumbent and canary; named session checkpoints; the lineage's newest version (the
        trainer resumes from it); and ``keep``."""
        out: dict[int, str] = {}
        versions = self.store.list(lineage)
        if versions:
            out[versions[-1].version] = "the newest version (the live loop trains from it)"
        for v in keep:
            out.setdefault(v, "the version the trainer holds")
        for v in self._named_checkpoints(lineage) or ():
            out.setdefault(v, "a named session checkpoint")
        bindings: dict[str, EndpointBinding] = {n: b for n, b in self.endpoints.all().items() if b.lineage == lineage}
        if endpoint and endpoint not in bindings and self.endpoints.get(endpoint).lineage == lineage:
            bindings[endpoint] = self.endpoints.get(endpoint)
        for name, b in bindings.items():
            if b.mode == "pinned" and b.version is not None:
                out.setdefault(b.version, f"pinned by endpoint {name}")
            allowed = [m.version for m in versions if gate_allows(m.gate, name) and m.version not in b.blocked]
            if b.mode == "follow" and allowed:
                out.setdefault(allowed[-1], f"served by endpoint {name}")
                if len(allowed) > 1:
                    out.setdefault(
                        allowed[-2], f"served by endpoint {name} until gateways switch (its automatic rollback target)"
                    )
            for v in b.previous:
                if v is not None:
                    out.setdefault(v, f"rollback target of endpoint {name}")
            for v in self._open_canary(name, lineage):
                out.setdefault(v, f"in a canary of endpoint {name}")
        return out

    def _open_canary(self, endpoint: str, lineage: str) -> set[int]:
        """Versions (incumbent and canary) of the endpoint's last canary if no later line ended it."""
        open_: set[int] = set()
        for entry in self.endpoints.history(endpoint):
            state = (entry.details or {}).get("state")
            if entry.action == "canary" and state == "started":
                open_ = set()
                for label in (entry.from_, entry.to):
                    try:
                        name, n = parse_version_name(label or "")
                    except LiveloraError:
                        continue
                    if name == lineage:
                        open_.add(n)
            elif entry.action in ("canary", "auto_rollback") and state in ("completed", "aborted"):
                open_ = set()
        return open_

    def make_room(
        self, lineage: str, endpoint: str | None = None, *, keep: tuple[int, ...] = (), who: str = "trainer"
    ) -> Room:
        """Before the live loop writes one version of ``lineage``: when the tenant is at its
        ``max_adapter_versions``, delete the oldest counted versions of this lineage that are not
        :meth:`protected`, just enough for one more, and record the deletion as a ``prune`` line in
        ``endpoint``'s history. When not enough can be freed nothing is deleted and ``ok`` is false (the caller
        must not write).

        Returns:
            A :class:`Room`.
        """
        tenant = self.tenant_of(lineage, endpoint)
        limit = self.limit(tenant)
        if limit is None:
            return Room(True, tenant, None, 0)
        kept = self.count(tenant, also=lineage)
        need = kept + 1 - limit
        if need <= 0:
            return Room(True, tenant, limit, kept)
        protected = self.protected(lineage, endpoint, keep)
        labels = {version_label(lineage, v): why for v, why in sorted(protected.items())}
        candidates = [v for v in self.kept(lineage) if v not in protected]
        if len(candidates) < need:
            return Room(False, tenant, limit, kept, protected=labels)
        pruned: list[str] = []
        for v in candidates[:need]:
            self.store.delete(lineage, v)
            pruned.append(version_label(lineage, v))
        if endpoint:
            self.endpoints.record(
                endpoint,
                "prune",
                who=who,
                from_=pruned[0],
                to=pruned[-1],
                reason=f"max_adapter_versions: tenant {tenant!r} kept {kept} of {limit}; deleted the oldest "
                f"unused version(s) {', '.join(pruned)} before writing a new one",
                details={"deleted": pruned, "kept": kept, "limit": limit},
                tenant=self.endpoints.get(endpoint).tenant,
            )
        log.info("pruned %s for tenant %s (max_adapter_versions %d, kept %d)", ", ".join(pruned), tenant, limit, kept)
        return Room(True, tenant, limit, kept, pruned=pruned, protected=labels)
