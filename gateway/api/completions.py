"""``POST /v1/completions``: the legacy text-completion route (contract §1.6).

``prompt`` is a string, a list of strings, a list of token ids or a list of
token-id lists; each prompt gets ``n`` choices, indexed ``prompt_index * n + i``
(as OpenAI does). ``max_tokens`` defaults to 16 (``null`` too, as for every
optional field). A text prompt is the model's raw input, templates included:
control-token text in it (``<|im_start|>``) becomes those control tokens, as
vLLM and OpenAI's legacy route read it (OpenAI documents ``<|endoftext|>`` in a
prompt as the document separator); the caller writes the whole prompt, so no
turn boundary of anyone else can be forged. Chat message content, by contrast,
is always plain text (``livelora.adapters.chat_tokens``). ``echo`` prepends the prompt (with its logprobs from
:meth:`Engine.score` when ``logprobs`` is set). ``logprobs`` (0..5) uses the
legacy parallel-list layout. ``max_completion_tokens`` is not a parameter of
this route and is rejected rather than silently ignored (vllm-ascend #15931);
so are ``suffix`` (no fill-in-the-middle) and ``best_of`` other than ``n``.
Streamed chunks have the response's own shape (``object: "text_completion"``).

Every choice served is recorded in the completion log (so it can be rated with
``POST /v1/feedback``): the exact prompt and generated token ids (never the
echoed prompt) and the generated tokens' logprobs, which are always computed
and only returned when ``logprobs`` is set. A response with one choice is
logged under its id; otherwise choice ``k`` is logged as ``{id}-{k}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
from livelora.clients.types.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
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
from livelora.gateway.api.logprobs import TokenTexts, completion_logprobs
from livelora.gateway.api.serving import ServingTarget, Ticket, context_length, resolve_target
from livelora.gateway.live import CompletionRecorder, hold_version
from livelora.gateway.api.sse import DONE, sse_data, sse_response
from livelora.gateway.engines.base import Engine, GenerationChunk, TokenLogprob

log = logging.getLogger(__name__)
router = APIRouter(tags=["completions"])


def check_completion(body: CompletionRequest) -> None:
    """Reject parameters of the legacy route that cannot be honoured (400 naming ``param``)."""
    check_common(body)
    if (body.model_extra or {}).get("max_completion_tokens") is not None:
        raise UnsupportedParameterError("max_completion_tokens is not a parameter of /v1/completions; "
                                        "use max_tokens", param="max_completion_tokens")
    if body.suffix:
        raise UnsupportedParameterError("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise UnsupportedParameterError("best_of other than n is not supported (choices are not re-ranked)",
                                        param="best_of")


def prompt_token_ids(body: CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token-id lists, each shape ``(T,)`` with ``T >= 1``. A text prompt is encoded
    as the model's raw input (control-token text parsed, the tokenizer's BOS added if it adds one), as vLLM does.

    Raises:
        BadRequestError: an empty prompt or a token id outside the vocabulary (param ``prompt``).
    """
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise BadRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    vocab = len(tokenizer)
    prompts = []
    for i, item in enumerate(raw):
        ids = list(tokenizer.encode(item)) if isinstance(item, str) else list(item)
        if not ids:
            raise BadRequestError(f"prompt {i} is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                                  param="prompt")
        prompts.append(ids)
    return prompts


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, engine: EngineDep, settings: SettingsDep,
                            admission: AdmissionDep, texts: TokenTextsDep) -> Response:
    """Complete each prompt ``n`` times; each choice is its own generation in the engine batch."""
    log_ignored(body, "completions")
    target = resolve_target(body.model, engine, settings, getattr(request.app.state, "registry", None))
    check_completion(body)
    prompts = prompt_token_ids(body, engine.tokenizer)
    max_len = context_length(engine, settings)
    want_lp = body.logprobs is not None
    top_n = body.logprobs or 0
    jobs = []
    for ids in prompts:
        max_tokens = budget(len(ids), body.max_tokens, "max_tokens", max_len, "prompt")
        # logprobs are always computed: the completion log keeps them (responses only carry them on request)
        jobs += [Job(ids, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=top_n))
                 for i in range(body.n)]
    ticket = admission.acquire(len(jobs))
    hold_version(request.app, target, ticket)
    state = _State(new_id("cmpl"), now(), target, body, prompts, texts, want_lp, top_n)
    sources = prompt_texts(body, prompts, texts)
    state.recorder = CompletionRecorder(
        request, completion_id=state.id, created=state.created, target=target, n=len(jobs), user=body.user,
        choice_prompts=[(ids, text) for ids, text in zip(prompts, sources) for _ in range(body.n)])
    if body.echo:
        await state.load_echo(engine)
    stream = ChoiceStream(engine, jobs, target.adapter, state.id)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(stream, ticket, state, include_usage)
    return await _complete(stream, ticket, state, request)


def prompt_texts(body: CompletionRequest, prompts: list[list[int]], texts: TokenTexts) -> list[str]:
    """The text of each prompt of :func:`prompt_token_ids`: as sent for a text prompt, decoded from the
    token ids (:func:`texts_decode`) for a token-id prompt. ``len(result) == len(prompts)``."""
    raw = body.prompt
    items = [raw] if isinstance(raw, str) or all(isinstance(x, int) for x in raw) else list(raw)
    return [item if isinstance(item, str) else texts_decode(texts, ids) for item, ids in zip(items, prompts)]


