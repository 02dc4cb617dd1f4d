"""Per-version live statistics of each endpoint (requests, ratings, thumbs-up rate with a 95 % Wilson interval),
kept in Redis so that every gateway counts into the same numbers, and the automatic rollback they drive.

Requests are counted when a request leases its version, ratings when the gateway accepts them.
:meth:`LiveStats.after_rating` runs :func:`livelora.core.rails.sprt_thumbs` (rollback, or the canary's verdict);
:meth:`LiveStats.route` draws the canary share per request. The rules: ``docs/rails.md``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any

import redis.asyncio as aredis

from livelora.core.rails import sprt_thumbs, wilson_interval
from livelora.core.redis_keys import KeyLayout

log = logging.getLogger(__name__)

# KEYS[1] ratings hash, KEYS[2] rated-at hash; ARGV: rating key, 1/0, Unix s, keep, trim above, ttl s
_COUNT_RATING = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[5]) then
  local flat = redis.call('HGETALL', KEYS[2])
  local rows = {}
  for i = 1, #flat, 2 do rows[#rows + 1] = {flat[i], tonumber(flat[i + 1])} end
  for _, k in ipairs(redis.call('HKEYS', KEYS[1])) do
    if redis.call('HEXISTS', KEYS[2], k) == 0 then rows[#rows + 1] = {k, 0} end
  end
  table.sort(rows, function(a, b) return a[2] < b[2] end)
  for i = 1, #rows - tonumber(ARGV[4]) do
    redis.call('HDEL', KEYS[1], rows[i][1])
    redis.call('HDEL', KEYS[2], rows[i][1])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
"""


