"""``POST /v1/chat/completions``: chat completions, plain JSON or SSE (contract §1.1-1.3).

The handler hands the parsed request to :meth:`~livelora.gateway.services.serving.serve.Serving.serve` (checks, chat
template, token budget, admission, version lease, completion log, metering) and encodes what it serves with
:class:`ChatEncoder` through :func:`~livelora.gateway.api.streaming.respond`. Validation happens before the first
byte and fails as a plain HTTP error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from livelora.clients.types.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionUsage,
)
from livelora.gateway.api.deps import CallerDep, PrincipalDep, ServingDep, TokenTextsDep
from livelora.gateway.api.logprobs import TokenTexts, chat_logprobs
from livelora.gateway.api.streaming import OpenAIStreamEnd, respond, sse_data
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.services.serving.served import ServedRequest

log = logging.getLogger(__name__)
router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    serving: ServingDep,
    texts: TokenTextsDep,
    caller: CallerDep,
    principal: PrincipalDep,
) -> Response:
    """Create a chat completion with ``n`` choices, each its own generation in the engine batch."""
    served = await serving.serve(body, principal, caller=caller)
    return await respond(served, ChatEncoder(served, body, texts), request)


class ChatEncoder(OpenAIStreamEnd):
    """Chat shapes of one request (:class:`~livelora.gateway.api.streaming.ChoiceEncoder`): ``chat.completion``
    and ``chat.completion.chunk``; a choice's logprobs are returned only when the request asks for them."""

    kind = "chat"

    def __init__(self, served: ServedRequest, body: ChatCompletionRequest, texts: TokenTexts):
        self.served, self.target, self.texts = served, served.target, texts
        self.n = len(served.jobs)
        self.top_n, self.logprobs = body.top_logprobs or 0, bool(body.logprobs)
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.pieces: list[list[str]] = [[] for _ in range(self.n)]
        self.choice_logprobs: list[list] = [[] for _ in range(self.n)]
        self.finish: list[str | None] = [None] * self.n

    def chunk(self, choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        return sse_data(
            ChatCompletionChunk(
                id=self.served.id,
                created=self.served.created,
                model=self.target.model,
                choices=choices,
                usage=usage,
                system_fingerprint=self.target.fingerprint,
            ).model_dump(mode="json")
        )

    # ------------------------------------------------------------------ SSE
    def head(self) -> Iterable[str]:
        for i in range(self.n):
            yield self.chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[str]:
        if chunk.text or ((chunk.logprobs or chunk.stop_token) and self.logprobs):
            lp = (
                ChoiceLogprobs(content=chat_logprobs(self.texts, chunk.logprobs, self.top_n, chunk.stop_token))
                if (chunk.logprobs or chunk.stop_token) and self.logprobs
                else None
            )
            yield self.chunk([ChunkChoice(index=index, delta=ChoiceDelta(content=chunk.text), logprobs=lp)])
        if chunk.finish_reason is not None:
            yield self.chunk([ChunkChoice(index=index, delta=ChoiceDelta(), finish_reason=chunk.finish_reason)])

    def usage(self) -> str:
        return self.chunk([], usage=self.served.usage())

    # ------------------------------------------------------------------ JSON
    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.pieces[index].append(chunk.text)
        if (chunk.logprobs or chunk.stop_token) and self.logprobs:
            self.choice_logprobs[index] += chat_logprobs(self.texts, chunk.logprobs or [], self.top_n, chunk.stop_token)
        if chunk.finish_reason is not None:
            self.finish[index] = chunk.finish_reason

    def body(self) -> dict[str, Any]:
        choices = [
            Choice(
                index=i,
                message=ChatCompletionMessage(content="".join(self.pieces[i])),
                finish_reason=self.finish[i] or "stop",
                logprobs=ChoiceLogprobs(content=self.choice_logprobs[i]) if self.logprobs else None,
            )
            for i in range(self.n)
        ]
        return ChatCompletion(
            id=self.served.id,
            created=self.served.created,
            model=self.target.model,
            choices=choices,
            usage=self.served.usage(),
            system_fingerprint=self.target.fingerprint,
        ).model_dump(mode="json")
