"""``POST /v1/chat/completions``: chat completions, plain JSON or SSE (contract §1.1-1.3).

The handler decodes the request into engine jobs (:func:`check_chat`, the chat template, the token budget),
begins the served request (:meth:`~livelora.gateway.services.serving.Serving.begin`: target, admission,
version lease, completion recorder) and answers through the shared lifecycle of
:func:`~livelora.gateway.api.streaming.respond` with :class:`ChatEncoder`'s wire shapes. Validation happens
before the first byte and fails as a plain HTTP error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
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
from livelora.gateway.api.deps import CallerDep, ServingDep, TokenTextsDep
from livelora.gateway.api.logprobs import TokenTexts, chat_logprobs
from livelora.gateway.api.streaming import respond, sse_data
from livelora.gateway.chat_template import render_messages
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.services.generation import Job, budget, check_common, log_ignored, sampling_params
from livelora.gateway.services.prompt_limits import chat_prompt
from livelora.gateway.services.serving import Recording, ServedRequest, Serving

log = logging.getLogger(__name__)
router = APIRouter(tags=["chat"])


def check_chat(body: ChatCompletionRequest) -> None:
    """Reject chat parameters that cannot be honoured (400 naming ``param``).

    Raises:
        BadRequestError: both max-token fields, or ``top_logprobs`` without ``logprobs``.
        UnsupportedParameterError: ``tools``/``functions``, ``tool_choice`` other than ``none``,
            ``response_format`` other than ``text``, audio output, penalties, ``logit_bias``.
    """
    check_common(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise BadRequestError(
            "set only one of max_tokens and max_completion_tokens (max_tokens is deprecated)",
            param="max_tokens",
            code="invalid_parameter_combination",
        )
    if body.tools:
        raise UnsupportedParameterError(
            "tools are not supported: the served model's chat template has no tool-calling format", param="tools"
        )
    if body.functions:
        raise UnsupportedParameterError(
            "functions are not supported: the served model's chat template has no tool-calling format",
            param="functions",
        )
    if body.tool_choice not in (None, "none"):
        raise UnsupportedParameterError(
            "tool_choice is only allowed as 'none' (tools are not supported)", param="tool_choice"
        )
    if body.response_format is not None and body.response_format.type != "text":
        raise UnsupportedParameterError(
            f"response_format {body.response_format.type!r} is not supported: "
            "output cannot be constrained to JSON; use type 'text'",
            param="response_format",
        )
    if body.top_logprobs and not body.logprobs:
        raise BadRequestError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_parameter_combination"
        )
    extra = body.model_extra or {}
    if any(m != "text" for m in extra.get("modalities") or []):
        raise UnsupportedParameterError("only the 'text' modality is supported", param="modalities")
    if extra.get("audio") is not None:
        raise UnsupportedParameterError("audio output is not supported", param="audio")


def chat_jobs(
    body: ChatCompletionRequest, serving: Serving, prompt: list[int] | None = None, cap: int | None = None
) -> list[Job]:
    """The request's ``n`` engine jobs: one rendered prompt, one seed per choice (``seed + i``).

    ``prompt``: the messages already rendered (:func:`~livelora.gateway.services.prompt_limits.chat_prompt`);
    ``cap``: the largest default budget per choice when no max-token field is set.

    Raises:
        BadRequestError, UnsupportedParameterError: see :func:`check_chat`.
        ContextLengthExceededError: the prompt and the token budget do not fit the context window.
    """
    check_chat(body)
    prompt = render_messages(serving.tokenizer, body.messages) if prompt is None else prompt
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = budget(len(prompt), requested, param, serving.context_length(), "messages")
    if requested is None and cap is not None:  # the tenant's max_n_tokens bounds the default budget
        max_tokens = min(max_tokens, cap)
    # logprobs are always computed: the completion log keeps them (responses only carry them on request)
    return [
        Job(prompt, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=body.top_logprobs or 0))
        for i in range(body.n)
    ]


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, serving: ServingDep, texts: TokenTextsDep, caller: CallerDep
) -> Response:
    """Create a chat completion with ``n`` choices, each its own generation in the engine batch."""
    log_ignored(body, "chat.completions")
    messages = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
    check_chat(body)
    prompt, cap = await chat_prompt(body, serving)  # cheap limits first, then the template off the event loop
    await serving.load_on_demand(body.model)  # a stored <lineage>@<n> not loaded yet; then no await until begin
    served = serving.begin(
        body.model,
        lambda: chat_jobs(body, serving, prompt, cap),
        id_prefix="chatcmpl",
        recording=Recording(caller=caller, user=body.user, messages=messages),
    )
    return await respond(served, ChatEncoder(served, body, texts), request)


class ChatEncoder:
    """Chat shapes of one request (:class:`~livelora.gateway.api.streaming.ChoiceEncoder`): ``chat.completion``
    and ``chat.completion.chunk``; a choice's logprobs are returned only when the request asks for them."""

    kind = "chat"

    def __init__(self, served: ServedRequest, body: ChatCompletionRequest, texts: TokenTexts):
        self.served, self.target, self.texts = served, served.target, texts
        self.n = len(served.jobs)
        self.prompt_tokens = len(served.jobs[0].prompt_ids)
        self.top_n, self.logprobs = body.top_logprobs or 0, bool(body.logprobs)
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.tokens = 0
        self.pieces: list[list[str]] = [[] for _ in range(self.n)]
        self.choice_logprobs: list[list] = [[] for _ in range(self.n)]
        self.finish: list[str | None] = [None] * self.n

    async def prepare(self) -> None:
        return None

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

    def usage_totals(self) -> CompletionUsage:
        """Tokens so far (what the ``usage`` field says; metered by :func:`~livelora.gateway.api.streaming.respond`)."""
        return self._usage()

    def _usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.tokens,
            total_tokens=self.prompt_tokens + self.tokens,
        )

    # ------------------------------------------------------------------ SSE
    def head(self) -> Iterable[str]:
        for i in range(self.n):
            yield self.chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[str]:
        self.tokens += len(chunk.token_ids)
        if chunk.text or (chunk.logprobs and self.logprobs):
            lp = (
                ChoiceLogprobs(content=chat_logprobs(self.texts, chunk.logprobs, self.top_n))
                if chunk.logprobs and self.logprobs
                else None
            )
            yield self.chunk([ChunkChoice(index=index, delta=ChoiceDelta(content=chunk.text), logprobs=lp)])
        if chunk.finish_reason is not None:
            yield self.chunk([ChunkChoice(index=index, delta=ChoiceDelta(), finish_reason=chunk.finish_reason)])

    def usage(self) -> str:
        return self.chunk([], usage=self._usage())

    # ------------------------------------------------------------------ JSON
    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.pieces[index].append(chunk.text)
        self.tokens += len(chunk.token_ids)
        if chunk.logprobs and self.logprobs:
            self.choice_logprobs[index] += chat_logprobs(self.texts, chunk.logprobs, self.top_n)
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
            usage=self._usage(),
            system_fingerprint=self.target.fingerprint,
        ).model_dump(mode="json")
