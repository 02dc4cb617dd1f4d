"""Keeps an adapter registry in step with the store, its source of truth: on start, every ``resync_s`` seconds
and at each Redis notice (``version_published``, ``endpoint_changed``), which only makes it move sooner.

:meth:`StoreSync.sync` moves every endpoint to what the store says it should serve (``pinned``: its version;
``follow``: the newest version that passes its checks and the evaluation gate, else the base model);
:meth:`StoreSync.follow_notices` is the notice subscriber (re-subscribing with back-off when Redis goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING

from livelora.adapters.store import parse_version_name
from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.core.rails import gate_allows

if TYPE_CHECKING:
    from livelora.gateway.services.live.registry import AdapterRegistry

log = logging.getLogger(__name__)


class StoreSync:
    """The catch-up of one :class:`~.registry.AdapterRegistry` from the store and the notices channel."""

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    async def sync(self) -> None:
        """Re-read endpoint bindings and move every endpoint to the version the store says it should serve:
        ``pinned`` → its version; ``follow`` → the newest version that passes the checks (falling back to
        older ones; the base model if none)."""
        reg = self.registry
        bindings = reg.load_bindings()
        for endpoint, binding in bindings.items():
            if binding.mode == "pinned" and binding.version is None:  # pinned to the base model
                reg.repoint(endpoint, None)
                continue
            if binding.mode == "pinned":
                try:
                    manifest = await reg.install(binding.lineage, binding.version, move=False)
                except (NotFoundError, BadRequestError) as exc:
                    log.error(
                        "endpoint %s is pinned to %s@%s which cannot serve: %s",
                        endpoint,
                        binding.lineage,
                        binding.version,
                        exc,
                    )
                    continue
                reg.repoint(endpoint, manifest.name)
                continue
            current = reg.current.get(endpoint)
            have = reg.loaded[current].version if current in reg.loaded else 0
            for manifest in reversed(reg.store.list(binding.lineage)):
                if manifest.version <= have:
                    break
                if (
                    manifest.name in reg.refused
                    or not gate_allows(manifest.gate, endpoint)
                    or manifest.version in binding.blocked
                ):
                    continue
                try:
                    await reg.install(binding.lineage, manifest.version)
                    break
                except (NotFoundError, BadRequestError) as exc:
                    log.error("version %s refused: %s", manifest.name, exc)

    async def handle_notice(self, notice: dict) -> None:
        """React to one notice from the notices channel (unknown types and lineages are ignored)."""
        reg = self.registry
        if notice.get("type") == "endpoint_changed":  # promotion / rollback / new endpoint: re-read the store
            await self.sync()
            return
        if notice.get("type") != "version_published":
            return
        lineage, version = notice.get("lineage"), notice.get("version")
        if not any(b.lineage == lineage for b in reg.bindings.values()):
            return
        try:
            if notice.get("name"):
                parse_version_name(notice["name"])
            gate = reg.store.get(lineage, int(version)).gate
            if not any(
                b.lineage == lineage and b.mode == "follow" and gate_allows(gate, ep) for ep, b in reg.bindings.items()
            ):
                log.info("%s was rejected by the evaluation gate: not loaded", notice.get("name"))
                return
            await reg.install(lineage, int(version))
        except (NotFoundError, BadRequestError, ValueError, TypeError) as exc:
            log.error("announced version %s not installed: %s", notice.get("name"), exc)

    async def resync_loop(self, period_s: float) -> None:
        """Catch up from the store every ``period_s`` seconds until cancelled (a failure is logged, retried)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.sync()
            except Exception:
                log.exception("catch-up from the store failed")

    async def follow_notices(self) -> None:
        """Run the registry's notice subscriber until cancelled: every notice goes to :meth:`handle_notice`; after
        each (re)subscription it first catches up from the store (what was published while it was not
        listening); a lost Redis connection is retried with back-off (0.5 s doubling to 10 s)."""
        registry, backoff = self.registry, 0.5
        while True:
            pubsub = registry.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(registry.keys.notices)
                backoff = 0.5
                await self.sync()  # whatever was published while we were not listening
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    try:
                        notice = json.loads(msg["data"])
                    except (TypeError, ValueError):
                        continue
                    await self.handle_notice(notice)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: retry, then catch up from the store
                log.warning("notice subscription lost (%s); retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
