"""Administration of endpoints, adapter versions and API keys on the store: :class:`StoreAdmin`.

Used directly by the CLI's ``--home`` mode (synchronous, every tenant) and, through
:class:`~livelora.gateway.services.tenants.admin.GatewayAdmin`, by the ``/admin`` routes (scoped to the caller's
tenant). Exports are deterministic: ``<home>/exports/<lineage>@<n>.peft``, ``.merged`` and ``.gguf``; a second export
of a version returns the existing directory. Tenancy rules: ``docs/internals/tenancy.md``.

Example::

    admin = StoreAdmin(home, tenant=None)          # local: every tenant
    admin.create_endpoint("prod", "support", mode="pinned", version=3, who="local:alice")
    admin.promote("prod", "4", who="local:alice", reason="better win-rate")
    admin.rollback("prod", who="local:alice", reason="regression")
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from livelora.adapters.endpoints import EndpointBinding, EndpointStore, HistoryEntry, version_label
from livelora.adapters.segments import SEP, is_segment
from livelora.adapters.store import AdapterStore, parse_version_name, validate_lineage
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError
from livelora.core.api_keys import DEFAULT_TENANT, validate_endpoint_name
from livelora.core.namespaces import require_own_namespace
from livelora.core.owners import OwnerStore
from livelora.gateway.services.tenants.key_admin import KeyAdmin
from livelora.gateway.services.tenants.version_admin import VersionAdmin

log = logging.getLogger(__name__)


def parse_version_ref(ref: str | int | None, lineage: str) -> int | None:
    """``"base"``/``None`` → ``None``; ``"4"``/``4`` → 4; ``"<lineage>@4"`` → 4 (the lineage must match).

    Raises:
        BadRequestError: malformed, or another lineage's version.
    """
    if ref is None or ref == "base":
        return None
    if isinstance(ref, int) and not isinstance(ref, bool):
        if ref < 1:
            raise BadRequestError(f"invalid version {ref!r}", param="version")
        return ref
    ref = str(ref)
    if ref.isdigit():
        return parse_version_ref(int(ref), lineage)
    other, n = parse_version_name(ref)
    if other != lineage:
        raise BadRequestError(
            f"{ref} is a version of lineage {other!r}, but the endpoint serves {lineage!r}", param="version"
        )
    return n


class StoreAdmin:
    """Tenant-scoped administration: endpoints (create, promote, rollback, gate, history) and feedback governance
    here; the adapter versions in :attr:`versions` (:class:`VersionAdmin`: list, show, delete, export) and the API
    keys in :attr:`keys` (:class:`KeyAdmin`).

    Args:
        home: ``LIVELORA_HOME``.
        tenant: the caller's tenant; ``None`` = every tenant (local store access).
    """

    def __init__(self, home: Path | str, tenant: str | None, base_endpoints: tuple[str, ...] | list[str] = ()):
        self.home = Path(home)
        self.tenant = tenant
        self.endpoints = EndpointStore(home, implicit=base_endpoints)
        self.store = AdapterStore(home)
        self.owners = OwnerStore(home)
        self.versions = VersionAdmin(self.home, tenant, self.store, self.endpoints, self.owners)
        self.keys = KeyAdmin(home, tenant)

    # ------------------------------------------------------------------ visibility

    def _admin_tenant(self, binding: EndpointBinding) -> str:
        return binding.tenant or DEFAULT_TENANT

    def _sees_endpoint(self, binding: EndpointBinding) -> bool:
        return self.tenant is None or binding.administered_by(self.tenant)

    def _acting_tenant(self, endpoint: str) -> str:
        """The tenant a change to ``endpoint`` is made as (local access: the endpoint's own)."""
        if self.tenant is not None:
            return self.tenant
        binding = self.endpoints.bindings().get(validate_endpoint_name(endpoint))
        if binding is None:
            raise NotFoundError(f"endpoint {endpoint!r} does not exist", param="endpoint")
        return self._admin_tenant(binding)

    # ------------------------------------------------------------------ endpoints

    def endpoint_info(self, name: str, binding: EndpointBinding) -> dict[str, Any]:
        served = self.endpoints.served_version(binding, self.store, name)
        return {
            "name": name,
            "lineage": binding.lineage,
            "mode": binding.mode,
            "serving": version_label(binding.lineage, served),
            "tenant": binding.tenant,
            "rollback_to": (version_label(binding.lineage, binding.previous[-1]) if binding.previous else None),
            "created": binding.created,
            "gate": binding.thresholds.model_dump(mode="json"),
            "learning_paused": binding.learning_paused,
        }

    def list_endpoints(self) -> list[dict[str, Any]]:
        """Endpoints this tenant administers, by name: the explicit ones and the served base model's own."""
        return [
            self.endpoint_info(k, b)
            for k, b in sorted(self.endpoints.bindings().items())
            if self._sees_endpoint(b) and b.segment is None  # segments: GET /admin/endpoints/{name}/segments
        ]

    def get_endpoint(self, name: str) -> dict[str, Any]:
        """One endpoint. Raises: NotFoundError (missing or another tenant's)."""
        binding = self.endpoints.bindings().get(validate_endpoint_name(name))
        if binding is None or not self._sees_endpoint(binding):
            raise NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
        return self.endpoint_info(name, binding)

    def create_endpoint(
        self,
        name: str,
        lineage: str,
        *,
        who: str,
        mode: str = "follow",
        version: str | int | None = None,
        tenant: str | None = None,
        reason: str = "",
    ) -> dict[str, Any]:
        """Create an endpoint (owned by the caller's tenant; local access may name ``tenant``).

        Names are per-tenant (:mod:`livelora.core.namespaces`): ``name`` must lie in the owner's namespace,
        and so must ``lineage`` unless the owner already owns it (its training run's lineage, or one made before
        the rule). Both checks come before anything that depends on which names exist, so another namespace's
        name answers the same 400 whether it exists or not; local store access follows the same rule.

        Raises:
            BadRequestError: invalid names, or a name outside the owner's namespace (``param`` ``name`` or
                ``lineage``); see also :meth:`EndpointStore.create`.
            ConflictError: the endpoint or the lineage is taken (only names of the owner's own namespace).
            NotFoundError: a pinned version that does not exist.
        """
        validate_endpoint_name(name, param="name")
        if is_segment(name):
            raise BadRequestError(f"{SEP!r} joins an endpoint and a segment name; not allowed here", param="name")
        validate_lineage(lineage)
        owner = self.tenant or tenant or DEFAULT_TENANT
        if self.tenant is not None and tenant not in (None, self.tenant):
            raise BadRequestError("an endpoint is created in the caller's own tenant", param="tenant")
        require_own_namespace(name, owner, kind="endpoint", param="name")
        if not self.owners.owns("lineage", lineage, owner):
            require_own_namespace(lineage, owner, kind="lineage", param="lineage")
        n = parse_version_ref(version, lineage)
        if mode == "follow" and n is not None:
            raise BadRequestError(
                "a follow endpoint serves the newest version; give a version only with mode 'pinned'", param="version"
            )
        if not self.owners.claim("lineage", lineage, owner):  # the one answer for every taken name
            raise ConflictError(f"lineage {lineage!r} is not available; choose another lineage name", param="lineage")
        binding, _ = self.endpoints.create(name, lineage, tenant=owner, who=who, mode=mode, version=n, reason=reason)
        return self.endpoint_info(name, binding)

    def promote(
        self, name: str, version: str | int | None, *, who: str, reason: str = "", follow: bool = False
    ) -> HistoryEntry:
        """Pin ``name`` to a stored version (``base``: the base model), or let it follow its lineage again.

        Raises:
            NotFoundError: unknown endpoint or version. BadRequestError: malformed version.
        """
        tenant = self._acting_tenant(name)
        binding = self.endpoints.bindings().get(name)
        if binding is None or not binding.administered_by(tenant):
            raise NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
        if version is None and not follow:
            raise BadRequestError(
                "give a version to pin (`<n>`, `<lineage>@<n>` or `base`) or follow=true", param="version"
            )
        if version is not None and follow:
            raise BadRequestError("give either a version or follow=true, not both", param="follow")
        n = None if follow else parse_version_ref(version, binding.lineage)
        _, entry = self.endpoints.promote(name, n, tenant=tenant, who=who, reason=reason, follow=follow)
        return entry

    def rollback(self, name: str, *, who: str, reason: str = "") -> HistoryEntry:
        """Back to the version served before the last promotion. Raises: NotFoundError, ConflictError."""
        _, entry = self.endpoints.rollback(name, tenant=self._acting_tenant(name), who=who, reason=reason)
        return entry

    def set_learning(self, name: str, paused: bool, *, who: str, reason: str = "") -> HistoryEntry:
        """Pause or resume the training of an endpoint's lineage, audited as ``pause``/``resume``
        (:meth:`EndpointStore.set_learning`). Raises: NotFoundError (unknown or another tenant's endpoint)."""
        _, entry = self.endpoints.set_learning(name, paused, tenant=self._acting_tenant(name), who=who, reason=reason)
        return entry

    def set_gate(self, name: str, thresholds: dict[str, Any] | None, *, who: str, reason: str = "") -> HistoryEntry:
        """Set an endpoint's evaluation-gate thresholds (``None``: back to the defaults), audited as ``configure``.

        Raises:
            BadRequestError: an unknown threshold name or a value out of its range (``param`` names it).
            NotFoundError: unknown endpoint (or another tenant's).
        """
        from pydantic import ValidationError

        from livelora.core.rails import GateThresholds

        try:
            gate = None if thresholds is None else GateThresholds.model_validate(thresholds)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first.get("loc", ()))
            raise BadRequestError(
                f"gate threshold {field!r}: {first.get('msg')}", param=f"thresholds.{field}" if field else "thresholds"
            ) from None
        _, entry = self.endpoints.set_gate(name, gate, tenant=self._acting_tenant(name), who=who, reason=reason)
        return entry

    # ------------------------------------------------------------------ feedback governance

    def _owns_endpoint(self, endpoint: str) -> bool:
        """Whether this tenant administers ``endpoint`` (an implicit one belongs to ``default``)."""
        try:
            return self._sees_endpoint(self.endpoints.get(endpoint))
        except BadRequestError:
            return False

    def quarantine(self) -> list[dict[str, Any]]:
        """Quarantined events of this tenant's endpoints (kept in the dataset of record, not trained)."""
        from livelora.core.governance import read_quarantine

        return [r for r in read_quarantine(self.home) if self._owns_endpoint(r.get("endpoint", ""))]

    def forget_user(self, user: str, *, who: str, reason: str = "") -> dict[str, Any]:
        """Delete ``user``'s signals on this tenant's endpoints from the dataset of record; trainers drop the
        user's queued and later events; the user leaves every segment listing them (``segments_left``: those
        segments' binding names). One ``forget`` history line per endpoint that held any.

        Raises:
            BadRequestError: empty user.
        """
        from livelora.adapters.segments import SegmentStore
        from livelora.core.governance import forget_user

        if not user or len(user) > 256:
            raise BadRequestError("user must be 1-256 characters", param="user")
        removed = forget_user(self.home, user, self.tenant, self._owns_endpoint, who=who)
        for endpoint, n in sorted(removed.items()):
            b = self.endpoints.get(endpoint)
            self.endpoints.record(
                endpoint,
                "forget",
                who=who,
                to=f"user:{user}",
                reason=reason or f"deleted {n} signal(s) of user {user!r}",
                details={"user": user, "signals": n},
                tenant=b.tenant,
            )
        left = SegmentStore(self.endpoints).forget(user, self.tenant, who=who)
        return {"user": user, "signals_removed": removed, "segments_left": left}

    def history(self, name: str | None = None) -> list[HistoryEntry]:
        """Audit entries (oldest first) of this tenant's endpoints."""
        if name is not None:
            validate_endpoint_name(name)
        return self.endpoints.history(name, tenant=self.tenant)


def endpoint_notice(endpoint: str) -> str:
    """The notice (JSON) that makes every gateway re-read endpoint bindings now."""
    return json.dumps({"type": "endpoint_changed", "endpoint": endpoint, "time": time.time()})
