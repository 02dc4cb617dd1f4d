"""Wire types shared by the gateway and the SDK (pydantic v2; requests forbid unknown fields, responses ignore them)."""

from livelora.clients.types.tinker import (
    AdamParams,
    CreateModelRequest,
    CreateModelResponse,
    Datum,
    EncodedTextChunk,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    LoraConfig,
    LossFnType,
    ModelInput,
    OptimizerConfig,
    OptimStepRequest,
    OptimStepResponse,
    TensorData,
)

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
