"""``GET /v1/models`` and ``GET /v1/models/{id}`` (contract §1.5): ids are exactly the usable ``model`` names."""

from __future__ import annotations

from fastapi import APIRouter

from livelora.clients.types.openai import Model, ModelList
from livelora.gateway.api.deps import PrincipalDep, ServingDep
from livelora.gateway.services.serving.sampling_defaults import for_settings

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def get_models(serving: ServingDep, principal: PrincipalDep) -> ModelList:
    """The base model and every endpoint the caller may use (open mode: also loaded adapter versions)."""
    return ModelList(data=serving.list_models(principal))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, serving: ServingDep, principal: PrincipalDep) -> Model:
    """One model by id: a listed one, or a stored ``<lineage>@<n>`` the caller may name (the list leaves those
    out; a request naming one loads it, gateway/services/live/on_demand.py).

    ``sampling_defaults`` says what a request omitting ``temperature`` / ``top_p`` / ``top_k`` gets (every served
    model shares the base model's; gateway/services/serving/sampling_defaults.py).

    Raises:
        ModelNotFoundError: unknown id (404 ``model_not_found``).
    """
    model = serving.get_model(model_id, principal)
    return model.model_copy(update={"sampling_defaults": for_settings(serving.settings).describe()})
