"""Administration of an endpoint's segments (``/admin/endpoints/{name}/segments``, ``livelora endpoints
segments``): :class:`SegmentAdmin` on the store (the CLI's ``--home`` mode uses it directly), and
:class:`GatewaySegments`, its store work off the event loop and each change applied to this gateway's registry
before the answer. Storage and limits: :mod:`livelora.adapters.segments`; use: ``docs/endpoints-and-keys.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from livelora.adapters.endpoints import EndpointStore, version_label
from livelora.adapters.kept_versions import AdapterVersions
from livelora.adapters.segments import SegmentStore, segment_binding_name, segment_info
from livelora.adapters.store import AdapterStore
from livelora.core.api_keys import DEFAULT_TENANT


class SegmentAdmin:
    """Segments of the endpoints ``tenant`` administers (``None``: local store access, the endpoint's own tenant).

    Args:
        endpoints: the endpoint store (with the served base model's implicit endpoint).
        tenant: the caller's tenant.
        versions: the tenants' adapter limits a segment's copied version counts against (None: not checked).
    """

    def __init__(self, endpoints: EndpointStore, tenant: str | None, versions: AdapterVersions | None = None):
        self.endpoints, self.tenant, self.versions = endpoints, tenant, versions
        self.segments = SegmentStore(endpoints)

    def _tenant(self, endpoint: str) -> str:
        if self.tenant is not None:
            return self.tenant
        binding = self.endpoints.bindings().get(endpoint)
        return (binding.tenant if binding is not None else None) or DEFAULT_TENANT

    def info(self, name: str) -> dict[str, Any]:
        """One segment binding's view with the version its lineage targets now."""
        binding = self.endpoints.all()[name]
        served = self.endpoints.served_version(binding, AdapterStore(self.endpoints.home), name)
        return {**segment_info(name, binding), "serving": version_label(binding.lineage, served)}

    def list(self, endpoint: str) -> list[dict[str, Any]]:
        """The segments of ``endpoint``, by name. Raises: NotFoundError (unknown or another tenant's)."""
        self.segments.parent(endpoint, self._tenant(endpoint))
        return [self.info(segment_binding_name(endpoint, s)) for s in sorted(self.segments.of(endpoint))]

    def create(self, endpoint: str, segment: str, *, who: str, reason: str = "") -> dict[str, Any]:
        """See :meth:`SegmentStore.create`."""
        self.segments.create(
            endpoint, segment, tenant=self._tenant(endpoint), who=who, reason=reason, versions=self.versions
        )
        return self.info(segment_binding_name(endpoint, segment))

    def assign(
        self, endpoint: str, segment: str, members: dict[str, list[str]], *, who: str, remove: bool, reason: str = ""
    ) -> dict[str, Any]:
        """See :meth:`SegmentStore.assign`."""
        self.segments.assign(
            endpoint, segment, members, tenant=self._tenant(endpoint), who=who, remove=remove, reason=reason
        )
        return self.info(segment_binding_name(endpoint, segment))


class GatewaySegments:
    """:class:`SegmentAdmin` for the ``/admin`` routes: store work in a thread, then ``apply(binding name)``
    (the registry re-reads the bindings and loads the segment's version; other gateways are told)."""

    def __init__(self, admin: SegmentAdmin, who: str, apply: Callable[[str], Awaitable[None]]):
        self.admin, self.who, self.apply = admin, who, apply

    def list(self, endpoint: str) -> list[dict[str, Any]]:
        return self.admin.list(endpoint)

    async def create(self, endpoint: str, segment: str, *, reason: str) -> dict[str, Any]:
        info = await asyncio.to_thread(self.admin.create, endpoint, segment, who=self.who, reason=reason)
        await self.apply(info["binding"])
        return self.admin.info(info["binding"])

    async def assign(
        self, endpoint: str, segment: str, members: dict[str, list[str]], *, remove: bool, reason: str
    ) -> dict[str, Any]:
        info = await asyncio.to_thread(
            self.admin.assign, endpoint, segment, members, who=self.who, remove=remove, reason=reason
        )
        await self.apply(info["binding"])
        return info
