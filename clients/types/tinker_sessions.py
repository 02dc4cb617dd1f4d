"""Tinker wire types of sessions and futures: ``create_session``, heartbeats, ``finish``, the future every
asynchronous op answers, ``retrieve_future``'s answers, and the server's capabilities."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from livelora.clients.types.tinker_data import MAX_TAGS, LenientModel, StrictModel, UserMetadata


class CreateSessionRequest(StrictModel):
    """``POST /api/v1/create_session`` body."""

    tags: list[str] = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: UserMetadata | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(LenientModel):
    """Answer of ``create_session``."""

    session_id: str
    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(StrictModel):
    """``POST /api/v1/session_heartbeat`` body (the SDK sends one every 10 s)."""

    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(LenientModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(StrictModel):
    type: Literal["success", "errored", "interrupted"] = "success"


class SessionFinishRequest(StrictModel):
    """``POST /api/v1/sessions/{session_id}/finish`` body: frees the session's models and samplers."""

    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class UntypedAPIFuture(LenientModel):
    """What every asynchronous op answers at once; the result comes from ``retrieve_future``.

    ``sample_sequence_ids``: one id per requested sample (``asample`` only; required by SDK ≥0.26).
    """

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class FutureRetrieveRequest(StrictModel):
    """``POST /api/v1/retrieve_future`` body."""

    request_id: str
    allow_metadata_only: bool = False


class TryAgainResponse(LenientModel):
    """ "Not done yet" (sent with HTTP 408 after the server's long-poll; the SDK re-polls at once)."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"


class RequestFailedResponse(LenientModel):
    """A failed op's future result (HTTP 200): ``{"error", "category"}`` plus livelora's error class fields.

    ``category`` is ``"user"`` (fix the request), ``"server"`` or ``"unknown"``; ``class``/``code``/``param``
    let livelora's SDK rebuild the exact :mod:`livelora.clients.errors` exception.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    error: str
    category: Literal["user", "server", "unknown"] = "unknown"
    error_class: str | None = Field(default=None, alias="class")
    code: str | None = None
    param: str | None = None


class SupportedModel(LenientModel):
    model_name: str
    max_context_length: int | None = None
    trainable: bool | None = True
    sampleable: bool | None = True
    tokenizer_id: str | None = None


class GetServerCapabilitiesResponse(LenientModel):
    supported_models: list[SupportedModel]