class _State:
    """Per-request bookkeeping: echo text, text offsets, token counts, the completion-log recorder."""

    recorder: CompletionRecorder

    def __init__(self, completion_id: str, created: int, target: ServingTarget, body: CompletionRequest,
                 prompts: list[list[int]], texts: TokenTexts, want_lp: bool, top_n: int):
        self.id, self.created, self.target = completion_id, created, target
        self.n, self.prompts, self.texts = body.n, prompts, texts
        self.echo, self.want_lp, self.top_n = bool(body.echo), want_lp, top_n
        self.prompt_texts = [texts_decode(texts, ids) for ids in prompts] if body.echo else []
        self.prompt_logprobs: list[list[TokenLogprob | None]] = []
        self.offsets = [0] * (len(prompts) * body.n)
        self.completion_tokens = 0

    async def load_echo(self, engine: Engine) -> None:
        if self.want_lp:
            self.prompt_logprobs = [await engine.score(ids, self.target.adapter, top_logprobs=self.top_n)
                                    for ids in self.prompts]

    def echo_choice(self, index: int) -> CompletionChoice:
        """The prompt part of choice ``index`` (text and, with logprobs, the prompt's logprobs)."""
        p = index // self.n
        lp = None
        if self.want_lp:
            lp = completion_logprobs(self.texts, self.prompt_logprobs[p], self.prompts[p], self.top_n, 0)
        self.offsets[index] = len(self.prompt_texts[p])
        return CompletionChoice(index=index, text=self.prompt_texts[p], logprobs=lp)

    def step(self, index: int, chunk: GenerationChunk) -> CompletionChoice:
        """The part of choice ``index`` that ``chunk`` adds."""
        self.completion_tokens += len(chunk.token_ids)
        lp = None
        if self.want_lp:
            items = chunk.logprobs or []
            lp = completion_logprobs(self.texts, list(items), [i.token_id for i in items], self.top_n,
                                     self.offsets[index])
        self.offsets[index] += len(chunk.text)
        return CompletionChoice(index=index, text=chunk.text, logprobs=lp, finish_reason=chunk.finish_reason)

    def usage(self) -> CompletionUsage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
                               total_tokens=prompt_tokens + self.completion_tokens)

    def body(self, choices: list[CompletionChoice], usage: CompletionUsage | None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.target.model, choices=choices,
                          usage=usage, system_fingerprint=self.target.fingerprint)


def texts_decode(texts: TokenTexts, ids: list[int]) -> str:
    """Exact text of ``ids`` from their bytes (a partial trailing character becomes U+FFFD)."""
    return b"".join(bytes(texts.get(t)[1]) for t in ids).decode("utf-8", errors="replace")


def _merge(parts: list[CompletionChoice]) -> CompletionChoice:
    """Concatenate the pieces of one choice into one."""
    lp = None
    if any(p.logprobs is not None for p in parts):
        lp = CompletionLogprobs()
        for p in parts:
            if p.logprobs is not None:
                lp.tokens.extend(p.logprobs.tokens)
                lp.token_logprobs.extend(p.logprobs.token_logprobs)
                lp.top_logprobs.extend(p.logprobs.top_logprobs)
                lp.text_offset.extend(p.logprobs.text_offset)
    finish = next((p.finish_reason for p in reversed(parts) if p.finish_reason), "stop")
    return CompletionChoice(index=parts[0].index, text="".join(p.text for p in parts), logprobs=lp,
                            finish_reason=finish)


async def _complete(stream: ChoiceStream, ticket: Ticket, state: _State, request: Request) -> JSONResponse:
    parts: list[list[CompletionChoice]] = [[] for _ in state.offsets]
    if state.echo:
        for i in range(len(parts)):
            parts[i].append(state.echo_choice(i))
    watcher = stream.abort_on_disconnect(request)
    try:
        async for index, chunk in stream:
            state.recorder.add(index, chunk)
            parts[index].append(state.step(index, chunk))
    finally:
        watcher.cancel()
        stream.abort()
        ticket.release()
    await state.recorder.save()
    choices = [_merge(p) if p else CompletionChoice(index=i, text="", finish_reason="stop")
               for i, p in enumerate(parts)]
    return JSONResponse(state.body(choices, state.usage()).model_dump(mode="json"), headers=state.target.headers)


async def _stream(stream: ChoiceStream, ticket: Ticket, state: _State, include_usage: bool) -> Response:
    def cleanup() -> None:
        stream.abort()
        ticket.release()

    try:  # errors before the first token are plain HTTP errors
        first = await anext(stream, None)
    except BaseException:
        cleanup()
        raise

    def event(choice: CompletionChoice) -> str:
        return sse_data(state.body([choice], None).model_dump(mode="json"))

    async def events() -> AsyncIterator[str]:
        try:
            if state.echo:
                for i in range(len(state.offsets)):
                    yield event(state.echo_choice(i))
            pending = [first] if first is not None else []
            while True:
                item = pending.pop() if pending else await anext(stream, None)
                if item is None:
                    break
                index, chunk = item
                state.recorder.add(index, chunk)
                if chunk.text or (chunk.logprobs and state.want_lp) or chunk.finish_reason:
                    yield event(state.step(index, chunk))
                else:
                    state.completion_tokens += len(chunk.token_ids)
            if include_usage:
                yield sse_data(state.body([], state.usage()).model_dump(mode="json"))
            await state.recorder.save()
            yield DONE
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # after the headers: one error event, then close
            log.exception("completion stream %s failed", state.id)
            yield error_event(exc)
        finally:
            cleanup()

    async def on_disconnect(_message) -> None:
        cleanup()

    response = sse_response(events(), state.target.headers)
    response.client_close_handler_callable = on_disconnect
    return response
