"""Gateway-side adapter version bookkeeping: endpoints, leases, checked installs, drained unloads.

* An **endpoint** is a served model name bound to an adapter lineage
  (:mod:`livelora.adapters.endpoints`); its *current* version is the engine
  adapter name ``<lineage>@<n>`` that new requests get, or ``None`` (the base
  model) before the lineage has a version.
* A request takes a **lease** on the endpoint's current version when it is
  admitted (:meth:`AdapterRegistry.acquire` / :meth:`AdapterRegistry.lease`)
  and keeps it until it finishes, so a request started on version k finishes
  on k even if the endpoint moves meanwhile.
* :meth:`AdapterRegistry.install` loads a version into the engine under its
  never-reused name and checks it (:meth:`Engine.load_and_check`: the sha256 of
  the weights as loaded against the manifest; a forward pass on a few canary
  tokens whose logprobs must be finite and ≤ 0),
  then moves the pointer of every ``follow`` endpoint of that lineage (a single
  assignment, atomic on the event loop) whose evaluation gate verdict in the
  manifest allows it (:func:`livelora.core.rails.gate_allows`; a version the
  gate rejected for every endpoint is not even loaded). A version failing a check is unloaded,
  remembered as refused, and the endpoint stays where it was.
* A version that is no longer current is **unloaded** once its last lease is
  released (vLLM guidance, ../shared/reference/vllm_lora.md §1.6: retire only at
  refcount 0).
* Sources of truth: the store (``endpoints.json`` + adapter versions). On
  :meth:`start` and every ``resync_s`` seconds the registry catches up from the
  store; Redis notices (``version_published``) only make it move sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aredis

from livelora.adapters.endpoints import EndpointBinding, EndpointStore, record_install_owners
from livelora.adapters.store import WEIGHTS_FILE, AdapterStore, Manifest, parse_version_name, sha256_file
from livelora.clients.errors import BadRequestError, ConflictError, LiveloraError, ModelNotFoundError, NotFoundError
from livelora.core import metrics
from livelora.core.api_keys import Principal
from livelora.core.rails import gate_allows
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.engines.base import AdapterCheck, Engine
from livelora.gateway.services.on_demand import DEFAULT_MAX_ON_DEMAND, OnDemandVersions

log = logging.getLogger(__name__)

#: Text whose first :data:`CANARY_TOKENS` tokens form the canary forward pass of every installed version.
CANARY_TEXT = "The quick brown fox jumps over the lazy dog. 1 2 3"
#: Canary length in tokens: enough to run every layer (attention included) on a few positions; each token
#: adds about 10 ms of CPU forward time to a swap on SmolLM2-135M, so it is kept short.
CANARY_TOKENS = 4


def check_version(manifest: Manifest, result: AdapterCheck) -> None:
    """The checks a loaded version must pass before it serves (:meth:`AdapterRegistry.install`).

    Args:
        result: what :meth:`Engine.load_and_check` found (sha256 of the weights as loaded, canary logprobs).

    Raises:
        BadRequestError: sha256 differs from the manifest's, or canary logprobs that are missing,
            non-finite or positive.
    """
    if result.sha256 != manifest.sha256:
        raise BadRequestError(
            f"{manifest.name}: weights sha256 {result.sha256[:12]}… does not match the "
            f"manifest's {manifest.sha256[:12]}…",
            param="adapter",
        )
    values = [t.logprob for t in result.canary if t is not None]
    if not values or not all(math.isfinite(v) and v <= 1e-6 for v in values):
        raise BadRequestError(
            f"{manifest.name}: canary forward pass gave invalid logprobs {values[:4]}", param="adapter"
        )


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
        #: adapter name → reason, for versions that failed their checks (never retried)
        self.refused: dict[str, str] = {}
        self.leases: Counter[str] = Counter()
        self.predecessor: dict[str, str | None] = {}  # endpoint → what it served before its last move
        self.stats = None  # LiveStats (live_stats.py): per-version counts, automatic rollback
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._canary: list[int] | None = None
        self.on_demand = OnDemandVersions(self, max_on_demand)
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
        """Endpoint names, the base endpoint first."""
        return list(self.current)

    def endpoint_for(self, model: str, principal: Principal | None) -> str:
        """The endpoint a request's ``model`` names (an endpoint name, or a loaded version name's endpoint) for
        ``principal`` (``None``: outside requests, no tenant filtering).

        Raises:
            ModelNotFoundError: unknown name.
        """
        if model in self.current and self.visible(model, principal):
            return model
        if model in self.loaded:
            lineage = self.loaded[model].lineage
            for ep, b in self.bindings.items():
                if b.lineage == lineage and self.visible(ep, principal) and self.versions_visible(ep, principal):
                    return ep
        shown = [ep for ep in self.current if self.visible(ep, principal)]
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

    def canary_tokens(self) -> list[int]:
        """Token ids of :data:`CANARY_TEXT` under the engine's tokenizer (≥ 2 tokens)."""
        if self._canary is None:
            ids = list(self.engine.tokenizer.encode(CANARY_TEXT, add_special_tokens=False))
            self._canary = ids[:CANARY_TOKENS]
        return self._canary

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
                path = self.store.version_dir(lineage, version)
                t0 = time.perf_counter()
                try:
                    if name in self.engine.loaded_adapters():  # loaded by someone else: check it as it is
                        digest = await asyncio.to_thread(sha256_file, path / WEIGHTS_FILE)
                        result = AdapterCheck(digest, await self.engine.score(self.canary_tokens(), adapter=name))
                    else:
                        result = await self.engine.load_and_check(name, str(path), self.canary_tokens())
                    check_version(manifest, result)
                except BaseException as exc:
                    if name in self.engine.loaded_adapters():
                        with contextlib.suppress(LiveloraError):
                            await self.engine.unload_adapter(name)
                    if isinstance(exc, BadRequestError):
                        self.refused[name] = str(exc)
                        raise
                    if isinstance(exc, (LiveloraError, OSError)):
                        self.refused[name] = f"engine refused it: {exc}"
                        raise BadRequestError(f"{name}: the engine refused it: {exc}", param="adapter") from exc
                    raise
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

    # ------------------------------------------------------------------ catching up

    async def sync_from_store(self) -> None:
        """Re-read endpoint bindings and move every endpoint to the version the store says it should serve:
        ``pinned`` → its version; ``follow`` → the newest version that passes the checks (falling back to
        older ones; the base model if none)."""
        bindings = self.load_bindings()
        for endpoint, binding in bindings.items():
            if binding.mode == "pinned" and binding.version is None:  # pinned to the base model
                old = self.current.get(endpoint)
                self.current[endpoint] = None
                if old and self._retired(old):
                    self._spawn(self._unload(old))
                continue
            if binding.mode == "pinned":
                try:
                    manifest = await self.install(binding.lineage, binding.version, move=False)
                except (NotFoundError, BadRequestError) as exc:
                    log.error(
                        "endpoint %s is pinned to %s@%s which cannot serve: %s",
                        endpoint,
                        binding.lineage,
                        binding.version,
                        exc,
                    )
                    continue
                old = self.current.get(endpoint)
                self.current[endpoint] = manifest.name
                if old and old != manifest.name and self._retired(old):
                    self._spawn(self._unload(old))
                continue
            current = self.current.get(endpoint)
            have = self.loaded[current].version if current in self.loaded else 0
            for manifest in reversed(self.store.list(binding.lineage)):
                if manifest.version <= have:
                    break
                if (
                    manifest.name in self.refused
                    or not gate_allows(manifest.gate, endpoint)
                    or manifest.version in binding.blocked
                ):
                    continue
                try:
                    await self.install(binding.lineage, manifest.version)
                    break
                except (NotFoundError, BadRequestError) as exc:
                    log.error("version %s refused: %s", manifest.name, exc)

    async def handle_notice(self, notice: dict) -> None:
        """React to one notice from the notices channel (unknown types and lineages are ignored)."""
        if notice.get("type") == "endpoint_changed":  # promotion / rollback / new endpoint: re-read the store
            await self.sync_from_store()
            return
        if notice.get("type") != "version_published":
            return
        lineage, version = notice.get("lineage"), notice.get("version")
        if not any(b.lineage == lineage for b in self.bindings.values()):
            return
        try:
            if notice.get("name"):
                parse_version_name(notice["name"])
            gate = self.store.get(lineage, int(version)).gate
            if not any(
                b.lineage == lineage and b.mode == "follow" and gate_allows(gate, ep) for ep, b in self.bindings.items()
            ):
                log.info("%s was rejected by the evaluation gate: not loaded", notice.get("name"))
                return
            await self.install(lineage, int(version))
        except (NotFoundError, BadRequestError, ValueError, TypeError) as exc:
            log.error("announced version %s not installed: %s", notice.get("name"), exc)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            try:
                await self.sync_from_store()
            except Exception:
                log.exception("catch-up from the store failed")

    async def start(self) -> None:
        """Catch up from the store, then start the notice subscriber and the periodic resync."""
        await self.sync_from_store()
        if self.client is not None:
            self._spawn(follow_notices(self))
        if self.resync_s > 0:
            self._spawn(self._resync_loop())

    async def close(self) -> None:
        """Stop background tasks (loaded versions stay in the engine, which the app closes)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


async def follow_notices(registry: AdapterRegistry) -> None:
    """Run ``registry``'s notice subscriber until cancelled: every notice goes to ``handle_notice``; after each
    (re)subscription the registry first catches up from the store (what was published while it was not
    listening); a lost Redis connection is retried with back-off (0.5 s doubling to 10 s)."""
    backoff = 0.5
    while True:
        pubsub = registry.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(registry.keys.notices)
            backoff = 0.5
            await registry.sync_from_store()  # whatever was published while we were not listening
            async for msg in pubsub.listen():
                if msg.get("type") != "message":
                    continue
                try:
                    notice = json.loads(msg["data"])
                except (TypeError, ValueError):
                    continue
                await registry.handle_notice(notice)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis gone: retry, then catch up from the store
            log.warning("notice subscription lost (%s); retrying in %.1f s", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
