"""``GET /health``: readiness probe (200 once the engine is loaded) with load figures."""

from __future__ import annotations

from fastapi import APIRouter

from livelora.gateway.api.deps import ServingDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(serving: ServingDep) -> dict:
    """``{"status": "ok", "model", "engine", "sequences", "max_sequences", "adapters_loaded"}``
    (:meth:`~livelora.gateway.services.serving.Serving.health`)."""
    return serving.health()
