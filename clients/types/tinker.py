"""Tinker-shaped wire types for training sessions, shared by the gateway and the SDK.

Field names follow the ``tinker`` SDK 0.38 JSON forms exactly (see
``shared/reference/tinker_protocol.md`` §1.6 and §2.4), so an unmodified tinker
SDK and livelora's own SDK serialise to the same bodies.

* Request models (:class:`StrictModel`) reject unknown fields: a misspelt
  parameter is a clear 400, never silently ignored.
* Response models (:class:`LenientModel`) ignore extra fields, so an older
  client keeps working when the server adds a field.

Token alignment (Tinker convention): position ``i`` of ``model_input``
predicts token ``i+1``; every per-token ``loss_fn_inputs`` tensor has shape
``(N,)`` with ``N = model_input.length``, and ``target_tokens[i]`` is the token
after input ``i``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from livelora.clients.types.nulls import NullMeansOmitted

__all__ = [
    "AdamParams",
    "CreateModelRequest",
    "CreateModelResponse",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "ForwardBackwardRequest",
    "LoraConfig",
    "LossFnType",
    "ModelInput",
    "OptimStepRequest",
    "OptimStepResponse",
    "OptimizerConfig",
    "TensorData",
]

LossFnType = str
"""Name of a server-side loss (``ForwardBackwardInput.loss_fn``): a plain string on purpose.

The server owns the list: it checks the name against its loss specifications (``livelora.core.losses``,
which this bottom layer does not import) and answers 400 naming ``loss_fn`` for an unknown one, so a new
server-side loss needs no SDK release and an older SDK can use it. Built-in losses: ``cross_entropy``,
``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo`` (Tinker's) and ``kto``, ``dpo`` (livelora's;
reference logprobs from the base model). Tinker's ``stable_reinforce`` and ``custom`` are refused with 400
``unsupported_parameter`` (custom losses run client-side: ``TrainingClient.forward_backward_custom``).
"""


class StrictModel(NullMeansOmitted):
    """Base of request models: unknown fields are an error; ``null`` for an optional field means "not given"
    (:mod:`.nulls`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LenientModel(BaseModel):
    """Base of response models: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class EncodedTextChunk(StrictModel):
    """A run of token ids (``{"type": "encoded_text", "tokens": [...]}``)."""

    tokens: list[int] = Field(description="Token ids of the base model's tokenizer.")
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(StrictModel):
    """The tokens fed to the model: a list of chunks (only ``encoded_text`` chunks are supported)."""

    chunks: list[EncodedTextChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        """One ``encoded_text`` chunk holding ``tokens``."""
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    def to_ints(self) -> list[int]:
        """All token ids, chunks concatenated."""
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        """Number of tokens (``N``)."""
        return sum(len(c.tokens) for c in self.chunks)


class TensorData(StrictModel):
    """A dense tensor on the wire: ``{"data": [flat values], "dtype": "int64"|"float32", "shape": [dims]}``.

    ``shape`` may be omitted for a 1-D tensor (then it is ``[len(data)]``). Sparse CSR forms are not supported.
    """

    data: list[float] | list[int] = Field(description="Values in row-major order.")
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = Field(default=None, description="Dimensions; None means 1-D.")

    @classmethod
    def from_list(cls, values: list[float] | list[int], dtype: Literal["int64", "float32"]) -> TensorData:
        """A 1-D tensor of ``values``."""
        return cls(data=list(values), dtype=dtype, shape=[len(values)])

    @classmethod
    def from_torch(cls, t: Any) -> TensorData:
        """From a torch tensor (int tensors become int64, floating ones float32)."""
        import torch

        dtype = "int64" if not torch.is_floating_point(t) else "float32"
        flat = t.detach().cpu().reshape(-1)
        return cls(data=flat.tolist(), dtype=dtype, shape=list(t.shape))

    def to_torch(self) -> Any:
        """As a torch tensor of the declared dtype and shape (raises ValueError if sizes disagree)."""
        import torch

        t = torch.tensor(self.data, dtype=torch.int64 if self.dtype == "int64" else torch.float32)
        return t.reshape(self.resolved_shape())

    def resolved_shape(self) -> list[int]:
        """``shape``, or ``[len(data)]`` when omitted."""
        return list(self.shape) if self.shape is not None else [len(self.data)]

    def tolist(self) -> list[Any]:
        """The flat values."""
        return list(self.data)


class Datum(StrictModel):
    """One training example: the model input and the per-token tensors the loss reads.

    ``loss_fn_inputs`` keys by loss: ``cross_entropy``: ``target_tokens`` (int64 [N]), ``weights`` (float32 [N]);
    ``importance_sampling``/``ppo``/``cispo``/``dro``: ``target_tokens``, ``logprobs``, ``advantages``
    (optional ``mask``); ``kto``: ``target_tokens``, ``weights`` (completion mask), ``label`` (float32 [1]);
    ``dpo``: ``target_tokens``, ``weights``, datums in (chosen, rejected) pairs. The server's loss
    specifications (``livelora.core.losses``) are the authority and name any missing or extra key.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)


