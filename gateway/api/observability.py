"""``GET /admin/usage`` (role ``admin``, scoped to the caller's tenant; every tenant for an operator),
``GET /admin/quotas`` and
``PUT /admin/quotas`` (per-tenant limits), and ``GET /metrics`` (Prometheus text; public unless
``LIVELORA_METRICS_REQUIRE_KEY``, see :mod:`livelora.gateway.middleware.auth`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from livelora.clients.errors import NotFoundError
from livelora.clients.types.admin import QuotaUpdateRequest
from livelora.core import metrics
from livelora.core.quotas import Limits
from livelora.gateway.api.deps import (
    AuthOpenDep,
    MeteringDep,
    PrincipalDep,
    ServicesDep,
)

router = APIRouter(tags=["observability"])


@router.get("/admin/usage")
async def usage(
    metering: MeteringDep,
    principal: PrincipalDep,
    open_mode: AuthOpenDep,
    tenant: str | None = None,
    key: str | None = None,
    subject: str | None = None,
    kind: str | None = None,
    start: Annotated[str | None, Query(alias="from")] = None,
    end: Annotated[str | None, Query(alias="to")] = None,
    group_by: str | None = None,
) -> dict:
    """Tokens used, summed per group: ``{"data": [{<group_by dims>, "tokens"}], "group_by", "from", "to"}``.

    Query: ``tenant``, ``key`` (API key id), ``subject`` (endpoint, model or session id), ``kind``, ``from`` /
    ``to`` (Unix s or ISO 8601, UTC hours overlapping the range), ``group_by`` (comma-separated: tenant, key,
    subject, kind, hour, day). A tenant's key sees only its tenant (403 for another); an operator key (and open
    mode) sees every tenant, each in its own rows, unless ``tenant`` picks one.
    """
    return await metering.usage(
        principal,
        tenant=tenant,
        key=key,
        subject=subject,
        kind=kind,
        start=start,
        end=end,
        group_by=group_by,
        open_mode=open_mode,
    )


@router.get("/admin/quotas")
async def get_quotas(
    metering: MeteringDep, principal: PrincipalDep, open_mode: AuthOpenDep, tenant: str | None = None
) -> dict:
    """The caller's tenant's limits and what it holds now: ``{"tenant", "limits": {"max_sessions",
    "max_adapter_versions", "max_adapter_bytes", "tokens_per_day", ...}, "sessions", "adapter_versions",
    "adapter_bytes", "tokens_today", "day"}`` (open mode: any ``tenant``, default ``default``)."""
    return await metering.quotas.report(metering.scoped_tenant(principal, tenant, open_mode))


@router.put("/admin/quotas")
async def set_quotas(
    body: QuotaUpdateRequest, metering: MeteringDep, principal: PrincipalDep, open_mode: AuthOpenDep
) -> dict:
    """Set ``body.tenant``'s limits (fields given override the settings' defaults; ``unlimited`` lifts them) and
    answer its effective limits. Only the operator (open mode, or a key with the operator role) may; 403
    otherwise; 400 for an unknown name in ``unlimited``, an unknown kind or a negative limit."""
    return metering.quotas.set_limits(principal, body.tenant, Limits.from_update(body), open_mode).model_dump()


@router.get("/metrics")
async def prometheus_metrics(services: ServicesDep) -> Response:
    """Prometheus text exposition of this process (or of every process with ``PROMETHEUS_MULTIPROC_DIR``)."""
    if not services.settings.observability.metrics:
        raise NotFoundError("metrics are off (LIVELORA_METRICS=false)")
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)
