"""Enforcing the per-tenant limits of :mod:`livelora.core.quotas` in the gateway: :class:`QuotaService`.

:meth:`~QuotaService.acquire_session` / :meth:`~QuotaService.release_session` (concurrent sessions, one Lua
script), :meth:`~QuotaService.check_tokens` (tokens per UTC day) and :meth:`~QuotaService.check_adapter_versions`
(versions kept, before a save is queued) each answer 429 before any work starts. The rules:
``docs/internals/metering.md``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from livelora.adapters.kept_versions import AdapterVersions
from livelora.clients.errors import PermissionDeniedError, RateLimitError
from livelora.core import metrics
from livelora.core.api_keys import Principal, validate_tenant
from livelora.core.durations import in_words
from livelora.core.quotas import Limits, QuotaStore
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

# KEYS[1] the tenant's session set; ARGV[1] session key stem, ARGV[2] new sid, ARGV[3] limit
# → -1 when added, else ms until the earliest held slot frees
_ACQUIRE = """
local soonest = -1
for _, sid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local ttl = redis.call('PTTL', ARGV[1] .. sid)
  if ttl == -2 then
    redis.call('SREM', KEYS[1], sid)
  elseif ttl >= 0 and (soonest < 0 or ttl < soonest) then
    soonest = ttl
  end
