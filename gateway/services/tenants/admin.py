"""What the ``/admin`` routes call: :class:`~livelora.gateway.services.tenants.store_admin.StoreAdmin` scoped to the
caller's tenant, its store work run off the event loop, endpoint changes applied to this gateway's registry before the
answer and announced on the notices channel so that every other gateway re-reads ``endpoints.json`` at once."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from livelora.adapters.endpoints import HistoryEntry
from livelora.adapters.kept_versions import AdapterVersions
from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.core.api_keys import DEFAULT_TENANT, Principal
from livelora.gateway.services.tenants.segment_admin import GatewaySegments, SegmentAdmin
from livelora.gateway.services.tenants.store_admin import StoreAdmin, endpoint_notice
from livelora.gateway.services.tenants.version_admin import ExportFormat

if TYPE_CHECKING:
    from livelora.gateway.services.live.registry import AdapterRegistry

log = logging.getLogger(__name__)


class GatewayAdmin:
    """The ``/admin`` operations of one request: :class:`StoreAdmin` scoped to the caller's tenant, run off
    the event loop where it touches files, with endpoint changes applied here and announced to other gateways.

    Args:
        home: ``LIVELORA_HOME``.
        principal: the caller (its tenant scopes everything; ``who`` goes to the audit log).
        registry: this gateway's adapter registry (``None``: no live loop, nothing to apply).
        versions: the tenants' adapter limits that copies made here count against (None: not checked).
        every_tenant: scope to every tenant instead (the operator's read-only console views; never for changes).
    """

    def __init__(
        self,
        home: Path | str,
        principal: Principal,
        registry: AdapterRegistry | None = None,
        *,
        versions: AdapterVersions | None = None,
        every_tenant: bool = False,
    ):
        self.store = StoreAdmin(
            home,
            None if every_tenant else principal.tenant,
            base_endpoints=(registry.base_endpoint,) if registry is not None else (),
        )
        self.who = principal.who
        self.registry = registry
        #: an endpoint's segments (segment_admin.py)
        self.segments = GatewaySegments(
            SegmentAdmin(self.store.endpoints, self.store.tenant, versions), self.who, self._apply
        )

    async def _apply(self, endpoint: str) -> None:
        """Move this gateway now, then tell the others (a Redis failure only delays them until their resync)."""
        registry = self.registry
        if registry is None:
            return
        await registry.sync_from_store()
        try:
            await registry.client.publish(registry.keys.notices, endpoint_notice(endpoint))
        except Exception as exc:
            log.warning(
                "endpoint %s changed but the notice was not published (%s); other gateways catch up from the store",
                endpoint,
                exc,
            )

    # ------------------------------------------------------------------ endpoints

    def list_endpoints(self) -> list[dict[str, Any]]:
        return self.store.list_endpoints()

    def get_endpoint(self, name: str) -> dict[str, Any]:
        return self.store.get_endpoint(name)

    async def create_endpoint(
        self, name: str, lineage: str, *, mode: str, version: str | int | None, reason: str
    ) -> dict[str, Any]:
        """See :meth:`StoreAdmin.create_endpoint`; this gateway serves it before the answer."""
        info = await asyncio.to_thread(
            self.store.create_endpoint, name, lineage, mode=mode, version=version, who=self.who, reason=reason
        )
        await self._apply(name)
        return info

    async def promote(
        self, name: str, version: str | int | None, *, follow: bool, reason: str
    ) -> tuple[HistoryEntry, dict[str, Any]]:
        """See :meth:`StoreAdmin.promote`; returns the audit entry and the endpoint as this gateway serves it."""
        entry = await asyncio.to_thread(self.store.promote, name, version, follow=follow, who=self.who, reason=reason)
        await self._apply(name)
        return entry, self.store.get_endpoint(name)

    async def rollback(self, name: str, *, reason: str) -> tuple[HistoryEntry, dict[str, Any]]:
        """See :meth:`StoreAdmin.rollback`; returns the audit entry and the endpoint as this gateway serves it."""
        entry = await asyncio.to_thread(self.store.rollback, name, who=self.who, reason=reason)
        await self._apply(name)
        return entry, self.store.get_endpoint(name)

    async def set_learning(self, name: str, paused: bool, *, reason: str) -> tuple[HistoryEntry, dict[str, Any]]:
        """See :meth:`StoreAdmin.set_learning`; returns the audit entry and the endpoint."""
        entry = await asyncio.to_thread(self.store.set_learning, name, paused, who=self.who, reason=reason)
        await self._apply(name)
        return entry, self.store.get_endpoint(name)

    async def set_gate(
        self, name: str, thresholds: dict[str, Any] | None, *, reset: bool = False, reason: str
    ) -> tuple[HistoryEntry, dict[str, Any]]:
        """See :meth:`StoreAdmin.set_gate`; returns the audit entry and the endpoint.

        Raises:
            BadRequestError: neither ``thresholds`` nor ``reset`` given (or both).
        """
        if (thresholds is None) == (not reset):
            raise BadRequestError("give either thresholds or reset: true", param="thresholds")
        entry = await asyncio.to_thread(self.store.set_gate, name, thresholds, who=self.who, reason=reason)
        await self._apply(name)
        return entry, self.store.get_endpoint(name)

    async def stats(self, name: str) -> dict[str, Any]:
        """Per-version live statistics of an endpoint this tenant administers (requests, ratings, thumbs-up
        rate and its 95 % Wilson interval), plus the version serving now and the one before it.

        Raises:
            NotFoundError: unknown or another tenant's endpoint.
        """
        if not self.store._owns_endpoint(name) or (
            self.registry is not None
            and name not in self.registry.current
            and name not in self.store.endpoints.bindings()
        ):
            raise NotFoundError(f"endpoint {name!r} does not exist", param="endpoint")
        reg = self.registry
        if reg is None or reg.stats is None:
            return {"endpoint": name, "serving": None, "predecessor": None, "versions": []}
        return {
            "endpoint": name,
            "serving": reg.current.get(name) or "base",
            "predecessor": (reg.predecessor.get(name) or "base") if name in reg.predecessor else None,
            "versions": await reg.stats.endpoint(name),
        }

    def quarantine(self) -> list[dict[str, Any]]:
        return self.store.quarantine()

    def _own_lineages(self) -> dict[str, list[str]]:
        """lineage → this tenant's endpoints on it (bound endpoints and those this gateway serves)."""
        names = set(self.store.endpoints.all()) | set(self.registry.current if self.registry is not None else ())
        out: dict[str, list[str]] = {}
        for name in sorted(names):
            if self.store._owns_endpoint(name):
                out.setdefault(self.store.endpoints.get(name).lineage, []).append(name)
        return out

    async def raters(self) -> list[dict[str, Any]]:
        """Rater agreement weights on this tenant's lineages: one row per (lineage, rater) with ``weight`` (the
        factor its KTO/DPO examples get in the loss, in [0, 1]), ``agreement`` (smoothed agreement rate with the
        other raters of the same completions) and ``compared`` (completions it shares with another rater), lowest
        weight first (:func:`livelora.core.governance.agreement_weights`). Empty without Redis."""
        from livelora.core.governance import agreement_weights, labels_from_hash

        reg = self.registry
        if reg is None:
            return []
        rows = []
        for lineage, endpoints in self._own_lineages().items():
            raw = await reg.client.hgetall(reg.keys.rater_labels(lineage))
            for rater, w in agreement_weights(labels_from_hash(raw)).items():
                rows.append(
                    {
                        "lineage": lineage,
                        "endpoints": endpoints,
                        "rater": rater,
                        "weight": w["weight"],
                        "agreement": w["agreement"],
                        "compared": int(w["compared"]),
                    }
                )
        return sorted(rows, key=lambda r: (r["weight"], r["lineage"], r["rater"]))

    async def forget_user(self, user: str, *, reason: str) -> dict[str, Any]:
        """See :meth:`StoreAdmin.forget_user`; also deletes the user's completion records (completion log) and
        their labels from the rater agreement records of this tenant's lineages. Only records made through this
        tenant's keys count (completions: all of them, on any endpoint; signals: on this tenant's endpoints): a
        user name is the tenant's own (another tenant's ``bob`` is someone else), so the answer is the same
        whether the name exists in another tenant or not."""
        out = await asyncio.to_thread(self.store.forget_user, user, who=self.who, reason=reason)
        for name in out["segments_left"]:
            await self._apply(name)
        out["completions_removed"] = await self._forget_completions(user)
        out["labels_removed"] = await self._forget_labels(user)
        return out

    async def _forget_labels(self, user: str) -> int:
        reg = self.registry
        if reg is None:
            return 0
        n = 0
        try:
            for lineage in self._own_lineages():
                fields = [
                    f for f in await reg.client.hkeys(reg.keys.rater_labels(lineage)) if json.loads(f)[1:] == [user]
                ]
                if fields:
                    n += await reg.client.hdel(reg.keys.rater_labels(lineage), *fields)
                    await reg.client.zrem(reg.keys.rater_labels_order(lineage), *fields)
        except Exception as exc:
            log.warning("could not delete rater labels of %r: %s", user, exc)
        return n

    async def _forget_completions(self, user: str) -> int:
        registry = self.registry
        if registry is None:
            return 0
        n, tenant = 0, self.store.tenant or DEFAULT_TENANT
        try:
            async for key in registry.client.scan_iter(match=registry.keys.completion("*"), count=500):
                raw = await registry.client.get(key)
                try:
                    rec = json.loads(raw) if raw else None
                except ValueError:
                    continue
                # the completion log is kept per caller: a tenant's own users' records, whatever the endpoint
                if rec and rec.get("user") == user and (rec.get("caller") or DEFAULT_TENANT) == tenant:
                    n += await registry.client.delete(key)
        except Exception as exc:  # Redis gone: records expire with the completion log's retention anyway
            log.warning("could not delete completion records of %r: %s", user, exc)
        return n

    def history(self, name: str | None = None) -> list[HistoryEntry]:
        """Audit entries, oldest first (of one endpoint: 404 if missing or another tenant's)."""
        if name is not None:
            self.store.get_endpoint(name)
        return self.store.history(name)

    # ------------------------------------------------------------------ adapters

    def list_adapters(self, lineage: str | None = None) -> list[dict[str, Any]]:
        return self.store.versions.list_adapters(lineage)

    async def show_adapter(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.versions.show_adapter, name)

    async def delete_adapter(self, name: str) -> None:
        await asyncio.to_thread(self.store.versions.delete_adapter, name)

    async def export(self, name: str, fmt: ExportFormat) -> tuple[Path, dict[str, int]]:
        """Export into ``<home>/exports/<name>.<format>`` (reused when it exists); returns the directory and its
        files' sizes (bytes)."""
        path = await asyncio.to_thread(self.store.versions.export, name, fmt)
        files = {p.name: p.stat().st_size for p in sorted(Path(path).iterdir()) if p.is_file()}
        return path, files

    async def export_tar(self, name: str, fmt: str) -> tuple[bytes, str]:
        """An export directory (made if missing) as an uncompressed tar; returns ``(bytes, file name)``.

        Raises:
            NotFoundError: another tenant's or a missing version. BadRequestError: unknown format.
        """
        self.store.versions.manifest(name)  # 404 for other tenants' versions
        path = self.store.versions.export_dir(name, fmt)
        if not path.is_dir():
            path = await asyncio.to_thread(self.store.versions.export, name, fmt)

        def pack() -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for p in sorted(path.iterdir()):
                    if p.is_file():
                        tar.add(p, arcname=p.name)
            return buf.getvalue()

        return await asyncio.to_thread(pack), f"{path.name}.tar"

    # ------------------------------------------------------------------ keys

    def list_keys(self) -> list[dict]:
        return self.store.keys.list_keys()

    def create_key(self, roles: list[str], name: str, tenant: str | None = None) -> dict:
        """A new key for the caller's tenant, with ``key`` (shown in this answer only).

        Raises:
            BadRequestError: ``tenant`` names another tenant than the caller's (``param='tenant'``).
            PermissionDeniedError: the ``operator`` role (made on the store only).
        """
        info, key = self.store.keys.create_key(roles, name=name, tenant=tenant)
        return {**info, "key": key}

    def revoke_key(self, key_id: str) -> dict:
        return self.store.keys.revoke_key(key_id)
