"""Signal routes: ``POST /v1/feedback``, ``/v1/preferences``, ``/v1/demonstrations``.

Each handler decodes the body, calls one :class:`~livelora.gateway.services.live.signals.SignalService` method and
marks a replayed answer (``Idempotent-Replayed: true``); the semantics (replace on re-rate, idempotency,
503 while Redis is down) are the service's.
"""

from __future__ import annotations

from fastapi import APIRouter, Header, Response

from livelora.clients.types.signals import (
    DemonstrationRequest,
    DemonstrationResponse,
    FeedbackRequest,
    FeedbackResponse,
    PreferenceRequest,
    PreferenceResponse,
)
from livelora.gateway.api.deps import CallerDep, PrincipalDep, SignalsDep

router = APIRouter(tags=["signals"])

_IDEM_HEADER = Header(
    default=None,
    alias="Idempotency-Key",
    min_length=1,
    max_length=255,
    description="Makes retries safe: the same key and body get the first answer.",
)


def _mark(response: Response, replayed: bool) -> None:
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"


@router.post("/v1/feedback", response_model=FeedbackResponse)
async def post_feedback(
    body: FeedbackRequest,
    signals: SignalsDep,
    caller: CallerDep,
    principal: PrincipalDep,
    response: Response,
    idempotency_key: str | None = _IDEM_HEADER,
) -> FeedbackResponse:
    """Rate one served completion (thumbs up/down, optional score and comment)."""
    out, replayed = await signals.feedback(body, caller=caller, principal=principal, idempotency_key=idempotency_key)
    _mark(response, replayed)
    return out


@router.post("/v1/preferences", response_model=PreferenceResponse)
async def post_preference(
    body: PreferenceRequest,
    signals: SignalsDep,
    caller: CallerDep,
    principal: PrincipalDep,
    response: Response,
    idempotency_key: str | None = _IDEM_HEADER,
) -> PreferenceResponse:
    """Submit a chosen/rejected pair (two completion ids, or prompt + replies inline)."""
    out, replayed = await signals.preference(body, caller=caller, principal=principal, idempotency_key=idempotency_key)
    _mark(response, replayed)
    return out


@router.post("/v1/demonstrations", response_model=DemonstrationResponse)
async def post_demonstration(
    body: DemonstrationRequest,
    signals: SignalsDep,
    caller: CallerDep,
    principal: PrincipalDep,
    response: Response,
    idempotency_key: str | None = _IDEM_HEADER,
) -> DemonstrationResponse:
    """Submit a conversation ending with the ideal assistant reply."""
    out, replayed = await signals.demonstration(
        body, caller=caller, principal=principal, idempotency_key=idempotency_key
    )
    _mark(response, replayed)
    return out
