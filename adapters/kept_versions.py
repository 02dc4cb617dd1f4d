"""The ``max_adapter_versions`` and ``max_adapter_bytes`` limits on the adapter store: count a tenant's kept
versions and their bytes, refuse a save over either, and make room for the live loop by deleting the oldest
versions nothing uses (a live-loop version is taken to be as large as the lineage's newest).

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
        reason: when not ``ok``, the limit that holds the write back, with its numbers.
    """

    ok: bool
    tenant: str
    limit: int | None
    kept: int
    pruned: list[str] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)
    reason: str = ""


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

    def limit(self, tenant: str, name: str = "max_adapter_versions") -> int | None:
        """The tenant's ``max_adapter_versions`` or ``max_adapter_bytes`` (``None``: unlimited)."""
        return self.quotas.get(tenant, self.defaults).limit(name)

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

    def version_bytes(self, lineage: str, version: int) -> int:
        """Bytes of the files of one stored version (0 when it is gone)."""
        root = self.store.version_dir(lineage, version)
        try:
            return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        except FileNotFoundError:
            return 0

    def bytes_kept(self, tenant: str, *, also: str | None = None) -> int:
        """Bytes of the versions :meth:`count` counts."""
        lineages = set(self.lineages_of(tenant)) | ({also} if also else set())
        return sum(self.version_bytes(name, v) for name in lineages for v in self.kept(name))

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

    def check(self, tenant: str, adding: int = 1, adding_bytes: int = 0) -> None:
        """Refuse a request that would write ``adding`` more counted versions of ``adding_bytes`` in all for
        ``tenant``.

        Raises:
            RateLimitError: ``kept + adding`` would pass ``max_adapter_versions``, or the kept bytes plus
                ``adding_bytes`` would pass ``max_adapter_bytes`` (429 ``quota_exceeded``, ``param`` the limit).
        """
        limits = self.quotas.get(tenant, self.defaults)
        if adding <= 0:
            return
        if (most := limits.limit("max_adapter_versions")) is not None:
            kept = self.count(tenant)
            if not limits.allows("max_adapter_versions", kept, adding):
                raise self.over_limit_error(tenant, kept, most)
        limit = limits.limit("max_adapter_bytes")
        if limit is not None and (used := self.bytes_kept(tenant)) + adding_bytes > limit:
            raise RateLimitError(
                f"this save writes about {adding_bytes / 1e6:.1f} MB and tenant {tenant!r}'s adapter versions "
                f"take {used / 1e6:.1f} MB of its limit max_adapter_bytes of {limit / 1e6:.1f} MB "
                "(LIVELORA_QUOTA_MAX_ADAPTER_BYTES or PUT /admin/quotas); nothing was saved. Free room by deleting "
                "versions: DELETE /api/v1/training_runs/<model_id>/checkpoints/<checkpoint_id>, or DELETE "
                "/admin/adapters/<lineage>@<n> for a version no endpoint serves",
                param="max_adapter_bytes",
                code="quota_exceeded",
                retry_after=VERSIONS_RETRY_AFTER_S,
            )

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
            for previous in b.previous:
                if previous is not None:
                    out.setdefault(previous, f"rollback target of endpoint {name}")
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
        limit, byte_limit = self.limit(tenant), self.limit(tenant, "max_adapter_bytes")
        if limit is None and byte_limit is None:
            return Room(True, tenant, None, 0)
        kept = self.count(tenant, also=lineage)
        need = 0 if limit is None else kept + 1 - limit
        over_bytes = 0
        if byte_limit is not None:
            newest = self.store.version_numbers(lineage)[-1:]
            adding = self.version_bytes(lineage, newest[0]) if newest else 0
            over_bytes = self.bytes_kept(tenant, also=lineage) + adding - byte_limit
        if need <= 0 and over_bytes <= 0:
            return Room(True, tenant, limit, kept)
        protected = self.protected(lineage, endpoint, keep)
        labels = {version_label(lineage, v): why for v, why in sorted(protected.items())}
        candidates = [v for v in self.kept(lineage) if v not in protected]
        take = max(need, 0)
        freed = sum(self.version_bytes(lineage, v) for v in candidates[:take])
        while take < len(candidates) and freed < over_bytes:
            freed += self.version_bytes(lineage, candidates[take])
            take += 1
        if len(candidates) < need or freed < over_bytes:
            reason = (
                f"keeps {kept} adapter versions, its max_adapter_versions is {limit}"
                if need > 0
                else f"would pass its max_adapter_bytes of {byte_limit} by {over_bytes} bytes"
            )
            return Room(False, tenant, limit, kept, protected=labels, reason=reason)
        pruned: list[str] = []
        for v in candidates[:take]:
            self.store.delete(lineage, v)
            pruned.append(version_label(lineage, v))
        if endpoint:
            self.endpoints.record(
                endpoint,
                "prune",
                who=who,
                from_=pruned[0],
                to=pruned[-1],
                reason=f"max_adapter_versions / max_adapter_bytes: tenant {tenant!r} kept {kept} versions (limit "
                f"{limit}, bytes limit {byte_limit}); deleted the oldest unused version(s) {', '.join(pruned)} "
                "before writing a new one",
                details={"deleted": pruned, "kept": kept, "limit": limit}
                | ({} if byte_limit is None else {"byte_limit": byte_limit}),
                tenant=self.endpoints.get(endpoint).tenant,
            )
        log.info("pruned %s for tenant %s (limits %s versions, %s bytes)", ", ".join(pruned), tenant, limit, byte_limit)
        return Room(True, tenant, limit, kept, pruned=pruned, protected=labels)