end
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('SADD', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return -1
end
if soonest < 0 then soonest = 0 end
return soonest
"""


class QuotaService:
    """Per-tenant limits of one gateway.

    Args:
        settings: the gateway settings (``quotas`` defaults, ``home``, ``redis_prefix``, ``sessions.session_ttl_s``).
        redis: an asyncio Redis client (``decode_responses=True``).
    """

    def __init__(self, settings: GatewaySettings, redis: Any):
        self.settings = settings
        self.redis = redis
        self.keys = KeyLayout(settings.redis_prefix)
        self.store = QuotaStore(settings.home)
        self.defaults = Limits.from_settings(settings.quotas)
        self.versions = AdapterVersions(settings.home, self.defaults)

    def limits(self, tenant: str) -> Limits:
        """The tenant's effective limits (settings, then ``quotas.json``)."""
        return self.store.get(tenant, self.defaults)

    # ------------------------------------------------------------------ sessions
    async def acquire_session(self, tenant: str, sid: str) -> None:
        """Take a concurrent-session slot for ``sid`` (call before the session exists); without a limit the
        slot is still taken, so :meth:`report` counts the sessions held.

        Raises:
            RateLimitError: the tenant's ``max_sessions`` slots are held (429, ``Retry-After`` = when one frees).
        """
        limit = self.limits(tenant).limit("max_sessions")
        wait_ms = await self.redis.eval(
            _ACQUIRE,
            1,
            self.keys.quota_sessions(tenant),
            self.keys.session(""),
            sid,
            2**31 if limit is None else limit,
            self._slot_ttl_ms(),
        )
        if int(wait_ms) >= 0:
            metrics.REJECTIONS.labels("quota_sessions").inc()
            wait_s = int(wait_ms) / 1000.0
            raise RateLimitError(
                f"tenant {tenant!r} has {limit} of its {limit} concurrent training sessions (limit max_sessions: "
                f"LIVELORA_QUOTA_SESSIONS or PUT /admin/quotas); a slot frees when a session finishes, "
                f"or at the latest in {in_words(wait_s)} when the soonest-expiring one has had no heartbeat for "
                f"{in_words(self.settings.sessions.session_ttl_s)}",
                param="max_sessions",
                code="quota_exceeded",
                retry_after=max(wait_s, 1.0),
            )

    def _slot_ttl_ms(self) -> int:
        return int(self.settings.sessions.session_ttl_s * 1000) + 1000

    async def touch_sessions(self, tenant: str) -> None:
        """Keep the tenant's slot set alive while one of its sessions beats (it expires with the last one)."""
        await self.redis.pexpire(self.keys.quota_sessions(tenant), self._slot_ttl_ms())

    async def release_session(self, tenant: str, sid: str) -> None:
        """Free ``sid``'s slot (a finished session)."""
        await self.redis.srem(self.keys.quota_sessions(tenant), sid)

    async def sessions_held(self, tenant: str) -> int:
        """Slots the tenant holds now (sessions whose record still exists)."""
        held = 0
        for sid in await self.redis.smembers(self.keys.quota_sessions(tenant)):
            held += int(await self.redis.exists(self.keys.session(sid)))
        return held

    # ------------------------------------------------------------------ tokens per day
    async def check_tokens(self, tenant: str, kinds: tuple[str, ...]) -> None:
        """Refuse an operation that would use ``kinds`` when the tenant reached a daily limit of one of them.

        Raises:
            RateLimitError: a kind's ``tokens_per_day`` is used up (429 until 00:00 UTC; nothing was run).
        """
        limits = self.limits(tenant).daily(kinds)
        if not limits:
            return
        now = datetime.now(UTC)
        try:
            used = await self.redis.hmget(self.keys.usage_day(now.strftime("%Y%m%d"), tenant), list(limits))
        except (OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            metrics.REDIS_ERRORS.labels("quotas").inc()  # serving goes on without Redis: limits unchecked
            log.warning("daily token limits of %s not checked, Redis is unreachable: %s", tenant, exc)
            return
        for (kind, limit), n in zip(limits.items(), used):
            if int(n or 0) >= limit:
                metrics.REJECTIONS.labels("quota_tokens").inc()
                midnight = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
                wait_s = (midnight - now).total_seconds()
                raise RateLimitError(
                    f"tenant {tenant!r} used {int(n or 0)} of its {limit} {kind!r} tokens for today (limit "
                    f"tokens_per_day.{kind}); it frees at {midnight:%Y-%m-%d %H:%M} UTC (in {in_words(wait_s)})",
                    param=f"tokens_per_day.{kind}",
                    code="quota_exceeded",
                    retry_after=wait_s,
                )

    # ------------------------------------------------------------------ adapter versions kept
    async def check_adapter_versions(self, tenant: str, adding: int = 1, adding_bytes: int = 0) -> None:
        """Refuse a request that would write ``adding`` more counted adapter versions of ``adding_bytes`` for
        ``tenant`` (call before anything is queued or written).

        Raises:
            RateLimitError: ``max_adapter_versions`` or ``max_adapter_bytes`` would be passed (429
                ``quota_exceeded``, ``param`` the limit; the message names the usage and how to free room).
        """
        limits = self.limits(tenant)
        if limits.limit("max_adapter_versions") is None and limits.limit("max_adapter_bytes") is None:
            return
        try:
            await asyncio.to_thread(self.versions.check, tenant, adding, adding_bytes)
        except RateLimitError:
            metrics.REJECTIONS.labels("quota_versions").inc()
            raise

    # ------------------------------------------------------------------ admin
    async def report(self, tenant: str) -> dict[str, Any]:
        """``{"tenant", "limits", "sessions", "adapter_versions", "adapter_bytes", "tokens_today": {kind: n},
        "day"}`` of one tenant (``adapter_versions``/``adapter_bytes``: the versions it keeps and their bytes, as
        ``max_adapter_versions``/``max_adapter_bytes`` count them)."""
        day = time.strftime("%Y%m%d", time.gmtime())
        today = await self.redis.hgetall(self.keys.usage_day(day, tenant))
        return {
            "tenant": tenant,
            "limits": self.limits(tenant).model_dump(),
            "sessions": await self.sessions_held(tenant),
            "adapter_versions": await asyncio.to_thread(self.versions.count, tenant),
            "adapter_bytes": await asyncio.to_thread(self.versions.bytes_kept, tenant),
            "tokens_today": {k: int(v) for k, v in today.items()},
            "day": day,
        }

    def set_limits(self, principal: Principal, tenant: str, limits: Limits, open_mode: bool) -> Limits:
        """Store ``tenant``'s limits (the operator's: open mode, or a key with the ``operator`` role).

        Raises:
            PermissionDeniedError: another tenant's admin key (tenants do not set their own limits).
            BadRequestError: an invalid tenant name.
        """
        validate_tenant(tenant)
        if not open_mode and "operator" not in principal.roles:
            raise PermissionDeniedError(
                "limits are set by the operator: a key with the operator role (created "
                "with livelora keys create --home <store> --roles admin,operator)",
                param="tenant",
            )
        self.store.set(tenant, limits)
        return self.limits(tenant)
