"""Per-version live statistics of each endpoint (requests, ratings, thumbs-up rate with a 95 % Wilson interval),
kept in Redis so that every gateway counts into the same numbers, and the automatic rollback they drive.

Requests are counted when a request leases its version (:meth:`AdapterRegistry.hold`); ratings when the
gateway accepts them (``POST /v1/feedback``), under the version that served the rated completion, once per
(completion, rater): a re-rate overwrites. After each rating :meth:`LiveStats.after_rating` runs the sequential
test of :func:`livelora.adapters.rails.sprt_thumbs` on the endpoint's serving version against the version it
replaced, and asks the registry to roll back when the test says so.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aredis

from livelora.adapters.rails import sprt_thumbs, wilson_interval
from livelora.adapters.redis_keys import KeyLayout

log = logging.getLogger(__name__)


class LiveStats:
    """Counts and reads per-version statistics; see the module docstring.

    Args:
        client / keys: Redis.
        live: the gateway's ``LiveSection`` (``rollback_*`` settings).
    """

    def __init__(self, client: aredis.Redis, keys: KeyLayout, live: Any):
        self.client, self.keys, self.live = client, keys, live

    async def count_request(self, endpoint: str, version: str | None) -> None:
        """One request served by ``version`` (``None``: the base model) of ``endpoint``."""
        try:
            await self.client.hincrby(self.keys.version_requests(endpoint), version or "base", 1)
        except Exception as exc:  # statistics never fail a request
            log.debug("request not counted: %s", exc)

    async def count_rating(self, endpoint: str, version: str | None, rating_key: str, up: bool) -> None:
        """One rating (a re-rate by the same rater of the same completion overwrites its earlier one)."""
        await self.client.hset(self.keys.version_ratings(endpoint, version or "base"), rating_key, int(up))

    async def version(self, endpoint: str, version: str) -> dict[str, Any]:
        """``{"version", "requests", "ratings", "thumbs_up", "thumbs_up_rate", "ci95"}`` of one version."""
        requests = await self.client.hget(self.keys.version_requests(endpoint), version)
        values = await self.client.hvals(self.keys.version_ratings(endpoint, version))
        n, up = len(values), sum(int(v) for v in values)
        ci = wilson_interval(up, n)
        return {"version": version, "requests": int(requests or 0), "ratings": n, "thumbs_up": up,
                "thumbs_up_rate": up / n if n else None, "ci95": list(ci) if ci else None}

    async def endpoint(self, endpoint: str) -> list[dict[str, Any]]:
        """Statistics of every version ``endpoint`` has served or had rated, by version label."""
        names = set(await self.client.hkeys(self.keys.version_requests(endpoint)))
        prefix = self.keys.version_ratings(endpoint, "")
        async for key in self.client.scan_iter(match=prefix + "*", count=200):
            names.add(key[len(prefix):])
        return [await self.version(endpoint, v) for v in sorted(names)]

    async def after_rating(self, registry: Any, endpoint: str) -> dict[str, Any] | None:
        """Run the sequential test for ``endpoint``'s serving version; roll back when it says so. Returns the
        rollback's record (None when nothing happened)."""
        live = self.live
        if not live.rollback_enabled:
            return None
        serving, before = registry.current.get(endpoint), registry.predecessor.get(endpoint, False)
        if serving is None or before is False:
            return None
        new, old = await self.version(endpoint, serving), await self.version(endpoint, before or "base")
        if old["ratings"] < live.rollback_min_ratings or not new["ratings"]:
            return None
        decision, llr = sprt_thumbs(new["thumbs_up"], new["ratings"], old["thumbs_up_rate"],
                                    delta=live.rollback_delta, alpha=live.rollback_alpha, beta=live.rollback_beta)
        if decision != "rollback":
            return None
        details = {"test": "sprt", "llr": llr, "delta": live.rollback_delta, "alpha": live.rollback_alpha,
                   "beta": live.rollback_beta, "serving": new, "predecessor": old}
        await roll_back(registry, endpoint, serving, before, details)
        return details


async def roll_back(registry: Any, endpoint: str, serving: str, before: str | None, details: dict) -> None:
    """Move ``endpoint`` back from ``serving`` to ``before`` (``None``: the base model): the version is added to
    the endpoint's ``blocked`` list with an ``auto_rollback`` history line (so every gateway and a restart skip
    it), ``before`` is installed if it was unloaded, the pointer moves (one assignment: requests already running
    finish on ``serving``, which is unloaded after its last lease), and the other gateways are told."""
    import asyncio
    import json
    import time

    from livelora.adapters.store import parse_version_name

    lineage, version = parse_version_name(serving)
    reason = (f"thumbs-up {details['serving']['thumbs_up']}/{details['serving']['ratings']} vs "
              f"{details['predecessor']['thumbs_up']}/{details['predecessor']['ratings']} before: sequential "
              f"test (LLR {details['llr']:.2f})")
    await asyncio.to_thread(registry.endpoint_store.block, endpoint, version, who="gateway", reason=reason,
                            to=before or "base", details=details)
    registry.load_bindings()
    if before is not None:
        await registry.install(*parse_version_name(before), move=False)
    registry.current[endpoint] = before
    registry.predecessor.pop(endpoint, None)
    if registry._retired(serving):
        registry._spawn(registry._unload(serving))
    log.warning("endpoint %s rolled back from %s to %s: %s", endpoint, serving, before or "base", reason)
    try:
        await registry.client.publish(registry.keys.notices, json.dumps(
            {"type": "endpoint_changed", "endpoint": endpoint, "time": time.time()}))
    except Exception as exc:  # the others catch up at their next resync
        log.warning("rollback notice not published: %s", exc)
