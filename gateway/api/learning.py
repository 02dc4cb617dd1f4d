"""``GET /v1/learning/{endpoint}``: where the next version of one of the caller's endpoints stands.

Stages ``waiting`` (n of the batch size), ``training``, ``gate`` (which check), ``published`` (the version) or
``rejected`` (why), with this step's stage times and the estimated seconds to the next version
(:mod:`livelora.gateway.services.live.learning`).
"""

from __future__ import annotations

from fastapi import APIRouter

from livelora.clients.types.learning import LearningStatus
from livelora.gateway.api.deps import LearningDep, PrincipalDep

router = APIRouter(tags=["signals"])


@router.get("/v1/learning/{endpoint}")
async def get_learning(endpoint: str, learning: LearningDep, principal: PrincipalDep) -> LearningStatus:
    """The learning status of ``endpoint`` (404 ``model_not_found`` for unknown and other tenants' endpoints)."""
    return await learning.status(endpoint, principal)
