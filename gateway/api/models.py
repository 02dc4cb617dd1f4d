"""``GET /v1/models`` and ``GET /v1/models/{id}`` (contract §1.5): ids are exactly the usable ``model`` names."""

from __future__ import annotations

from fastapi import APIRouter

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.openai import Model, ModelList
from livelora.gateway.api.deps import EngineDep, SettingsDep
from livelora.gateway.api.serving import list_models

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def get_models(engine: EngineDep, settings: SettingsDep) -> ModelList:
    """The base model and every loaded adapter."""
    return ModelList(data=list_models(engine, settings))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, engine: EngineDep, settings: SettingsDep) -> Model:
    """One model by id.

    Raises:
        ModelNotFoundError: unknown id (404 ``model_not_found``).
    """
    for model in list_models(engine, settings):
        if model.id == model_id:
            return model
    raise ModelNotFoundError(f"model {model_id!r} does not exist", param="model")
