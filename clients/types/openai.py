"""OpenAI wire types (Chat Completions, legacy Completions, Models), shared by gateway and SDK.

Field names and shapes follow openai-python (``src/openai/types/``, SDK 3.x), plus the vLLM extensions livelora
honours (their vLLM names). Request models keep unknown fields (``extra="allow"``) so the gateway can name them:
it accepts OpenAI fields that change nothing it serves and refuses the rest
(``gateway/services/serving/request_fields.py``, ``docs/clients.md``); malformed values of known fields are rejected.
Response models ignore unknown fields. Token counts are in tokens of the served model's tokenizer; ``created`` is Unix
seconds; logprobs are in nats. Why: ``docs/internals/wire-types.md``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from livelora.clients.types.nulls import NullMeansOmitted

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Request(NullMeansOmitted):
    """Base of request models: unknown fields are kept (``model_extra``), never an error; ``null`` for an
    optional field means "not given" (:mod:`.nulls`)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class _Response(BaseModel):
    """Base of response models: unknown fields from newer servers are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def _omit_none(value: Any) -> bool:
    return value is None


# --------------------------------------------------------------------------- requests


class ContentPart(_Request):
    """One part of a message's content array: ``{"type": "text", "text": ...}``, or an
    ``image_url`` / ``input_audio`` / ``file`` / ``refusal`` part (kept as extra fields)."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One message of ``messages``.

    ``content`` is a string or a list of parts; it may be ``null`` only for an
    ``assistant`` message that carries ``tool_calls`` or ``function_call``.
    """

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        calls = self.tool_calls or (self.model_extra or {}).get("function_call")
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError(
                f"content is required for a {self.role!r} message "
                "(only an assistant message with tool_calls may have null content)"
            )
        return self


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final ``choices: []`` chunk with usage."""

    include_usage: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]


class _SamplingFields(_Request):
    """Fields shared by chat and legacy completion requests."""

    model: str = Field(min_length=1, description="Served model (base-model name or adapter name).")
    n: int = Field(1, ge=1, le=128, description="Number of choices; each is its own generation.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 means greedy decoding.")
    top_p: float | None = Field(None, ge=0, le=1, description="Nucleus probability mass.")
    seed: int | None = Field(None, description="Choice i uses seed + i: the same seed gives the same texts.")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings, not included in the output.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: minus count × this.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: minus this once used.")
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # livelora extensions (vLLM names), honoured by every engine:
    top_k: int | None = Field(None, ge=0, description="Extension: keep only the k most likely tokens (0 = off).")
    ignore_eos: bool | None = Field(None, description="Extension: keep generating past end-of-sequence tokens.")
    min_tokens: int | None = Field(
        None, ge=0, description="Extension: no end-of-sequence or stop token before this many tokens."
    )
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end generation.")
    include_stop_str_in_output: bool | None = Field(None, description="Extension: keep the matched stop string.")
    skip_special_tokens: bool | None = Field(None, description="Extension: leave special tokens out of the text.")
    repetition_penalty: float | None = Field(None, gt=0, description="Extension: CTRL's, on prompt and output (1 off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension: drop tokens below min_p × the top one's.")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list):
            if len(stop) > 4:
                raise ValueError("stop accepts at most 4 sequences")
            if any(s == "" for s in stop):
                raise ValueError("stop sequences must not be empty")
        return stop

    def stop_tuple(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        if self.stop is None or self.stop == "":
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body (``completion_create_params.py``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="Completion-token budget (tokens).")
    max_tokens: int | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = None
    # livelora extensions (vLLM names): how the chat template renders the messages
    add_generation_prompt: bool | None = Field(None, description="Extension: end with the assistant header (default).")
    continue_final_message: bool | None = Field(
        None, description="Extension: the reply continues the final assistant message (no end of turn after it)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: extra variables for the chat template."
    )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body (legacy; ``completion_create_params.py``)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="Completion-token budget (tokens); default 16.")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5, description="Alternatives per token (0..5).")
    suffix: str | None = None
    best_of: int | None = None


# --------------------------------------------------------------------------- responses


class CompletionUsage(_Response):
    """Token counts of one request: ``total_tokens = prompt_tokens + completion_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    """An alternative token: decoded text, logprob (nats) and its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(_Response):
    """A generated token with its logprob and the ``top_logprobs`` alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=_omit_none)


class Choice(_Response):
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    """``chat.completion`` object (``chat_completion.py``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = Field(None, exclude_if=_omit_none)


class ChoiceDelta(_Response):
    """A streamed delta; absent fields are omitted on the wire."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    refusal: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=_omit_none)


class ChunkChoice(_Response):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    """``chat.completion.chunk`` (``chat_completion_chunk.py``); ``usage`` is non-null only on
    the final ``choices: []`` chunk sent with ``stream_options.include_usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    """Legacy logprobs layout: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class Completion(_Response):
    """``text_completion`` object; streamed chunks have the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class Model(_Response):
    """An entry of ``GET /v1/models``: ``id`` is exactly the name to pass as ``model``.

    ``root`` / ``parent`` (vLLM's fields) name the base model of an adapter. ``sampling_defaults`` (livelora,
    ``GET /v1/models/{id}`` only): what a request that omits ``temperature`` / ``top_p`` / ``top_k`` gets.
    """

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    sampling_defaults: dict[str, Any] | None = Field(None, exclude_if=_omit_none)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[Model]
