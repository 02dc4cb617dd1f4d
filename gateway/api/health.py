"""``GET /health``: readiness probe (200 once the engine is loaded) with load figures."""

from __future__ import annotations

from fastapi import APIRouter

from livelora.gateway.api.deps import AdmissionDep, EngineDep, SettingsDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(engine: EngineDep, settings: SettingsDep, admission: AdmissionDep) -> dict:
    """``{"status": "ok", "model", "engine", "sequences", "max_sequences", "adapters_loaded"}``.

    ``sequences`` counts sequences admitted by the gateway (running or waiting). This route needs no key, so
    it gives the number of loaded adapter versions, never their names (which name tenants' lineages).
    """
    return {"status": "ok", "model": settings.model_id, "engine": settings.inference.engine,
            "sequences": admission.active, "max_sequences": admission.limit,
            "adapters_loaded": len(engine.loaded_adapters())}
