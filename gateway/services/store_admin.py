"""Administration of endpoints, adapter versions and API keys on the store: :class:`AdminService`.

Used directly by the CLI's ``--home`` mode (synchronous, every tenant) and, through
:class:`~livelora.gateway.services.admin.GatewayAdmin`, by the ``/admin`` routes (scoped to the caller's tenant).
Exports are deterministic: ``<home>/exports/<lineage>@<n>.peft`` and ``.merged``; a second export of a version
returns the existing directory. Tenancy rules: ``docs/internals/tenancy.md``.

Example::

    admin = AdminService(home, tenant=None)          # local: every tenant
    admin.create_endpoint("prod", "support", mode="pinned", version=3, who="local:alice")
    admin.promote("prod", "4", who="local:alice", reason="better win-rate")
    admin.rollback("prod", who="local:alice", reason="regression")
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from livelora.adapters.endpoints import EndpointBinding, EndpointStore, HistoryEntry, version_label
from livelora.adapters.store import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    AdapterStore,
    Manifest,
    parse_version_name,
    validate_lineage,
)
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError, PermissionDeniedError
from livelora.core.api_keys import DEFAULT_TENANT, KeyStore, validate_endpoint_name
from livelora.core.atomic import atomic_dir
from livelora.core.namespaces import require_own_namespace
from livelora.core.owners import OwnerStore

log = logging.getLogger(__name__)

ExportFormat = Literal["peft", "merged"]
EXPORTS_DIR = "exports"


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


def version_rows(
    home: Path, versions: list[Manifest], targets: dict[str, list[str]], endpoints: list[str]
) -> list[dict[str, Any]]:
    """One lineage's versions as ``list_adapters`` rows: the manifest plus ``serving`` (endpoints serving it now),
    ``endpoints`` (bound to its lineage) and, for a training run's lineage, ``training_run`` (its model id) and
    ``checkpoints`` (the names that map to the version, ``sampler_weights/<name>``...; empty for an unnamed
    sampler save, deleted when its session ends)."""
    run: dict[str, Any] = {}
    if versions:
        with contextlib.suppress(FileNotFoundError, ValueError):  # the training run's checkpoint index
            run = json.loads((Path(home) / "sessions" / f"{versions[0].lineage}.json").read_text())
    named = run.get("checkpoints", {})
    return [
        {
            **m.model_dump(mode="json"),
            "serving": sorted(targets.get(m.name, [])),
            "endpoints": endpoints,
            "training_run": run.get("model_id"),
            "checkpoints": sorted(k for k, e in named.items() if e.get("version") == m.version),
        }
        for m in versions
    ]


class AdminService:
    """Tenant-scoped administration.

    Args:
        home: ``LIVELORA_HOME``.
        tenant: the caller's tenant; ``None`` = every tenant (local store access).
    """

    def __init__(self, home: Path | str, tenant: str | None, base_endpoints: tuple[str, ...] | list[str] = ()):
        self.home = Path(home)
        self.tenant = tenant
        self.endpoints = EndpointStore(home, implicit=base_endpoints)
        self.store = AdapterStore(home)
        self.keys = KeyStore(home)
        self.owners = OwnerStore(home)

    # ------------------------------------------------------------------ visibility

    def _admin_tenant(self, binding: EndpointBinding) -> str:
        return binding.tenant or DEFAULT_TENANT

    def _sees_endpoint(self, binding: EndpointBinding) -> bool:
        return self.tenant is None or binding.administered_by(self.tenant)

    def _sees_lineage(self, lineage: str) -> bool:
        """Whether the caller's tenant owns ``lineage`` by its recorded owner (:mod:`livelora.core.owners`;
        no record: nobody but local store access)."""
        return self.owners.owns("lineage", lineage, self.tenant)

    def _acting_tenant(self, endpoint: str) -> str:
        """The tenant a change to ``endpoint`` is made as (local access: the endpoint's own)."""
        if self.tenant is not None:
            return self.tenant
        binding = self.endpoints.bindings().get(validate_endpoint_name(endpoint))
        if binding is None:
            raise NotFoundError(f"endpoint {endpoint!r} does not exist", param="endpoint")
        return self._admin_tenant(binding)

    def manifest(self, name: str) -> Manifest:
        """The manifest of ``<lineage>@<n>`` if this tenant may see it.

        Raises:
            BadRequestError: malformed name. NotFoundError: missing or not visible.
        """
        lineage, n = parse_version_name(name)
        if not self._sees_lineage(lineage):
            raise NotFoundError(f"adapter version {name} does not exist", param="adapter")
        return self.store.get(lineage, n)

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
        }

    def list_endpoints(self) -> list[dict[str, Any]]:
        """Endpoints this tenant administers, by name: the explicit ones and the served base model's own."""
        return [
            self.endpoint_info(k, b) for k, b in sorted(self.endpoints.bindings().items()) if self._sees_endpoint(b)
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
        user's queued and later events. One ``forget`` history line per endpoint that held any.

        Raises:
            BadRequestError: empty user.
        """
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
        return {"user": user, "signals_removed": removed}

    def history(self, name: str | None = None) -> list[HistoryEntry]:
        """Audit entries (oldest first) of this tenant's endpoints."""
        if name is not None:
            validate_endpoint_name(name)
        return self.endpoints.history(name, tenant=self.tenant)

    # ------------------------------------------------------------------ adapters

    def list_adapters(self, lineage: str | None = None) -> list[dict[str, Any]]:
        """Visible versions (oldest first per lineage), each with the endpoints serving it (:func:`version_rows`)."""
        lineages = [validate_lineage(lineage)] if lineage else self.store.lineages()
        if lineage and not self._sees_lineage(lineage):
            raise NotFoundError(f"adapter lineage {lineage!r} does not exist", param="lineage")
        targets, bound = self.endpoints.targets(self.store), {}
        for endpoint, binding in self.endpoints.bindings().items():
            bound.setdefault(binding.lineage, []).append(endpoint)
        rows = []
        for name in (n for n in lineages if self._sees_lineage(n)):
            rows += version_rows(self.home, self.store.list(name), targets, sorted(bound.get(name, [])))
        return rows

    def show_adapter(self, name: str) -> dict[str, Any]:
        """One version's manifest, files, integrity and serving endpoints. Raises: NotFoundError."""
        m = self.manifest(name)
        vdir = self.store.version_dir(m.lineage, m.version)
        files = {p.name: p.stat().st_size for p in sorted(vdir.iterdir()) if p.is_file()}
        return {
            **m.model_dump(mode="json"),
            "files": files,
            "verified": self.store.verify(m.lineage, m.version),
            "serving": sorted(self.endpoints.targets(self.store).get(m.name, [])),
        }

    def delete_adapter(self, name: str) -> None:
        """Delete a version unless an endpoint targets it.

        Raises:
            NotFoundError: missing or not visible. ConflictError: an endpoint serves it (409).
        """
        m = self.manifest(name)
        serving = self.endpoints.targets(self.store).get(m.name, [])
        if serving:
            raise ConflictError(
                f"{m.name} is the current target of endpoint(s) {', '.join(sorted(serving))}; "
                "promote another version there first",
                param="adapter",
                code="version_in_use",
            )
        self.store.delete(m.lineage, m.version)

    def export(self, name: str, fmt: ExportFormat = "peft", out: Path | str | None = None) -> Path:
        """Export a version as a PEFT adapter directory or a merged full model.

        Args:
            out: destination (must not exist); ``None`` = ``<home>/exports/<name>.<fmt>`` (reused if there).

        Returns:
            The directory written.

        Raises:
            NotFoundError: missing or not visible. BadRequestError: unknown format, bad weights.
            ConflictError: ``out`` exists.
        """
        if fmt not in ("peft", "merged"):
            raise BadRequestError(f"export format must be 'peft' or 'merged', not {fmt!r}", param="format")
        m = self.manifest(name)
        if out is None:
            dest = self.export_dir(name, fmt)
            if dest.is_dir():
                return dest
        else:
            dest = Path(out)
            if dest.exists():
                raise ConflictError(f"export destination {dest} already exists", param="out")
        if fmt == "merged":
            from livelora.adapters.export import export_merged
            from livelora.core.base_models import resolve_base_model

            return export_merged(self.store, m.lineage, m.version, resolve_base_model(m.base_model, self.home), dest)
        if not self.store.verify(m.lineage, m.version):
            raise BadRequestError(f"{m.name}: weights file does not match its sha256", param="adapter")
        vdir = self.store.version_dir(m.lineage, m.version)
        with atomic_dir(dest) as tmp:
            for f in (WEIGHTS_FILE, CONFIG_FILE):
                shutil.copy2(vdir / f, tmp / f)
            shutil.copy2(vdir / MANIFEST_FILE, tmp / "livelora_manifest.json")
            (tmp / "livelora_export.json").write_text(
                json.dumps(
                    {
                        "adapter": m.name,
                        "adapter_sha256": m.sha256,
                        "base_model": m.base_model,
                        "created": time.time(),
                        "format": "peft",
                    },
                    indent=2,
                )
            )
        return dest

    def export_dir(self, name: str, fmt: str) -> Path:
        """``<home>/exports/<lineage>@<n>.<fmt>`` (validated name)."""
        lineage, n = parse_version_name(name)
        if fmt not in ("peft", "merged"):
            raise BadRequestError(f"export format must be 'peft' or 'merged', not {fmt!r}", param="format")
        return self.home / EXPORTS_DIR / f"{lineage}@{n}.{fmt}"

    # ------------------------------------------------------------------ keys

    def create_key(self, roles: list[str], *, tenant: str | None = None, name: str = "") -> tuple[dict, str]:
        """A new key for the caller's tenant (local access: any ``tenant``). Returns ``(record, key)``."""
        if self.tenant is not None and tenant not in (None, self.tenant):
            raise BadRequestError(
                f"this admin key belongs to tenant {self.tenant}: it creates keys in that tenant "
                "only (a key of another tenant is made on the store: livelora keys create --home "
                "<store> --tenant <tenant>)",
                param="tenant",
            )
        if self.tenant is not None and "operator" in roles:
            raise PermissionDeniedError(
                "an operator key is created on the store only: livelora keys create "
                "--home <store> --roles admin,operator",
                param="roles",
            )
        record, key = self.keys.create(self.tenant or tenant or DEFAULT_TENANT, roles, name)
        return _key_info(record), key

    def list_keys(self) -> list[dict]:
        """The tenant's keys (hash never shown)."""
        return [
            _key_info(r)
            for r in sorted(self.keys.all().values(), key=lambda r: r.created)
            if self.tenant is None or r.tenant == self.tenant
        ]

    def revoke_key(self, key_id: str) -> dict:
        """Revoke a key. Raises: NotFoundError (missing or another tenant's)."""
        return _key_info(self.keys.revoke(key_id, tenant=self.tenant))


def _key_info(record) -> dict:
    return {
        "id": record.id,
        "name": record.name,
        "tenant": record.tenant,
        "roles": list(record.roles),
        "created": record.created,
        "revoked": record.revoked,
    }


def endpoint_notice(endpoint: str) -> str:
    """The notice (JSON) that makes every gateway re-read endpoint bindings now."""
    return json.dumps({"type": "endpoint_changed", "endpoint": endpoint, "time": time.time()})
