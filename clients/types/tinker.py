"""Tinker-shaped wire types for training sessions, shared by the gateway and the SDK (every name importable from
here; the classes live in modules by concern).

Field names follow the ``tinker`` SDK 0.38 JSON forms exactly, so an unmodified tinker SDK and livelora's own SDK
serialise to the same bodies. Request models (:class:`StrictModel`) reject unknown fields: a misspelt parameter is
a clear 400, never silently ignored. Response models (:class:`LenientModel`) ignore extra fields.

* :mod:`.tinker_data`: the bases, token chunks, :class:`ModelInput`, :class:`TensorData`, :class:`Datum`;
* :mod:`.tinker_training`: ``create_model``, ``forward``/``forward_backward``, ``optim_step``, ``get_info``;
* :mod:`.tinker_weights`: saves, loads, weights info, checkpoint lists, training runs;
* :mod:`.tinker_sampling`: sampling sessions and ``asample``;
* :mod:`.tinker_sessions`: sessions, futures, server capabilities.

Token alignment (Tinker's, ``docs/internals/losses.md`` §1): position ``i`` of ``model_input`` predicts token ``i+1``.
"""

from livelora.clients.types.tinker_data import (
    Datum,
    EncodedTextChunk,
    LenientModel,
    ModelInput,
    StrictModel,
    TensorData,
)
from livelora.clients.types.tinker_sampling import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SamplingParams,
)
from livelora.clients.types.tinker_sessions import (
    CreateSessionRequest,
    CreateSessionResponse,
    FinishReason,
    FutureRetrieveRequest,
    GetServerCapabilitiesResponse,
    RequestFailedResponse,
    SessionFinishRequest,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    SupportedModel,
    TryAgainResponse,
    UntypedAPIFuture,
)
from livelora.clients.types.tinker_training import (
    AdamParams,
    CreateModelRequest,
    CreateModelResponse,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ForwardRequest,
    GetInfoRequest,
    GetInfoResponse,
    LoraConfig,
    LossFnType,
    ModelData,
    OptimizerConfig,
    OptimStepRequest,
    OptimStepResponse,
)
from livelora.clients.types.tinker_weights import (
    Checkpoint,
    CheckpointsListResponse,
    Cursor,
    LoadWeightsRequest,
    LoadWeightsResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsForSamplerResponse,
    SaveWeightsRequest,
    SaveWeightsResponse,
    TrainingRun,
    WeightsInfoRequest,
    WeightsInfoResponse,
)

__all__ = [
    "AdamParams",
    "Checkpoint",
    "CheckpointsListResponse",
    "CreateModelRequest",
    "CreateModelResponse",
    "CreateSamplingSessionRequest",
    "CreateSamplingSessionResponse",
    "CreateSessionRequest",
    "CreateSessionResponse",
    "Cursor",
    "Datum",
    "EncodedTextChunk",
    "FinishReason",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "ForwardBackwardRequest",
    "ForwardRequest",
    "FutureRetrieveRequest",
    "GetInfoRequest",
    "GetInfoResponse",
    "GetSamplerResponse",
    "GetServerCapabilitiesResponse",
    "LenientModel",
    "LoadWeightsRequest",
    "LoadWeightsResponse",
    "LoraConfig",
    "LossFnType",
    "ModelData",
    "ModelInput",
    "OptimStepRequest",
    "OptimStepResponse",
    "OptimizerConfig",
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
    "StrictModel",
    "SupportedModel",
    "TensorData",
    "TrainingRun",
    "TryAgainResponse",
    "UntypedAPIFuture",
    "WeightsInfoRequest",
    "WeightsInfoResponse",
]
