"""``GET /health``: readiness probe (200 once the engine is loaded) with load figures."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from livelora.gateway.api.deps import ServingDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(serving: ServingDep) -> JSONResponse:
    """``{"status": "ok", "model", "engine", "sequences", "max_sequences", "adapters_loaded"}``
    (:meth:`~livelora.gateway.services.serving.serve.Serving.health`); 503 with ``"status": "draining"`` once the
    gateway is shutting down (:mod:`livelora.gateway.middleware.drain`), so readiness probes stop routing to it;
    503 with ``"status": "unhealthy"`` and the ``error`` when the engine failed (``Engine.failure``)."""
    figures = serving.health()
    return JSONResponse(figures, status_code=200 if figures["status"] == "ok" else 503)
