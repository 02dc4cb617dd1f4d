"""Tinker wire types of checkpoints: ``save_weights``, ``save_weights_for_sampler``, ``load_weights``,
``weights_info``, checkpoint lists and training runs."""

from __future__ import annotations

from typing import Any, Literal

from livelora.clients.types.tinker_data import LenientModel, StrictModel, UserMetadata
from livelora.clients.types.tinker_training import OptimizerConfig


class SaveWeightsRequest(StrictModel):
    """``POST /api/v1/save_weights``: weights **and** optimizer state under ``path`` (a name)."""

    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: UserMetadata | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsResponse(LenientModel):
    """``path``: ``tinker://<model_id>/weights/<name>``."""

    path: str
    type: Literal["save_weights"] | None = "save_weights"


class SaveWeightsForSamplerRequest(StrictModel):
    """``POST /api/v1/save_weights_for_sampler``: named (``path``) or ephemeral (``sampling_session_seq_id``)."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    kind: Literal["snapshot", "inflight"] | None = None
    user_metadata: UserMetadata | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsForSamplerResponse(LenientModel):
    """Named: ``path`` = ``tinker://<model_id>/sampler_weights/<name>``. Ephemeral: ``sampling_session_id``.

    ``adapter`` (livelora extension): the engine adapter name of these weights, usable as ``model`` in
    ``/v1/chat/completions``.
    """

    path: str | None = None
    sampling_session_id: str | None = None
    adapter: str | None = None
    type: Literal["save_weights_for_sampler"] | None = "save_weights_for_sampler"


class LoadWeightsRequest(StrictModel):
    """``POST /api/v1/load_weights``: create-via-load (``session_id`` + ``model_seq_id``, implicit seq 0) or
    legacy load into an existing model (``model_id`` + ``seq_id``)."""

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: UserMetadata | None = None
    optimizer_config: OptimizerConfig | None = None
    path: str
    optimizer: bool = False
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class LoadWeightsResponse(LenientModel):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] | None = "load_weights"


class WeightsInfoRequest(StrictModel):
    """``POST /api/v1/weights_info`` body."""

    tinker_path: str


class WeightsInfoResponse(LenientModel):
    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None
    lora_alpha: float | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class Checkpoint(LenientModel):
    """A saved checkpoint: ``checkpoint_id`` = ``"weights/<name>"`` or ``"sampler_weights/<name>"``."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: str
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    adapter: str | None = None


class Cursor(LenientModel):
    offset: int = 0
    limit: int = 0
    total_count: int = 0


class CheckpointsListResponse(LenientModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(LenientModel):
    training_run_id: str
    base_model: str
    model_owner: str = "local"
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: str | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, Any] | None = None
