"""REST, session and future-polling types of the tinker SDK 0.38 (``RestClient``, ``tinker checkpoint ...``).

JSON bodies of the routes SDK 0.38 calls besides the training and sampling ops: training runs and checkpoints
(:class:`TrainingRunV2`, :class:`CheckpointsListResponseV2`, :class:`CheckpointTtlRequest`, ``copy_weights``),
sessions (:class:`ListSessionsResponse`, :class:`SessionSearchRequest`, ``join_sampling_session``), futures
(:class:`FuturesRetrieveRequest`, :class:`CancelFutureRequest`), the client's dynamic config and the caller's own
API key. Field names are the SDK's; the SDK validates responses strictly (required fields and literals must
match, extra fields are ignored). Every route with its request and response type:
``docs/internals/wire-types.md``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field

from livelora.clients.types.tinker import Cursor, LenientModel, OptimizerConfig, StrictModel
from livelora.clients.types.tinker_data import UserMetadata

__all__ = [
    "MAX_TTL_SECONDS",
    "MIN_TTL_SECONDS",
    "CancelFutureRequest",
    "CheckpointArchiveUrlResponse",
    "CheckpointTtlRequest",
    "CheckpointV2",
    "CheckpointsListResponseV2",
    "ClientDynamicConfigResponse",
    "CopyWeightsRequest",
    "CopyWeightsResponse",
    "ExternalWeightsUrlsResponse",
    "FutureFailed",
    "FutureFinished",
    "FuturesRetrieveRequest",
    "FuturesRetrieveResponse",
    "GetSessionResponse",
    "JoinSamplingSessionRequest",
    "JoinSamplingSessionResponse",
    "ListSessionsResponse",
    "SamplingSessionFuturesTarget",
    "SelfApiKeyResponse",
    "SessionSearchCursor",
    "SessionSearchRequest",
    "SessionSearchResponse",
    "SessionSummary",
    "TrainingRunV2",
    "TrainingRunsResponse",
    "WeightsInfoResponseV2",
]

#: Bounds of a checkpoint TTL in seconds as the SDK documents them: 1 hour to 10 years (of 365.25 days).
MIN_TTL_SECONDS = 3600
MAX_TTL_SECONDS = int(10 * 365.25 * 86400)


# ================================================================================================ checkpoints
class CheckpointV2(LenientModel):
    """A checkpoint. ``checkpoint_id`` = ``"<kind>/<name>"`` with kind ``weights`` (``checkpoint_type``
    ``"training"``), ``sampler_weights`` (``"sampler"``) or ``external_weights`` (``"external"``).
    ``expires_at``: when housekeeping deletes it (None = never); ``size_bytes``: bytes on disk."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None
    adapter: str | None = None  # livelora: the engine adapter name of this version (a servable ``model``)


class CheckpointsListResponseV2(LenientModel):
    checkpoints: list[CheckpointV2]
    cursor: Cursor | None = None


class TrainingRunV2(LenientModel):
    """A training run (one training model). ``last_request_time`` is required by SDK ≥0.2x."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: CheckpointV2 | None = None
    last_sampler_checkpoint: CheckpointV2 | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(LenientModel):
    training_runs: list[TrainingRunV2]
    cursor: Cursor


class CheckpointTtlRequest(StrictModel):
    """``PUT …/ttl`` body: seconds from now until expiry (``MIN_TTL_SECONDS``..``MAX_TTL_SECONDS``), or
    None to keep the checkpoint forever."""

    ttl_seconds: int | None = Field(default=None, ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)


class ExternalWeightsUrlsResponse(LenientModel):
    """Download URL per file of an external-weights checkpoint (keys: paths relative to its root), fetched
    by the CLI with plain ``urllib`` (no API key header), so the URLs must carry their own credential."""

    urls: dict[str, str]
    expires: datetime


class CheckpointArchiveUrlResponse(LenientModel):
    """SDK ≤0.24 ``get_checkpoint_archive_url``: a URL of a tar of the checkpoint directory (the CLI checks
    it holds ``adapter_config.json``, ``adapter_model.safetensors`` and ``checkpoint_complete``)."""

    url: str
    expires: datetime


class WeightsInfoResponseV2(LenientModel):
    base_model: str
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class CopyWeightsRequest(StrictModel):
    """``POST /api/v1/copy_weights`` (headers ``X-Idempotency-Key``, optional
    ``X-Tinker-Weights-Access-Token``): a copy of ``source_path`` owned by ``destination_project_id`` or by
    the training-run slot ``session_id`` + ``model_seq_id``."""

    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    source_path: str
    ttl_seconds: int | None = Field(default=None, ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)
    weights_access_token: str | None = None


class CopyWeightsResponse(LenientModel):
    tinker_path: str


# ================================================================================================ sessions
class ListSessionsResponse(LenientModel):
    sessions: list[str]


class GetSessionResponse(LenientModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class SessionSearchCursor(LenientModel):
    last_created_at: datetime
    last_session_id: str


class SessionSearchRequest(StrictModel):
    """``POST /api/v1/sessions/search`` (experimental in the SDK). ``owner``: ``{"type": "own"}``,
    ``{"type": "accessible"}`` or ``{"type": "user", "owner_urns": [...]}``; ``statuses``: ``[{"type":
    "active"|"cancelled"|"failed"|"client_finished", "reasons"?}]``."""

    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: UserMetadata = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: dict[str, Any] = Field(default_factory=lambda: {"type": "own"})
    statuses: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


class SessionSummary(LenientModel):
    """``status``: ``{"type": "active"}``, ``{"type": "client_finished", "reason": {"type": "success"|
    "errored"|"interrupted"}, "detail"}``, ``{"type": "cancelled", "detail"}`` or ``{"type": "failed", ...}``."""

    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: dict[str, Any] | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(LenientModel):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


class ClientDynamicConfigResponse(LenientModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class SelfApiKeyResponse(LenientModel):
    """``GET /api/v1/auth/apikey/me``: the presented key's public metadata. ``details`` =
    ``{"org_details": {"name"}, "user_details": {"email"}}``."""

    key_id: int
    name: str
    note: str
    details: dict[str, dict[str, str]]


# ================================================================================================ futures
class JoinSamplingSessionRequest(StrictModel):
    sampling_session_id: str
    type: Literal["join_sampling_session"] = "join_sampling_session"


class JoinSamplingSessionResponse(LenientModel):
    """``client_counter``: unique among the sampling session's clients (0 = the original); the client then
    numbers its sample ``seq_id`` from ``client_counter * 10**9``."""

    client_counter: int
    type: Literal["join_sampling_session"] = "join_sampling_session"


class SamplingSessionFuturesTarget(StrictModel):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(StrictModel):
    """``POST /api/v1/retrieve_futures``: long-poll completions of one sampling session after
    ``prev_cursor``; ``retrieved_request_ids`` may be forgotten by the server."""

    target: SamplingSessionFuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = Field(default_factory=list)


class FutureFinished(LenientModel):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(LenientModel):
    state: Literal["failed"] = "failed"
    request_id: str


class FuturesRetrieveResponse(LenientModel):
    completions: list[Annotated[FutureFinished | FutureFailed, Field(discriminator="state")]]
    cursor: int


class CancelFutureRequest(StrictModel):
    """``POST /api/v1/cancel_future`` (sent only when ``sample_cancel_enabled``)."""

    request_id: str