class LiveStats:
    """Counts and reads per-version statistics; see the module docstring.

    Args:
        client / keys: Redis.
        live: the gateway's ``LiveSection`` (``rollback_*`` settings).
    """

    def __init__(
        self, client: aredis.Redis, keys: KeyLayout, live: Any, *, home: Any = None, rng: random.Random | None = None
    ):
        self.client, self.keys, self.live = client, keys, live
        self.home = home
        self.rng = rng or random.Random()
        self._pending: Counter[tuple[str, str]] = Counter()
        self._flusher: asyncio.Task | None = None
        #: endpoint → {"version": canary adapter name, "incumbent": adapter name or None, "started": Unix s}
        self.canaries: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ canary
    def start_canary(self, endpoint: str, version: str, incumbent: str | None) -> bool:
        """With ``canary_share`` > 0, make ``version`` the canary of ``endpoint`` instead of switching to it
        (called by the registry when a version would move a follow endpoint); False: switch at once."""
        if self.live.canary_share <= 0:
            return False
        if self.canaries.get(endpoint, {}).get("version") == version:
            return True
        self.canaries[endpoint] = {"version": version, "incumbent": incumbent, "started": time.time()}
        self._record(
            endpoint,
            "canary",
            incumbent,
            version,
            f"canary at {self.live.canary_share:.0%} of requests",
            {"share": self.live.canary_share, "state": "started"},
        )
        return True

    def is_canary(self, adapter: str) -> bool:
        """Whether ``adapter`` is some endpoint's canary (the registry keeps it loaded)."""
        return any(c["version"] == adapter for c in self.canaries.values())

    def route(self, endpoint: str, adapter: str | None) -> str | None:
        """The version a new request of ``endpoint`` gets: the canary with probability ``canary_share`` while
        the endpoint serves the canary's incumbent, else ``adapter``."""
        c = self.canaries.get(endpoint)
        if c is None or c["incumbent"] != adapter or self.rng.random() >= self.live.canary_share:
            return adapter
        return c["version"]

    def _record(
        self, endpoint: str, action: str, from_: str | None, to: str | None, reason: str, details: dict
    ) -> None:
        if self.home is None:
            return
        from livelora.adapters.endpoints import EndpointStore

        store = EndpointStore(self.home)
        store.record(
            endpoint,
            action,
            who="gateway",
            from_=from_ or "base",
            to=to or "base",
            reason=reason,
            details=details,
            tenant=store.get(endpoint).tenant,
        )

    def _sprt(self, new: dict[str, Any], old: dict[str, Any]) -> tuple[str, float]:
        """:func:`sprt_thumbs` of ``new``'s thumbs against ``old``'s rate, at the live settings' delta, alpha and
        beta: ``(decision, log-likelihood ratio)``."""
        live = self.live
        return sprt_thumbs(
            new["thumbs_up"],
            new["ratings"],
            old["thumbs_up_rate"],
            delta=live.rollback_delta,
            alpha=live.rollback_alpha,
            beta=live.rollback_beta,
        )

    async def _judge_canary(self, registry: Any, endpoint: str) -> dict[str, Any] | None:
        c = self.canaries[endpoint]
        live = self.live
        new, old = await self.version(endpoint, c["version"]), await self.version(endpoint, c["incumbent"] or "base")
        decision, llr = "keep", 0.0
        if old["ratings"] >= live.rollback_min_ratings and new["ratings"]:
            decision, llr = self._sprt(new, old)
        details = {"test": "sprt", "llr": llr, "canary": new, "incumbent": old, "share": live.canary_share}
        if decision == "rollback":  # worse with confidence: the canary ends, the version is never served again
            del self.canaries[endpoint]
            from livelora.adapters.store import parse_version_name

            await asyncio.to_thread(
                registry.endpoint_store.block,
                endpoint,
                parse_version_name(c["version"])[1],
                who="gateway",
                reason=f"canary regressed (LLR {llr:.2f})",
                to=c["incumbent"] or "base",
                details={**details, "state": "aborted"},
            )
            registry.load_bindings()
            if registry._retired(c["version"]):
                registry._spawn(registry._unload(c["version"]))
            return {**details, "state": "aborted"}
        if new["ratings"] < live.canary_min_ratings:
            return None
        del self.canaries[endpoint]  # enough ratings, no regression: the switch completes
        if registry.current.get(endpoint) == c["incumbent"]:
            registry.current[endpoint], registry.predecessor[endpoint] = c["version"], c["incumbent"]
            if c["incumbent"] is not None and registry._retired(c["incumbent"]):
                registry._spawn(registry._unload(c["incumbent"]))
        self._record(
            endpoint,
            "canary",
            c["incumbent"],
            c["version"],
            "canary passed: switch complete",
            {**details, "state": "completed"},
        )
        return {**details, "state": "completed"}

    def note_request(self, endpoint: str, version: str | None) -> None:
        """Count one request served by ``version`` (``None``: the base model) of ``endpoint``: in memory at once
        (synchronous, no Redis round trip per request), added to Redis by :meth:`flush` within a second."""
        self._pending[(endpoint, version or "base")] += 1
        if self._flusher is None or self._flusher.done():
            try:
                self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())
            except RuntimeError:  # no event loop (a synchronous caller): flushed at the next read
                pass

    async def _flush_soon(self) -> None:
        await asyncio.sleep(1.0)
        await self.flush()

    async def close(self) -> None:
        """Flush what is noted and stop the pending flush."""
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        await self.flush()

    async def flush(self) -> None:
        """Add the request counts noted since the last flush to Redis (one pipeline); kept for the next flush
        if Redis is unreachable (statistics never fail a request)."""
        pending, self._pending = self._pending, Counter()
        if not pending:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for (endpoint, version), n in pending.items():
                    pipe.hincrby(self.keys.version_requests(endpoint), version, n)
                await pipe.execute()
        except Exception as exc:
            self._pending.update(pending)
            log.debug("request counts not flushed: %s", exc)

    async def count_rating(self, endpoint: str, version: str | None, rating_key: str, up: bool) -> None:
        """One rating (a re-rate by the same rater of the same completion overwrites its earlier one), with its
        time (:meth:`ratings_over_time`); past ``stats_max_ratings`` + a tenth the version keeps its newest
        ``stats_max_ratings``; both hashes expire ``stats_ttl_s`` after the latest rating (one Lua script)."""
        label = version or "base"
        keep = self.live.stats_max_ratings
        await self.client.eval(
            _COUNT_RATING,
            2,
            self.keys.version_ratings(endpoint, label),
            self.keys.version_rated_at(endpoint, label),
            rating_key,
            int(up),
            f"{time.time():.3f}",
            keep,
            keep + max(1, keep // 10),
            self.live.stats_ttl_s,
        )

    async def ratings_over_time(self, endpoint: str) -> list[tuple[float, str, bool]]:
        """Every counted rating of ``endpoint`` as ``(Unix s, version label, thumbs up)``, oldest first (ratings
        counted before their times were kept are left out)."""
        out = []
        for row in await self.endpoint(endpoint):
            v = row["version"]
            ups = await self.client.hgetall(self.keys.version_ratings(endpoint, v))
            times = await self.client.hgetall(self.keys.version_rated_at(endpoint, v))
            out += [(float(times[k]), v, bool(int(up))) for k, up in ups.items() if k in times]
        return sorted(out)

    async def version(self, endpoint: str, version: str) -> dict[str, Any]:
        """``{"version", "requests", "ratings", "thumbs_up", "thumbs_up_rate", "ci95"}`` of one version."""
        await self.flush()
        requests = await self.client.hget(self.keys.version_requests(endpoint), version)
        values = await self.client.hvals(self.keys.version_ratings(endpoint, version))
        n, up = len(values), sum(int(v) for v in values)
        ci = wilson_interval(up, n)
        return {
            "version": version,
            "requests": int(requests or 0),
            "ratings": n,
            "thumbs_up": up,
            "thumbs_up_rate": up / n if n else None,
            "ci95": list(ci) if ci else None,
        }

    async def endpoint(self, endpoint: str) -> list[dict[str, Any]]:
        """Statistics of every version ``endpoint`` has served or had rated, by version label."""
        await self.flush()
        names = set(await self.client.hkeys(self.keys.version_requests(endpoint)))
        prefix = self.keys.version_ratings(endpoint, "")
        async for key in self.client.scan_iter(match=prefix + "*", count=200):
            names.add(key[len(prefix) :])
        return [await self.version(endpoint, v) for v in sorted(names)]

    async def after_rating(self, registry: Any, endpoint: str) -> dict[str, Any] | None:
        """Run the sequential test for ``endpoint``'s serving version; roll back when it says so. Returns the
        rollback's record (None when nothing happened)."""
        live = self.live
        if endpoint in self.canaries:
            return await self._judge_canary(registry, endpoint)
        if not live.rollback_enabled:
            return None
        serving, before = registry.current.get(endpoint), registry.predecessor.get(endpoint, False)
        if serving is None or before is False:
            return None
        new, old = await self.version(endpoint, serving), await self.version(endpoint, before or "base")
        if old["ratings"] < live.rollback_min_ratings or not new["ratings"]:
            return None
        decision, llr = self._sprt(new, old)
        if decision != "rollback":
            return None
        details = {
            "test": "sprt",
            "llr": llr,
            "delta": live.rollback_delta,
            "alpha": live.rollback_alpha,
            "beta": live.rollback_beta,
            "serving": new,
            "predecessor": old,
        }
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

    _lineage, version = parse_version_name(serving)
    reason = (
        f"thumbs-up {details['serving']['thumbs_up']}/{details['serving']['ratings']} vs "
        f"{details['predecessor']['thumbs_up']}/{details['predecessor']['ratings']} before: sequential "
        f"test (LLR {details['llr']:.2f})"
    )
    await asyncio.to_thread(
        registry.endpoint_store.block,
        endpoint,
        version,
        who="gateway",
        reason=reason,
        to=before or "base",
        details=details,
    )
    registry.load_bindings()
    if before is not None:
        await registry.install(*parse_version_name(before), move=False)
    registry.current[endpoint] = before
    registry.predecessor.pop(endpoint, None)
    if registry._retired(serving):
        registry._spawn(registry._unload(serving))
    log.warning("endpoint %s rolled back from %s to %s: %s", endpoint, serving, before or "base", reason)
    try:
        await registry.client.publish(
            registry.keys.notices, json.dumps({"type": "endpoint_changed", "endpoint": endpoint, "time": time.time()})
        )
    except Exception as exc:  # the others catch up at their next resync
        log.warning("rollback notice not published: %s", exc)
