"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

The handler hands the parsed request to :meth:`~livelora.gateway.services.serving.serve.Serving.serve_messages` (the
chat it asks for: checks, template, budget, admission, version lease, completion log, metering) and encodes what it
serves with :class:`MessagesEncoder` through :func:`~livelora.gateway.api.streaming.respond`: a ``message`` object,
or the stream ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``...,
``content_block_stop``, ``message_delta``, ``message_stop`` (named SSE events). Errors use Anthropic's envelope
(:mod:`livelora.gateway.envelopes`). The reply's id is its completion id (also in ``X-Livelora-Completion-Id``),
which ``POST /v1/feedback`` rates. The route for users: ``docs/clients.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from sse_starlette.sse import ServerSentEvent

from livelora.clients.errors import InternalError, LiveloraError
from livelora.clients.types.anthropic import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    DeltaUsage,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    TextBlock,
    TextDelta,
    Usage,
)
from livelora.gateway.api.deps import CallerDep, PrincipalDep, ServingDep
from livelora.gateway.api.streaming import Event, respond, sse_data
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.envelopes import anthropic_error
from livelora.gateway.services.serving.messages import stop_reason
from livelora.gateway.services.serving.served import ServedRequest

router = APIRouter(tags=["messages"])


@router.post("/v1/messages", response_model=None)
async def create_message(
    body: MessagesRequest, request: Request, serving: ServingDep, caller: CallerDep, principal: PrincipalDep
) -> Response:
    """Create a message: one generation, served and logged like a chat completion."""
    served = await serving.serve_messages(body, principal, caller=caller)
    return await respond(served, MessagesEncoder(served, body, serving.tokenizer), request)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(
    body: CountTokensRequest, serving: ServingDep, principal: PrincipalDep
) -> CountTokensResponse:
    """The prompt tokens of these messages under the served model's chat template."""
    return CountTokensResponse(input_tokens=await serving.count_message_tokens(body, principal))


def _event(payload: BaseModel) -> dict[str, str]:
    data = payload.model_dump(mode="json")
    return {"event": data["type"], "data": sse_data(data)}


def error_event(exc: BaseException) -> dict[str, str]:
    """The ``error`` event ending a stream that failed after its headers (Anthropic's envelope as its data)."""
    err = exc if isinstance(exc, LiveloraError) else InternalError(f"generation failed: {type(exc).__name__}")
    return {"event": "error", "data": sse_data(anthropic_error(err))}


class MessagesEncoder:
    """Messages API shapes of one request (:class:`~livelora.gateway.api.streaming.ChoiceEncoder`, one choice)."""

    kind = "messages"

    def __init__(self, served: ServedRequest, body: MessagesRequest, tokenizer):
        self.served, self.target, self.tokenizer = served, served.target, tokenizer
        self.stream = bool(body.stream)
        self.stops = body.stop_sequences
        self.pieces: list[str] = []
        self.last: GenerationChunk | None = None

    @staticmethod
    def ping() -> ServerSentEvent:
        """The keep-alive event of a stream: ``event: ping`` (Anthropic's)."""
        return ServerSentEvent(**_event(PingEvent()), sep="\n")

    def _usage(self) -> Usage:
        usage = self.served.usage()
        return Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)

    def _stop(self) -> tuple[Any, str | None]:
        if self.last is None:
            return "end_turn", None
        return stop_reason(self.last, self.stops, self.tokenizer)

    def _message(self, content: list[TextBlock], done: bool) -> Message:
        reason, sequence = self._stop() if done else (None, None)
        return Message(
            id=self.served.id,
            content=content,
            model=self.target.model,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=self._usage(),
        )

    # ------------------------------------------------------------------ SSE
    def head(self) -> Iterable[Event]:
        yield _event(MessageStartEvent(message=self._message([], done=False)))
        yield _event(ContentBlockStartEvent(index=0, content_block=TextBlock(text="")))
        yield _event(PingEvent())

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[Event]:
        if chunk.text:
            yield _event(ContentBlockDeltaEvent(index=0, delta=TextDelta(text=chunk.text)))
        if chunk.finish_reason is not None:
            self.last = chunk

    def tail(self) -> Iterable[Event]:
        reason, sequence = self._stop()
        yield _event(ContentBlockStopEvent(index=0))
        yield _event(
            MessageDeltaEvent(
                delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                usage=DeltaUsage(output_tokens=self.served.usage().completion_tokens),
            )
        )
        yield _event(MessageStopEvent())

    def failure(self, exc: BaseException) -> Iterable[Event]:
        yield error_event(exc)

    # ------------------------------------------------------------------ JSON
    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.pieces.append(chunk.text)
        if chunk.finish_reason is not None:
            self.last = chunk

    def body(self) -> dict[str, Any]:
        return self._message([TextBlock(text="".join(self.pieces))], done=True).model_dump(mode="json")
