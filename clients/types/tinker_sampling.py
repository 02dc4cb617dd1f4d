"""Tinker wire types of sampling: sampling sessions, samplers, ``asample`` and its result."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from livelora.clients.types.limits import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from livelora.clients.types.tinker_data import LenientModel, ModelInput, StrictModel


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

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | list[int] | None) -> str | list[str] | list[int] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop accepts at most {MAX_STOP_SEQUENCES} strings or token ids")
        texts = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
        if any(len(s) > MAX_STOP_CHARS for s in texts):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop


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
