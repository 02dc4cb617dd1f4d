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

__all__ = [
    "AdamParams", "CreateModelRequest", "CreateModelResponse", "Datum", "EncodedTextChunk",
    "ForwardBackwardInput", "ForwardBackwardOutput", "ForwardBackwardRequest", "LoraConfig", "LossFnType",
    "ModelInput", "OptimStepRequest", "OptimStepResponse", "OptimizerConfig", "SUPPORTED_LOSSES", "TensorData",
]

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                     "stable_reinforce", "custom", "kto", "dpo"]
"""Loss names: Tinker's ``LossFnType`` plus livelora's ``kto`` and ``dpo`` (preference losses computed
server-side with reference logprobs from the base model)."""

#: The losses the livelora trainer implements (``gspo``, ``stable_reinforce`` and ``custom`` are rejected).
SUPPORTED_LOSSES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "kto", "dpo")


class StrictModel(BaseModel):
    """Base of request models: unknown fields are an error."""

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
    ``importance_sampling``/``ppo``/``cispo``/``dro``: ``target_tokens``, ``logprobs``, ``advantages``;
    ``kto``/``dpo``: see :mod:`livelora.trainer.losses`.
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
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig | None = None
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(LenientModel):
    """Future result of ``create_model``."""

    model_id: str
    type: Literal["create_model"] = "create_model"


class ForwardBackwardInput(StrictModel):
    """A batch and the loss to apply: ``{"data": [Datum], "loss_fn", "loss_fn_config"?}``."""

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
