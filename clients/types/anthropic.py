"""Anthropic Messages API wire types (``POST /v1/messages``, ``/v1/messages/count_tokens``), shared by gateway and SDK.

Field names and shapes follow the Anthropic Messages API as the official ``anthropic`` Python SDK sends and reads
them. Requests **accept unknown fields** (kept in ``model_extra``, like the OpenAI types); the gateway refuses the
known ones it cannot honour (images, documents, tool use, extended thinking, ...) with ``invalid_request_error``
naming them. Token counts are in tokens of the served model's tokenizer. The route, its event sequence and what
is refused: ``docs/clients.md``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from livelora.clients.types.limits import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from livelora.clients.types.nulls import NullMeansOmitted

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]
#: Anthropic's ``error.type`` by HTTP status (anything else ≥ 500: ``api_error``; other 4xx: invalid request).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class _Request(NullMeansOmitted):
    model_config = ConfigDict(extra="allow", frozen=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# --------------------------------------------------------------------------- requests


class ContentBlockParam(_Request):
    """One block of a message's (or the system prompt's) content: ``{"type": "text", "text": ...}`` is served;
    any other type (``image``, ``document``, ``tool_use``, ``tool_result``, ``thinking``, ...) is kept for the
    gateway to refuse by name."""

    type: str = Field(min_length=1)
    text: str | None = None


class MessageParam(_Request):
    """One turn of ``messages``: ``content`` is a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: Annotated[str, Field(min_length=1)] | Annotated[list[ContentBlockParam], Field(min_length=1)]


class Metadata(_Request):
    """``metadata``: ``user_id`` (the completion log keeps it as the rating user)."""

    user_id: str | None = Field(None, max_length=256)


class _MessagesFields(_Request):
    """Fields shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    model: str = Field(min_length=1, description="Served model, stored version or tinker:// sampler checkpoint.")
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_MessagesFields):
    """``POST /v1/messages`` body."""

    max_tokens: int = Field(ge=1, strict=True, description="Completion-token budget (tokens).")
    temperature: float | None = Field(None, ge=0, le=1, strict=True, description="0 means greedy decoding.")
    top_p: float | None = Field(None, ge=0, le=1, strict=True)
    top_k: int | None = Field(None, ge=0, strict=True, description="Keep only the k most likely tokens (0 = off).")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = Field(False, strict=True)
    metadata: Metadata | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters")
        return stops


class CountTokensRequest(_MessagesFields):
    """``POST /v1/messages/count_tokens`` body."""


# --------------------------------------------------------------------------- responses


class TextBlock(_Response):
    type: Literal["text"] = "text"
    text: str


class Usage(_Response):
    """Token counts: ``input_tokens`` of the rendered prompt, ``output_tokens`` generated (no prompt cache: 0)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(_Response):
    """The ``message`` object (also the ``message`` of a stream's ``message_start``, then with no content)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class MessageDelta(_Response):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class DeltaUsage(_Response):
    output_tokens: int


class TextDelta(_Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class MessageStartEvent(_Response):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(_Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextBlock


class PingEvent(_Response):
    type: Literal["ping"] = "ping"


class ContentBlockDeltaEvent(_Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta


class ContentBlockStopEvent(_Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaEvent(_Response):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: DeltaUsage


class MessageStopEvent(_Response):
    type: Literal["message_stop"] = "message_stop"


class CountTokensResponse(_Response):
    input_tokens: int


class ErrorDetail(_Response):
    type: str
    message: str


class ErrorResponse(_Response):
    """The error envelope: ``{"type": "error", "error": {"type", "message"}}`` (also a stream's ``error`` event)."""

    type: Literal["error"] = "error"
    error: ErrorDetail


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP ``status`` (:data:`ERROR_TYPES`)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"
