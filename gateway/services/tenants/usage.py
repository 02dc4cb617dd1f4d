"""The gateway's usage metering: counts served and sampled tokens, rolls counters up, answers ``/admin/usage``.

The counting itself, the Redis layout and the store files are :mod:`livelora.core.metering`'s; this
service adds what belongs to a gateway process:

* :func:`payer` — the tenant and API key a request's principal is metered for;
* :meth:`MeteringService.record` — one counter update, never failing the request (a Redis fault is logged and
  counted in the ``livelora_redis_errors_total`` metric);
* a rollup task every ``LIVELORA_USAGE_ROLLUP_S`` seconds and one more on shutdown;
* :meth:`MeteringService.usage` — the report, scoped to the caller's tenant in key mode.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from livelora.clients.errors import PermissionDeniedError, UnavailableError
from livelora.core import metrics
from livelora.core.api_keys import OPEN_PRINCIPAL, Principal
from livelora.core.bus import connect_async, connect_sync
from livelora.core.metering import GROUP_BY, Meter, Usage, UsageStore, parse_time
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.services.tenants.limits import QuotaService
from livelora.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def payer(principal: Principal | None) -> tuple[str, str | None]:
    """``(tenant, API key id)`` that ``principal`` is metered as (open mode and ``None``: ``default``, None)."""
    principal = principal or OPEN_PRINCIPAL
    return principal.tenant, principal.key_id


class MeteringService:
    """Token counters of one gateway process.

    Args:
        settings: the gateway settings (``redis_url``, ``redis_prefix``, ``home``, ``observability``).
    """

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.keys = KeyLayout(settings.redis_prefix)
        self.enabled = settings.observability.metering
        self.meter = Meter(self.keys, enabled=self.enabled)
        self.store = UsageStore(settings.home, self.keys)
        self.redis = connect_async(settings.redis_url)
        self.quotas = QuotaService(settings, self.redis)
        self._sync = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the periodic rollup (when metering is on and ``usage_rollup_s > 0``)."""
        period = self.settings.observability.usage_rollup_s
        if self.enabled and period > 0:
            self._task = asyncio.create_task(self._rollup_loop(period))

    async def close(self) -> None:
        """Stop the rollup task, roll up once more, close the Redis clients."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.enabled:
            try:
                await self.rollup()
            except Exception as exc:
                log.warning("usage rollup at shutdown failed: %s", exc)
        await self.redis.aclose()
        if self._sync is not None:
            self._sync.close()

    async def _rollup_loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.rollup()
            except Exception as exc:
                metrics.REDIS_ERRORS.labels("usage_rollup").inc()
                log.warning("usage rollup failed (retried in %g s): %s", period, exc)

    async def rollup(self) -> int:
        """Move the counters from Redis into the store now (:meth:`UsageStore.rollup_sync`, in a thread).
        Returns the files written."""
        if self._sync is None:
            self._sync = connect_sync(self.settings.redis_url)
        return await asyncio.to_thread(self.store.rollup_sync, self._sync)

    async def record(self, tenant: str, key: str | None, subject: str, tokens: dict[str, int]) -> None:
        """Add ``tokens`` (``{kind: n}``) for ``(tenant, key, subject)``; a Redis fault is logged, not raised."""
        if not self.enabled:
            return
        try:
            await self.meter.record(self.redis, Usage(tenant, key, subject, tokens))
        except Exception as exc:
            metrics.REDIS_ERRORS.labels("metering").inc()
            log.warning("could not meter %s for %s/%s: %s", tokens, tenant, subject, exc)

    @staticmethod
    def scoped_tenant(principal: Principal, tenant: str | None, open_mode: bool) -> str:
        """The tenant a caller may read: its own with a key (``tenant`` must be it or unset); any in open mode or
        with an ``operator`` key.

        Raises:
            PermissionDeniedError: ``tenant`` names another tenant (403).
        """
        if open_mode or "operator" in principal.roles:
            return tenant or principal.tenant
        if tenant is not None and tenant != principal.tenant:
            raise PermissionDeniedError(
                f"this key (tenant {principal.tenant!r}) may only read its own tenant", param="tenant"
            )
        return principal.tenant

    async def usage(
        self,
        principal: Principal,
        *,
        tenant: str | None = None,
        key: str | None = None,
        subject: str | None = None,
        kind: str | None = None,
        start: str | None = None,
        end: str | None = None,
        group_by: str | None = None,
        open_mode: bool = False,
    ) -> dict[str, Any]:
        """``{"data": [row, ...], "group_by": [...], "from": s|None, "to": s|None}``: token counts summed over
        the UTC hours overlapping ``[start, end)``, one row per group (``group_by``: comma-separated dimensions
        of :data:`~livelora.core.metering.GROUP_BY`; default ``tenant,key,subject,kind``).

        A caller with an API key sees only its own tenant (``tenant`` defaults to it); in open mode and with an
        ``operator`` key every tenant is visible (``tenant`` unset: all of them).

        Raises:
            PermissionDeniedError: ``tenant`` names another tenant (403).
            BadRequestError: a bad time, dimension or kind (400).
            UnavailableError: Redis is unreachable (503).
        """
        if not open_mode and "operator" not in principal.roles:
            tenant = self.scoped_tenant(principal, tenant, open_mode)
        dims = [g.strip() for g in group_by.split(",") if g.strip()] if group_by else list(GROUP_BY[:4])
        lo, hi = parse_time(start, "from"), parse_time(end, "to")
        try:
            rows = await self.store.query(
                self.redis, tenant=tenant, key=key, subject=subject, kind=kind, start=lo, end=hi, group_by=dims
            )
        except (OSError, ConnectionError) as exc:
            raise UnavailableError(f"usage counters are unreachable: {exc}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("redis"):
                metrics.REDIS_ERRORS.labels("usage").inc()
                raise UnavailableError(f"usage counters are unreachable: {exc}") from exc
            raise
        return {"data": [r.to_dict() for r in rows], "group_by": dims, "from": lo, "to": hi}