class AdamParams(StrictModel):
    """AdamW hyperparameters of one ``optim_step`` (Tinker defaults; decoupled weight decay as torch.optim.AdamW)."""

    learning_rate: float = Field(default=1e-4, ge=0.0)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    eps: float = Field(default=1e-12, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip_norm: float = Field(default=0.0, ge=0.0, description="Max global L2 norm of the gradients; 0 = none.")

    @model_validator(mode="after")
    def _finite(self) -> AdamParams:
        for name, value in self.model_dump().items():
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        return self


class LoraConfig(StrictModel):
    """LoRA shape of a training model (Tinker ``LoraConfig`` plus livelora's ``alpha``).

    ``alpha`` is a livelora extension (Tinker has none; None means 32, the value SkyRL assumes for Tinker).
    The LoRA scale is ``alpha / rank``.
    """

    rank: int = Field(default=32, ge=1, le=512)
    seed: int | None = Field(default=None, description="Seed of the adapter init; None means 0.")
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    alpha: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _some_target(self) -> LoraConfig:
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")
        return self


class OptimizerConfig(StrictModel):
    """Optimizer chosen at model creation; only AdamW is implemented."""

    type: Literal["adamw"] = "adamw"


class CreateModelRequest(StrictModel):
    """``POST /api/v1/create_model`` body."""

    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, str] | None = None
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig | None = None
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(LenientModel):
    """Future result of ``create_model``."""

    model_id: str
    type: Literal["create_model"] = "create_model"


class ForwardBackwardInput(StrictModel):
    """A batch and the loss to apply: ``{"data": [Datum], "loss_fn", "loss_fn_config"?}``.

    ``loss_fn`` is any string here (see :data:`LossFnType`); the server validates it with the batch.
    """

    data: list[Datum]
    loss_fn: LossFnType
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardRequest(StrictModel):
    """JSON ``POST /api/v1/forward_backward`` body (SDK ≤0.24 form)."""

    forward_backward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None
    type: Literal["forward_backward"] = "forward_backward"


class ForwardBackwardOutput(LenientModel):
    """Result of ``forward``/``forward_backward``.

    ``loss_fn_outputs[i]["logprobs"]`` is float32 [N_i]: log p(target_tokens) of datum ``i`` (nats).
    ``metrics`` keys are ``name:reduction`` (at least ``loss:sum``).
    """

    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorData]] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)


class OptimStepRequest(StrictModel):
    """``POST /api/v1/optim_step`` body."""

    adam_params: AdamParams = Field(default_factory=AdamParams)
    model_id: str
    seq_id: int | None = None
    type: Literal["optim_step"] = "optim_step"


class OptimStepResponse(LenientModel):
    """Result of ``optim_step``: ``metrics`` keys are ``name:reduction``."""

    metrics: dict[str, float] | None = None


# ================================================================================================ sessions
# Request/response bodies of the remaining ``/api/v1`` routes (tinker_protocol.md §2.4, JSON forms of SDK ≤0.24).


class CreateSessionRequest(StrictModel):
    """``POST /api/v1/create_session`` body."""

    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, str] | None = None
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


class GetInfoRequest(StrictModel):
    model_id: str
    type: Literal["get_info"] = "get_info"


