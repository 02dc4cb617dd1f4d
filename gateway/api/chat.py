"""``POST /v1/chat/completions``: chat completions, plain JSON or SSE (contract §1.1-1.3).

Validation happens before the first byte and fails as a plain HTTP error;
engine errors raised before the first token also do (the stream's first event
is awaited before the response starts). Failures after that go out as one
``data: {"error": {...}}`` event and the stream closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

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
from livelora.gateway.api.deps import AdmissionDep, EngineDep, SettingsDep, TokenTextsDep
from livelora.gateway.api.errors import error_event
from livelora.gateway.api.generation import (
    ChoiceStream,
    Job,
    budget,
    check_common,
    log_ignored,
    new_id,
    now,
    sampling_params,
)
from livelora.gateway.api.logprobs import TokenTexts, chat_logprobs
from livelora.gateway.api.serving import ServingTarget, Ticket, context_length, resolve_target
from livelora.gateway.api.sse import DONE, sse_data, sse_response
from livelora.gateway.chat_template import render_messages
from livelora.gateway.live import CompletionRecorder, hold_version

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
        raise BadRequestError("set only one of max_tokens and max_completion_tokens (max_tokens is deprecated)",
                              param="max_tokens", code="invalid_parameter_combination")
    if body.tools:
        raise UnsupportedParameterError("tools are not supported: the served model's chat template has no "
                                        "tool-calling format", param="tools")
    if body.functions:
        raise UnsupportedParameterError("functions are not supported: the served model's chat template has no "
                                        "tool-calling format", param="functions")
    if body.tool_choice not in (None, "none"):
        raise UnsupportedParameterError("tool_choice is only allowed as 'none' (tools are not supported)",
                                        param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise UnsupportedParameterError(f"response_format {body.response_format.type!r} is not supported: "
                                        "output cannot be constrained to JSON; use type 'text'",
                                        param="response_format")
    if body.top_logprobs and not body.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    extra = body.model_extra or {}
    if any(m != "text" for m in extra.get("modalities") or []):
        raise UnsupportedParameterError("only the 'text' modality is supported", param="modalities")
    if extra.get("audio") is not None:
        raise UnsupportedParameterError("audio output is not supported", param="audio")


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, engine: EngineDep,
                                 settings: SettingsDep, admission: AdmissionDep,
                                 texts: TokenTextsDep) -> Response:
    """Create a chat completion with ``n`` choices, each its own generation in the engine batch."""
    log_ignored(body, "chat.completions")
    target = resolve_target(body.model, engine, settings, getattr(request.app.state, "registry", None))
    check_chat(body)
    prompt = render_messages(engine.tokenizer, body.messages)
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = budget(len(prompt), requested, param, context_length(engine, settings), "messages")
    top_n = body.top_logprobs or 0
    # logprobs are always computed: the completion log keeps them (responses only carry them on request)
    jobs = [Job(prompt, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=top_n))
            for i in range(body.n)]
    ticket = admission.acquire(body.n)
    hold_version(request.app, target, ticket)
    completion_id = new_id("chatcmpl")
    stream = ChoiceStream(engine, jobs, target.adapter, completion_id)
    meta = _Meta(completion_id, now(), target, len(prompt), body.n, top_n, bool(body.logprobs), texts)
    meta.recorder = CompletionRecorder(
        request, completion_id=completion_id, created=meta.created, target=target, prompt_ids=prompt, n=body.n,
        messages=[m.model_dump(mode="json", exclude_none=True) for m in body.messages], user=body.user)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(stream, ticket, meta, include_usage)
    return await _complete(stream, ticket, meta, request)


class _Meta:
    """What every chunk or response of one request repeats."""

    def __init__(self, completion_id: str, created: int, target: ServingTarget, prompt_tokens: int, n: int,
                 top_n: int, logprobs: bool, texts: TokenTexts):
        self.id, self.created, self.target = completion_id, created, target
        self.prompt_tokens, self.n, self.texts = prompt_tokens, n, texts
        self.top_n, self.logprobs = top_n, logprobs

    def chunk(self, choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        return sse_data(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.target.model, choices=choices, usage=usage,
            system_fingerprint=self.target.fingerprint).model_dump(mode="json"))

    def usage(self, completion_tokens: int) -> CompletionUsage:
        return CompletionUsage(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                               total_tokens=self.prompt_tokens + completion_tokens)


async def _complete(stream: ChoiceStream, ticket: Ticket, meta: _Meta, request: Request) -> JSONResponse:
    texts: list[list[str]] = [[] for _ in range(meta.n)]
    logprobs: list[list] = [[] for _ in range(meta.n)]
    finish: list[str | None] = [None] * meta.n
    tokens = 0
    watcher = stream.abort_on_disconnect(request)
    try:
        async for index, chunk in stream:
            texts[index].append(chunk.text)
            tokens += len(chunk.token_ids)
            meta.recorder.add(index, chunk)
            if chunk.logprobs and meta.logprobs:
                logprobs[index] += chat_logprobs(meta.texts, chunk.logprobs, meta.top_n)
            if chunk.finish_reason is not None:
                finish[index] = chunk.finish_reason
    finally:
        watcher.cancel()
        stream.abort()
        ticket.release()
    await meta.recorder.save()
    choices = [Choice(index=i, message=ChatCompletionMessage(content="".join(texts[i])),
                      finish_reason=finish[i] or "stop",
                      logprobs=ChoiceLogprobs(content=logprobs[i]) if meta.logprobs else None)
               for i in range(meta.n)]
    body = ChatCompletion(id=meta.id, created=meta.created, model=meta.target.model, choices=choices,
                          usage=meta.usage(tokens), system_fingerprint=meta.target.fingerprint)
    return JSONResponse(body.model_dump(mode="json"), headers=meta.target.headers)


async def _stream(stream: ChoiceStream, ticket: Ticket, meta: _Meta, include_usage: bool) -> Response:
    def cleanup() -> None:
        stream.abort()
        ticket.release()

    try:  # errors before the first token are plain HTTP errors
        first = await anext(stream, None)
    except BaseException:
        cleanup()
        raise

    async def events() -> AsyncIterator[str]:
        tokens = 0
        try:
            for i in range(meta.n):
                yield meta.chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
            pending = [first] if first is not None else []
            while True:
                if pending:
                    index, chunk = pending.pop()
                else:
                    item = await anext(stream, None)
                    if item is None:
                        break
                    index, chunk = item
                tokens += len(chunk.token_ids)
                meta.recorder.add(index, chunk)
                if chunk.text or (chunk.logprobs and meta.logprobs):
                    lp = (ChoiceLogprobs(content=chat_logprobs(meta.texts, chunk.logprobs, meta.top_n))
                          if chunk.logprobs and meta.logprobs else None)
                    yield meta.chunk([ChunkChoice(index=index, delta=ChoiceDelta(content=chunk.text), logprobs=lp)])
                if chunk.finish_reason is not None:
                    yield meta.chunk([ChunkChoice(index=index, delta=ChoiceDelta(),
                                                  finish_reason=chunk.finish_reason)])
            if include_usage:
                yield meta.chunk([], usage=meta.usage(tokens))
            await meta.recorder.save()
            yield DONE
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # after the headers: one error event, then close (contract A11)
            log.exception("chat stream %s failed", meta.id)
            yield error_event(exc)
        finally:
            cleanup()

    async def on_disconnect(_message) -> None:
        cleanup()

    response = sse_response(events(), meta.target.headers)
    response.client_close_handler_callable = on_disconnect
    return response
