"""Stored adapter versions served on demand: a request may name any stored ``<lineage>@<n>`` it may use.

:meth:`OnDemandVersions.ensure` (awaited before :meth:`~livelora.gateway.services.serving.serve.Serving.begin`) checks
the caller may use the version, loads it once however many requests wait for it, and holds at most ``limit``
such versions (least recently used idle one evicted; 429 when all are in use). Who may, and the refusals:
``docs/internals/tenancy.md`` and ``docs/internals/engines.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from livelora.adapters.store import MANIFEST_FILE, Manifest, parse_version_name
from livelora.clients.errors import (
    BadRequestError,
    ConflictError,
    ModelNotFoundError,
    NotFoundError,
    RateLimitError,
)
from livelora.core.api_keys import Principal
from livelora.core.owners import OwnerStore
from livelora.core.rails import gate_allows

if TYPE_CHECKING:
    from livelora.gateway.services.live.registry import AdapterRegistry

log = logging.getLogger(__name__)

#: Default of ``LIVELORA_MAX_ON_DEMAND_VERSIONS``: stored versions held in the engine because requests named them.
DEFAULT_MAX_ON_DEMAND = 4


class OnDemandVersions:
    """The versions a registry loaded because requests named them (see the module docstring).

    Args:
        registry: the gateway's adapter registry (its store, engine installs, leases and unloads).
        limit: versions held on demand at most (≥ 1).

    Attributes:
        held: version names held on demand, least recently used first.
    """

    def __init__(self, registry: AdapterRegistry, limit: int = DEFAULT_MAX_ON_DEMAND):
        if limit < 1:
            raise BadRequestError(f"max_on_demand_versions must be >= 1, got {limit}", param="max_on_demand_versions")
        self.registry = registry
        self.limit = limit
        self.owners = OwnerStore(registry.store.home)
        self.held: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, asyncio.Task] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.held

    # ------------------------------------------------------------------ who may use what

    def may_use(self, lineage: str, principal: Principal | None) -> bool:
        """Whether ``principal`` may be served versions of ``lineage``: outside requests (``None``) and in open mode
        always; in key mode when its tenant is the lineage's recorded owner."""
        if principal is None or principal.key_id is None:
            return True
        return self.owners.owns("lineage", lineage, principal.tenant)

    def endpoint_of(self, lineage: str, principal: Principal | None) -> str | None:
        """The endpoint a version of ``lineage`` is counted under: the first of its endpoints whose versions the
        caller may be served, else ``None`` (a lineage no endpoint binds, e.g. a training run's)."""
        reg = self.registry
        for endpoint, binding in reg.bindings.items():
            if (
                binding.lineage == lineage
                and reg.visible(endpoint, principal)
                and reg.versions_visible(endpoint, principal)
            ):
                return endpoint
        return None

    def target(self, model: str, principal: Principal | None) -> tuple[str, str] | None:
        """``(endpoint, adapter)`` for a loaded version ``model`` that ``principal`` may use, noting the use (least
        recently used order); ``None`` otherwise. The endpoint is :meth:`endpoint_of`, else the version name."""
        reg = self.registry
        manifest = reg.loaded.get(model)
        if manifest is None or model in reg.refused or not self.may_use(manifest.lineage, principal):
            return None
        if model in self.held:
            self.held.move_to_end(model)
        return self.endpoint_of(manifest.lineage, principal) or model, model

    def stored(self, model: str, principal: Principal | None) -> Manifest | None:
        """The manifest of ``model`` if it names a stored version ``principal`` may use (loaded or not), else
        ``None`` (not a version name, not stored, or another tenant's)."""
        try:
            lineage, version = parse_version_name(model)
            if not self.may_use(lineage, principal):
                return None
            return self.registry.store.get(lineage, version)
        except (BadRequestError, NotFoundError, ValueError):
            return None

    @staticmethod
    def check_trainable(endpoint: str) -> None:
        """Refuse a signal on a reply of a version that no endpoint serves (its completions are counted under the
        version name, :meth:`target`): such feedback would train no lineage.

        Raises:
            ConflictError: ``endpoint`` is a version name (endpoint names never contain ``@``), 409
                ``not_trainable``.
        """
        if "@" in endpoint:
            raise ConflictError(
                f"{endpoint!r} is a stored adapter version that no endpoint serves: feedback on its "
                "replies would train no lineage. Bind an endpoint to its lineage (livelora endpoints "
                "create NAME --lineage LINEAGE) and rate that endpoint's replies",
                param="model",
                code="not_trainable",
            )

    # ------------------------------------------------------------------ loading

    async def ensure(self, model: str, principal: Principal | None) -> None:
        """Make ``model`` servable if it names a stored version ``principal`` may use that is not loaded; names
        that are not version names, loaded versions and names the caller may not use are left to
        :meth:`~.registry.AdapterRegistry.resolve` (which answers the one 404 for the last).

        Raises:
            ModelNotFoundError: the caller's version was deleted from the store (404, said so).
            ConflictError: the evaluation gate rejected the version, or it failed its load checks (409).
            RateLimitError: every held version serves running requests (429).
        """
        reg = self.registry
        if model in reg.current:
            return
        try:
            lineage, version = parse_version_name(model)
        except (BadRequestError, ValueError):
            return
        if not self.may_use(lineage, principal):
            return
        if model in reg.loaded and model in self.held:
            if not (reg.store.version_dir(lineage, version) / MANIFEST_FILE).is_file():
                await self._drop(model)
                raise self._deleted(model, lineage)
            if model not in reg.engine.loaded_adapters():  # unloaded behind the registry's back (a sampling
                self.held.pop(model)  # session that loaded it first ended): load it again
                reg.loaded.pop(model, None)
        if model in reg.loaded:
            return
        if model in reg.refused:
            raise ConflictError(
                f"model {model!r} is stored but cannot be served: it failed its load checks ({reg.refused[model]})",
                param="model",
                code="version_refused",
            )
        try:
            manifest = reg.store.get(lineage, version)
        except NotFoundError:
            if reg.store.was_allocated(lineage, version):
                raise self._deleted(model, lineage) from None
            return
        endpoint = self.endpoint_of(lineage, principal)
        if not gate_allows(manifest.gate, endpoint or "*"):
            raise ConflictError(
                f"model {model!r} is stored but cannot be served: the evaluation gate rejected it"
                f"{' for endpoint ' + repr(endpoint) if endpoint else ''} (GET /admin/adapters/{model} "
                f"shows the gate's checks); name a version the gate passed",
                param="model",
                code="version_rejected",
            )
        task = self._loads.get(model)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(manifest))
            self._loads[model] = task
            task.add_done_callback(lambda t: (self._loads.pop(model, None), t.cancelled() or t.exception()))
        await asyncio.shield(task)

    def _deleted(self, model: str, lineage: str) -> ModelNotFoundError:
        left = ", ".join(m.name for m in self.registry.store.list(lineage)[-5:]) or "none"
        return ModelNotFoundError(
            f"model {model!r} is no longer in the adapter store: the version was deleted (or "
            f"its save never completed); stored versions of {lineage!r} include: {left}",
            param="model",
        )

    async def _load(self, manifest: Manifest) -> None:
        await self._make_room()
        try:
            await self.registry.install(manifest.lineage, manifest.version, move=False)
        except BadRequestError as exc:
            raise ConflictError(
                f"model {manifest.name!r} is stored but cannot be served: it failed its load checks ({exc})",
                param="model",
                code="version_refused",
            ) from exc
        self.held[manifest.name] = None
        log.info("loaded %s on demand (%d of %d held)", manifest.name, len(self.held), self.limit)

    # ------------------------------------------------------------------ bounding

    def _in_use(self, name: str) -> bool:
        reg = self.registry
        return (
            bool(reg.leases.get(name))
            or name in reg.current.values()
            or (reg.stats is not None and reg.stats.is_canary(name))
        )

    async def _make_room(self) -> None:
        """Evict least recently used idle versions until this load (and those in flight) fit ``limit``.

        Raises:
            RateLimitError: every held version serves running requests.
        """
        reg = self.registry
        for name in [n for n in self.held if n in reg.current.values() or n not in reg.loaded]:
            del self.held[name]  # an endpoint serves it now (its own rules unload it), or it is gone already
        while len(self.held) + len(self._loads) > self.limit:
            victim = next((n for n in self.held if not self._in_use(n)), None)
            if victim is None:
                raise RateLimitError(
                    f"all {self.limit} adapter versions loaded on demand are serving running "
                    "requests (LIVELORA_MAX_ON_DEMAND_VERSIONS); retry when one finishes"
                )
            log.info("evicting %s (least recently used version loaded on demand)", victim)
            await self._drop(victim)

    async def _drop(self, name: str) -> None:
        """Stop holding ``name``; unload it now if it is idle (else its last lease's release unloads it)."""
        self.held.pop(name, None)
        if self.registry._retired(name):
            await self.registry._unload(name)
