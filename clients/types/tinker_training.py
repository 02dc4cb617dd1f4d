"""Tinker wire types of the training ops: ``create_model``, ``forward``/``forward_backward``, ``optim_step``,
``get_info``."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from livelora.clients.types.tinker_data import Datum, LenientModel, StrictModel, TensorData, UserMetadata

LossFnType = str
"""Name of a server-side loss (``ForwardBackwardInput.loss_fn``): a plain string on purpose.

The server owns the list: it checks the name against its loss specifications (``livelora.core.losses``,
which this bottom layer does not import) and answers 400 naming ``loss_fn`` for an unknown one, so a new
server-side loss needs no SDK release and an older SDK can use it. Built-in losses: ``cross_entropy``,
``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo`` (Tinker's) and ``kto``, ``dpo`` (livelora's;
reference logprobs from the base model). Tinker's ``stable_reinforce`` and ``custom`` are refused with 400
``unsupported_parameter`` (custom losses run client-side: ``TrainingClient.forward_backward_custom``).
"""


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
    user_metadata: UserMetadata | None = None
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


class ForwardRequest(StrictModel):
    """JSON ``POST /api/v1/forward`` body (SDK ≤0.24): like forward_backward, without the backward pass."""

    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None
    type: Literal["forward"] | None = None


class OptimStepRequest(StrictModel):
    """``POST /api/v1/optim_step`` body."""

    adam_params: AdamParams = Field(default_factory=AdamParams)
    model_id: str
    seq_id: int | None = None
    type: Literal["optim_step"] = "optim_step"


class OptimStepResponse(LenientModel):
    """Result of ``optim_step``: ``metrics`` keys are ``name:reduction``."""

    metrics: dict[str, float] | None = None


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
