"""Gateway-side adapter version bookkeeping: endpoints, leases, checked installs, drained unloads.

* An **endpoint** is a served model name bound to an adapter lineage (:mod:`livelora.adapters.endpoints`); its
  *current* version is the engine adapter name ``<lineage>@<n>`` that new requests get, or ``None`` (the base
  model) before the lineage has a version.
* A request takes a **lease** on the endpoint's current version when it is admitted (:meth:`AdapterRegistry.hold`)
  and keeps it until it finishes, so a request started on version k finishes on k even if the endpoint moves.
* :meth:`AdapterRegistry.install` loads and checks a version (:mod:`.version_checks`: sha256, canary forward
  pass), then moves every ``follow`` endpoint of its lineage whose evaluation-gate verdict allows it (one
  assignment, atomic on the event loop). A refused version is unloaded and the endpoint stays where it was.
* A version that is no longer current is **unloaded** once its last lease is released (retired at refcount 0).
* The store (``endpoints.json`` + adapter versions) is the source of truth; :mod:`.store_sync` catches up from it
  on start, every ``resync_s`` seconds and at each Redis notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aredis

from livelora.adapters.endpoints import EndpointBinding, EndpointStore, record_install_owners
from livelora.adapters.segments import is_segment
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import BadRequestError, ConflictError, LiveloraError, ModelNotFoundError
from livelora.core import metrics
from livelora.core.api_keys import Principal
from livelora.core.rails import gate_allows
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import Engine
from livelora.gateway.services.live.on_demand import DEFAULT_MAX_ON_DEMAND, OnDemandVersions
from livelora.gateway.services.live.segments import SegmentRouter
from livelora.gateway.services.live.store_sync import StoreSync
from livelora.gateway.services.live.version_checks import VersionChecks

log = logging.getLogger(__name__)


@dataclass
class Lease:
    """A request's hold on the weights serving it; :meth:`release` is idempotent.

    Attributes:
        endpoint: the endpoint name the request resolved to.
        adapter: engine adapter name (``<lineage>@<n>``), or ``None`` for the base model.
    """

    endpoint: str
    adapter: str | None
    _registry: AdapterRegistry | None = None

    @property
    def version(self) -> str:
        """Version label: the adapter name, or ``"base"``."""
        return self.adapter or "base"

    def release(self) -> None:
        """Give the lease back; a drained old version is unloaded in the background."""
        reg, self._registry = self._registry, None
        if reg is not None and self.adapter is not None:
            reg._release(self.adapter)


class AdapterRegistry:
    """Endpoint → current version, with leases and checked hot-swaps.

    Args:
        engine: the started inference engine.
        home: ``LIVELORA_HOME`` (adapter store, ``endpoints.json``).
        base_endpoint: the served base-model name; it is an endpoint (implicit lineage = its name).
        client / keys: Redis for the notice subscriber (``None``: store polling only).
        resync_s: seconds between catch-ups from the store (0 disables).
        max_on_demand: stored versions held because requests named them (:mod:`.on_demand`).
    """

    def __init__(
        self,
        engine: Engine,
        home: Path | str,
        base_endpoint: str,
        *,
        client: aredis.Redis | None = None,
        keys: KeyLayout | None = None,
        resync_s: float = 30.0,
        max_on_demand: int = DEFAULT_MAX_ON_DEMAND,
    ):
        self.engine = engine
        self.store = AdapterStore(home)
        self.endpoint_store = EndpointStore(home)
        self.base_endpoint = base_endpoint
        self.client = client
        self.keys = keys or KeyLayout()
        self.resync_s = resync_s
        #: endpoint → current engine adapter name (``None`` = base model)
        self.current: dict[str, str | None] = {}
        self.bindings: dict[str, EndpointBinding] = {}
        #: adapter name → version manifest, for every version loaded by the registry
        self.loaded: dict[str, Manifest] = {}
        self.checks = VersionChecks(engine)  # loads a version and checks it before it serves
        #: adapter name → reason, for versions that failed their checks (never retried)
        self.refused: dict[str, str] = self.checks.refused
        self.leases: Counter[str] = Counter()
        self.predecessor: dict[str, str | None] = {}  # endpoint → what it served before its last move
        self.stats = None  # LiveStats (live_stats.py): per-version counts, automatic rollback
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self.on_demand = OnDemandVersions(self, max_on_demand)
        self.store_sync = StoreSync(self)  # catch-up from the store and the notices channel
        self.segments = SegmentRouter(self)  # requests of an endpoint → its segments (segments.py)
        record_install_owners(home, self.endpoint_store.get(base_endpoint).lineage)
        self.load_bindings()

    def load_bindings(self) -> dict[str, EndpointBinding]:
        """Re-read ``endpoints.json``: the base endpoint plus every explicit binding; new endpoints start on
        the base model until a version is installed."""
        bindings = {self.base_endpoint: self.endpoint_store.get(self.base_endpoint), **self.endpoint_store.all()}
        self.bindings = bindings
        for endpoint in bindings:
            self.current.setdefault(endpoint, None)
        return bindings

    # ------------------------------------------------------------------ resolving and leasing

    def endpoints(self) -> list[str]:
        """Endpoint names, the base endpoint first (segments' bindings left out: requests reach them by membership)."""
        return [e for e in self.current if not is_segment(e)]

    def endpoint_for(self, model: str, principal: Principal | None) -> str:
        """The endpoint a request's ``model`` names (an endpoint name, or a loaded version name's endpoint) for
        ``principal`` (``None``: outside requests, no tenant filtering).

        Raises:
            ModelNotFoundError: unknown name.
        """
        if model in self.current and self.visible(model, principal) and not is_segment(model):
            return model
        if model in self.loaded:
            lineage = self.loaded[model].lineage
            for ep, b in self.bindings.items():
                if b.lineage == lineage and self.visible(ep, principal) and self.versions_visible(ep, principal):
                    return ep
        shown = [ep for ep in self.endpoints() if self.visible(ep, principal)]
        raise ModelNotFoundError(
            f"model {model!r} does not exist; served endpoints: {', '.join(shown) or 'none'}", param="model"
        )

    def visible(self, endpoint: str, principal: Principal | None) -> bool:
        """Whether ``principal``'s tenant may use ``endpoint`` (always for ``None``: outside requests)."""
        binding = self.bindings.get(endpoint)
        return principal is None or binding is None or binding.visible_to(principal.tenant)

    def versions_visible(self, endpoint: str, principal: Principal | None) -> bool:
        """Whether ``principal``'s tenant may be served, and train, the trained versions of ``endpoint``'s
        lineage: the tenant that administers it. A public endpoint (the base model's name) belongs to tenant
        ``default``; other tenants may sample it but get the untouched base weights."""
        binding = self.bindings.get(endpoint)
        return principal is None or binding is None or binding.administered_by(principal.tenant)

    def check_trainable(self, endpoint: str, principal: Principal | None) -> None:
        """Refuse a signal of ``principal`` that would train ``endpoint``'s lineage its tenant does not own.

        Raises:
            ConflictError: the endpoint is public (the shared base model) and the caller is not its owner, or it is
                a version no endpoint serves (:meth:`.OnDemandVersions.check_trainable`).
        """
        self.on_demand.check_trainable(endpoint)
        if not self.versions_visible(endpoint, principal):
            raise ConflictError(
                f"{endpoint!r} is the shared base model: its feedback trains the lineage of "
                f"tenant default only. Create an endpoint of your own (livelora endpoints create) and "
                f"chat with it to train on your feedback",
                param="model",
                code="not_trainable",
            )

    def resolve(self, model: str, principal: Principal | None) -> tuple[str, str | None]:
        """``(endpoint, adapter)`` that a request of ``principal`` naming ``model`` gets now: an endpoint's current
        version, or a loaded version name itself (one the caller may use, :meth:`.OnDemandVersions.target`; a stored one
        is loaded first by :meth:`.OnDemandVersions.ensure`). Takes no lease (see :meth:`hold`).

        Raises:
            ModelNotFoundError: unknown model name, or another tenant's endpoint or version.
        """
        held = None if model in self.current else self.on_demand.target(model, principal)
        if held is not None:
            return held
        self.endpoint_for(model, principal)  # raises for unknown and other tenants' names
        if model in self.current:
            adapter = self.current[model] if self.versions_visible(model, principal) else None
            return model, (self.stats.route(model, adapter) if self.stats is not None else adapter)
        if model in self.loaded and model not in self.refused:
            return self.endpoint_for(model, principal), model
        self.endpoint_for(model, principal)  # raises ModelNotFoundError
        raise AssertionError("unreachable")

    def hold(self, endpoint: str, adapter: str | None) -> Lease:
        """Lease ``adapter`` (as returned by :meth:`resolve` with no ``await`` in between) until released."""
        if adapter is not None:
            self.leases[adapter] += 1
        if self.stats is not None and endpoint in self.bindings:  # (a version of a lineage no endpoint binds: not)
            self.stats.note_request(endpoint, adapter)
        return Lease(endpoint, adapter, self)

    def acquire(self, model: str, principal: Principal | None = None) -> Lease:
        """Lease the weights for a request naming ``model``: an endpoint (its current version) or a loaded
        version name (that exact version). Synchronous, so no pointer move can interleave.

        Raises:
            ModelNotFoundError: unknown model name.
        """
        return self.hold(*self.resolve(model, principal))

    @contextlib.asynccontextmanager
    async def lease(self, model: str, principal: Principal | None = None) -> AsyncIterator[Lease]:
        """``async with registry.lease(model) as lease:`` — :meth:`acquire`, released on exit."""
        held = self.acquire(model, principal)
        try:
            yield held
        finally:
            held.release()

    def _release(self, adapter: str) -> None:
        self.leases[adapter] -= 1
        if self.leases[adapter] <= 0:
            del self.leases[adapter]
            if self._retired(adapter):
                self._spawn(self._unload(adapter))

    def _retired(self, adapter: str) -> bool:
        return (
            adapter in self.loaded
            and adapter not in self.current.values()
            and not self.leases.get(adapter)
            and adapter not in self.on_demand
            and not (self.stats is not None and self.stats.is_canary(adapter))
        )

    # ------------------------------------------------------------------ installing

    def _lock(self, lineage: str) -> asyncio.Lock:
        return self._locks.setdefault(lineage, asyncio.Lock())

    async def install(self, lineage: str, version: int, *, move: bool = True) -> Manifest:
        """Load, check and (with ``move``) switch every ``follow`` endpoint of ``lineage`` to this version,
        unless an endpoint already serves a newer one.

        Returns:
            The installed version's manifest.

        Raises:
            NotFoundError: no such version in the store.
            BadRequestError: the version failed a check or the engine refused it (it is unloaded,
                recorded in :attr:`refused`; endpoints keep their versions).
        """
        async with self._lock(lineage):
            manifest = self.store.get(lineage, version)
            name = manifest.name
            if name in self.refused:
                raise BadRequestError(f"{name} was refused earlier: {self.refused[name]}", param="adapter")
            if name not in self.loaded:
                t0 = time.perf_counter()
                await self.checks.load(manifest, self.store.version_dir(lineage, version))  # raises: refused
                self.loaded[name] = manifest
                metrics.SWAP_LATENCY.labels(lineage).observe(time.perf_counter() - t0)
                log.info("loaded and checked %s in %.3f s", name, time.perf_counter() - t0)
            if move:
                self._move(lineage, manifest)
            self._count_versions()
            return manifest

    def _move(self, lineage: str, manifest: Manifest) -> None:
        for endpoint, binding in self.bindings.items():
            if binding.lineage != lineage or binding.mode != "follow":
                continue
            if not gate_allows(manifest.gate, endpoint) or manifest.version in binding.blocked:
                continue  # the evaluation gate rejected it for this endpoint, or it was rolled back
            old = self.current.get(endpoint)
            if old is not None and self.loaded[old].version >= manifest.version:
                continue
            if self.stats is not None and self.stats.start_canary(endpoint, manifest.name, old):
                continue  # serves a share of the requests first (live_stats.py)
            self.current[endpoint], self.predecessor[endpoint] = manifest.name, old  # the switch
            log.info("endpoint %s now serves %s (was %s)", endpoint, manifest.name, old or "base")
            if old is not None and self._retired(old):
                self._spawn(self._unload(old))

    def repoint(self, endpoint: str, adapter: str | None) -> None:
        """Make ``endpoint`` serve ``adapter`` (``None``: the base model) from now on (one assignment); the version
        it leaves is unloaded once its last lease is released."""
        old = self.current.get(endpoint)
        self.current[endpoint] = adapter
        if old is not None and old != adapter and self._retired(old):
            self._spawn(self._unload(old))

    async def _unload(self, adapter: str) -> None:
        async with self._lock(self.loaded[adapter].lineage if adapter in self.loaded else adapter):
            if not self._retired(adapter):
                return  # leased again or current again meanwhile
            try:
                await self.engine.unload_adapter(adapter)
            except LiveloraError as exc:
                log.warning("could not unload drained version %s: %s", adapter, exc)
                return
            self.loaded.pop(adapter, None)
            self._count_versions()
            log.info("unloaded drained version %s", adapter)

    def _count_versions(self) -> None:
        """``livelora_loaded_adapter_versions{endpoint}``: versions of each endpoint's lineage loaded now."""
        for endpoint, binding in self.bindings.items():
            n = sum(1 for m in self.loaded.values() if m.lineage == binding.lineage)
            metrics.ADAPTER_VERSIONS.labels(endpoint).set(n)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ catching up (store_sync.py)

    async def sync_from_store(self) -> None:
        """Move every endpoint to what the store says it should serve (:meth:`.StoreSync.sync`)."""
        await self.store_sync.sync()

    async def handle_notice(self, notice: dict) -> None:
        """React to one notice from the notices channel (:meth:`.StoreSync.handle_notice`)."""
        await self.store_sync.handle_notice(notice)

    async def start(self) -> None:
        """Catch up from the store, then start the notice subscriber and the periodic resync."""
        await self.store_sync.sync()
        if self.client is not None:
            self._spawn(self.store_sync.follow_notices())
        if self.resync_s > 0:
            self._spawn(self.store_sync.resync_loop(self.resync_s))

    async def close(self) -> None:
        """Stop background tasks (loaded versions stay in the engine, which the app closes)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
