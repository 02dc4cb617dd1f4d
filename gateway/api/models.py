"""``GET /v1/models`` and ``GET /v1/models/{id}`` (contract §1.5): ids are exactly the usable ``model`` names."""

from __future__ import annotations

from fastapi import APIRouter, Request

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.openai import Model, ModelList
from livelora.gateway.api.deps import EngineDep, SettingsDep
from livelora.gateway.api.serving import list_models

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def get_models(engine: EngineDep, settings: SettingsDep, request: Request) -> ModelList:
    """The base model and every endpoint the caller may use (open mode: also loaded adapter versions)."""
    return ModelList(data=list_models(engine, settings, getattr(request.app.state, "registry", None)))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, engine: EngineDep, settings: SettingsDep, request: Request) -> Model:
    """One model by id.

    Raises:
        ModelNotFoundError: unknown id (404 ``model_not_found``).
    """
    for model in list_models(engine, settings, getattr(request.app.state, "registry", None)):
        if model.id == model_id:
            return model
    raise ModelNotFoundError(f"model {model_id!r} does not exist", param="model")