class ModelData(LenientModel):
    """``arch``: HF architecture; ``model_name``: base-model name; ``tokenizer_id``: the base model's Hugging Face
    hub id when one is known, else the served model name (never a server path); the tokenizer files themselves
    are served by ``GET /api/v1/tokenizer``."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(LenientModel):
    """Answer of ``get_info``. ``lora_alpha`` is a livelora extension."""

    type: Literal["get_info"] | None = "get_info"
    model_data: ModelData
    model_id: str
    is_lora: bool | None = True
    lora_rank: int | None = None
    lora_alpha: float | None = None
    model_name: str | None = None


class ForwardRequest(StrictModel):
    """JSON ``POST /api/v1/forward`` body (SDK ≤0.24): like forward_backward, without the backward pass."""

    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None
    type: Literal["forward"] | None = None


class SaveWeightsRequest(StrictModel):
    """``POST /api/v1/save_weights``: weights **and** optimizer state under ``path`` (a name)."""

    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
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
    user_metadata: dict[str, str] | None = None
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
    user_metadata: dict[str, str] | None = None
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


class CreateSamplingSessionRequest(StrictModel):
    """``POST /api/v1/create_sampling_session``: sample a sampler checkpoint (``model_path``) or the base model."""

    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(LenientModel):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(LenientModel):
    """``GET /api/v1/samplers/{id}``. ``adapter``: engine adapter name (None = base model; livelora extension)."""

    sampler_id: str
    base_model: str
    model_path: str | None = None
    adapter: str | None = None


class SamplingParams(StrictModel):
    """Tinker sampling parameters.

    * ``max_tokens``: completion-token budget; None = up to the context length.
    * ``stop``: a string, strings, or token ids ending a sample (the EOS tokens always stop too);
      ``[]`` disables every stop including EOS.
    * ``temperature`` (0 = greedy), ``top_k`` (-1 or 0 = off), ``top_p`` (1 = off), ``seed``.
    """

    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


class SampleRequest(StrictModel):
    """``POST /api/v1/asample`` body. Address the weights by ``sampling_session_id`` (+ ``seq_id``) or, legacy,
    by ``model_path`` / ``base_model``."""

    num_samples: int = Field(default=1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=20)
    type: Literal["sample"] = "sample"


class SampledSequence(LenientModel):
    """One sample: ``tokens`` (completion token ids, a stop token included), ``logprobs`` (one per token, nats).

    ``logprobs`` are of the **raw model distribution** of the sampling weights (log_softmax of the logits
    before temperature, top-k and top-p): at temperature 1 with no top-k/top-p they are the sampling
    distribution's and agree with ``compute_logprobs``; otherwise they are not the tempered probabilities.
    """

    stop_reason: Literal["stop", "length"]
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = None


class SampleResponse(LenientModel):
    """Result of ``asample``. ``prompt_logprobs[i]`` = log p(prompt_i | prompt_<i) (None at 0);
    ``topk_prompt_logprobs[i]`` = the k most likely ``(token_id, logprob)`` at position i (None at 0)."""

    sequences: list[SampledSequence]
    type: Literal["sample"] = "sample"
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


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


class SupportedModel(LenientModel):
    model_name: str
    max_context_length: int | None = None
    trainable: bool | None = True
    sampleable: bool | None = True
    tokenizer_id: str | None = None


class GetServerCapabilitiesResponse(LenientModel):
    supported_models: list[SupportedModel]


__all__ += [
    "Checkpoint",
    "CheckpointsListResponse",
    "CreateSamplingSessionRequest",
    "CreateSamplingSessionResponse",
    "CreateSessionRequest",
    "CreateSessionResponse",
    "Cursor",
    "ForwardRequest",
    "FutureRetrieveRequest",
    "GetInfoRequest",
    "GetInfoResponse",
    "GetSamplerResponse",
    "GetServerCapabilitiesResponse",
    "LoadWeightsRequest",
    "LoadWeightsResponse",
    "ModelData",
    "RequestFailedResponse",
    "SampleRequest",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerRequest",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsRequest",
    "SaveWeightsResponse",
    "SessionFinishRequest",
    "SessionHeartbeatRequest",
    "SessionHeartbeatResponse",
    "SupportedModel",
    "TrainingRun",
    "TryAgainResponse",
    "UntypedAPIFuture",
    "WeightsInfoRequest",
    "WeightsInfoResponse",
]
