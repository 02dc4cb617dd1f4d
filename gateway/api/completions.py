"""``POST /v1/completions``: the legacy text-completion route (contract §1.6).

``prompt`` is a string, a list of strings, a list of token ids or a list of
token-id lists; each prompt gets ``n`` choices, indexed ``prompt_index * n + i``
(as OpenAI does). ``max_tokens`` defaults to 16 (``null`` too, as for every
optional field). A text prompt is the model's raw input, templates included:
control-token text in it (``<|im_start|>``) becomes those control tokens, as
vLLM and OpenAI's legacy route read it (OpenAI documents ``<|endoftext|>`` in a
prompt as the document separator); the caller writes the whole prompt, so no
turn boundary of anyone else can be forged. Chat message content, by contrast,
is always plain text (``livelora.core.chat_tokens``). ``echo`` prepends the prompt (with its logprobs from
:meth:`Engine.score` when ``logprobs`` is set). ``logprobs`` (0..5) uses the
legacy parallel-list layout. ``max_completion_tokens`` is not a parameter of
this route and is rejected rather than silently ignored (vllm-ascend #15931);
so are ``suffix`` (no fill-in-the-middle) and ``best_of`` other than ``n``.
Streamed chunks have the response's own shape (``object: "text_completion"``).

The handler decodes the request into engine jobs, begins the served request
(:meth:`~livelora.gateway.services.serving.Serving.begin`) and answers through
the shared lifecycle of :func:`~livelora.gateway.api.streaming.respond` with
:class:`CompletionEncoder`'s wire shapes.

Every choice served is recorded in the completion log (so it can be rated with
``POST /v1/feedback``): the exact prompt and generated token ids (never the
echoed prompt) and the generated tokens' logprobs, which are always computed
and only returned when ``logprobs`` is set. A response with one choice is
logged under its id; otherwise choice ``k`` is logged as ``{id}-{k}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
from livelora.clients.types.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
)
from livelora.gateway.api.deps import CallerDep, ServingDep, TokenTextsDep
from livelora.gateway.api.logprobs import TokenTexts, completion_logprobs
from livelora.gateway.api.streaming import respond, sse_data
from livelora.gateway.engines.base import GenerationChunk, TokenLogprob
from livelora.gateway.services.generation import Job, budget, check_common, log_ignored, sampling_params
from livelora.gateway.services.prompt_limits import completion_prompts
from livelora.gateway.services.serving import Recording, ServedRequest, Serving

log = logging.getLogger(__name__)
router = APIRouter(tags=["completions"])


def check_completion(body: CompletionRequest) -> None:
    """Reject parameters of the legacy route that cannot be honoured (400 naming ``param``)."""
    check_common(body)
    if (body.model_extra or {}).get("max_completion_tokens") is not None:
        raise UnsupportedParameterError(
            "max_completion_tokens is not a parameter of /v1/completions; use max_tokens", param="max_completion_tokens"
        )
    if body.suffix:
        raise UnsupportedParameterError("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise UnsupportedParameterError(
            "best_of other than n is not supported (choices are not re-ranked)", param="best_of"
        )


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
            raise BadRequestError(
                f"prompt {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="prompt"
            )
        prompts.append(ids)
    return prompts


def completion_jobs(
    body: CompletionRequest,
    serving: Serving,
    texts: TokenTexts,
    prompts: list[list[int]] | None = None,
    cap: int | None = None,
) -> list[Job]:
    """The request's engine jobs: ``n`` per prompt, choice ``k = prompt_index * n + i`` seeded ``seed + i``; each
    job keeps its prompt's text for the completion log. ``prompts``: already tokenized; ``cap``: the largest
    default budget per choice when ``max_tokens`` is unset.

    Raises:
        BadRequestError, UnsupportedParameterError: see :func:`check_completion`, :func:`prompt_token_ids`.
        ContextLengthExceededError: a prompt and the token budget do not fit the context window.
    """
    check_completion(body)
    prompts = prompt_token_ids(body, serving.tokenizer) if prompts is None else prompts
    max_len = serving.context_length()
    jobs = []
    for ids, text in zip(prompts, prompt_texts(body, prompts, texts)):
        max_tokens = budget(len(ids), body.max_tokens, "max_tokens", max_len, "prompt")
        if body.max_tokens is None and cap is not None:  # the tenant's max_n_tokens bounds the default budget
            max_tokens = min(max_tokens, cap)
        # logprobs are always computed: the completion log keeps them (responses only carry them on request)
        jobs += [
            Job(ids, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=body.logprobs or 0), text)
            for i in range(body.n)
        ]
    return jobs


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request, serving: ServingDep, texts: TokenTextsDep, caller: CallerDep
) -> Response:
    """Complete each prompt ``n`` times; each choice is its own generation in the engine batch."""
    log_ignored(body, "completions")
    check_completion(body)
    prompts, cap = await completion_prompts(body, serving, prompt_token_ids)  # cheap limits, then off the loop
    await serving.load_on_demand(body.model)  # a stored <lineage>@<n> not loaded yet; then no await until begin
    served = serving.begin(
        body.model,
        lambda: completion_jobs(body, serving, texts, prompts, cap),
        id_prefix="cmpl",
        recording=Recording(caller=caller, user=body.user),
    )
    return await respond(served, CompletionEncoder(served, body, texts), request)


def prompt_texts(body: CompletionRequest, prompts: list[list[int]], texts: TokenTexts) -> list[str]:
    """The text of each prompt of :func:`prompt_token_ids`: as sent for a text prompt, decoded from the
    token ids (:func:`texts_decode`) for a token-id prompt. ``len(result) == len(prompts)``."""
    raw = body.prompt
    items = [raw] if isinstance(raw, str) or all(isinstance(x, int) for x in raw) else list(raw)
    return [item if isinstance(item, str) else texts_decode(texts, ids) for item, ids in zip(items, prompts)]


def texts_decode(texts: TokenTexts, ids: list[int]) -> str:
    """Exact text of ``ids`` from their bytes (a partial trailing character becomes U+FFFD)."""
    return b"".join(bytes(texts.get(t)[1]) for t in ids).decode("utf-8", errors="replace")


class CompletionEncoder:
    """Legacy completion shapes of one request (:class:`~livelora.gateway.api.streaming.ChoiceEncoder`): echo
    text, text offsets, token counts; streamed chunks have the response's own shape."""

    kind = "completion"

    def __init__(self, served: ServedRequest, body: CompletionRequest, texts: TokenTexts):
        self.served, self.target, self.texts = served, served.target, texts
        self.n = body.n
        self.prompts = [list(job.prompt_ids) for job in served.jobs[:: body.n]]
        self.echo, self.want_lp, self.top_n = bool(body.echo), body.logprobs is not None, body.logprobs or 0
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.prompt_texts = [texts_decode(texts, ids) for ids in self.prompts] if body.echo else []
        self.prompt_logprobs: list[list[TokenLogprob | None]] = []
        self.offsets = [0] * len(served.jobs)
        self.completion_tokens = 0
        self.parts: list[list[CompletionChoice]] = [[] for _ in self.offsets]

    async def prepare(self) -> None:
        """Score echoed prompts (when logprobs are asked for); without streaming, start each choice with its echo."""
        if self.echo and self.want_lp:
            self.prompt_logprobs = [await self.served.score(ids, self.top_n) for ids in self.prompts]
        if self.echo and not self.stream:
            for i in range(len(self.parts)):
                self.parts[i].append(self.echo_choice(i))

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
            lp = completion_logprobs(
                self.texts, list(items), [i.token_id for i in items], self.top_n, self.offsets[index]
            )
        self.offsets[index] += len(chunk.text)
        return CompletionChoice(index=index, text=chunk.text, logprobs=lp, finish_reason=chunk.finish_reason)

    def usage_totals(self) -> CompletionUsage:
        """Tokens so far (what the ``usage`` field says; metered by :func:`~livelora.gateway.api.streaming.respond`)."""
        return self._usage()

    def _usage(self) -> CompletionUsage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return CompletionUsage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt_tokens + self.completion_tokens,
        )

    def _body(self, choices: list[CompletionChoice], usage: CompletionUsage | None) -> dict[str, Any]:
        return Completion(
            id=self.served.id,
            created=self.served.created,
            model=self.target.model,
            choices=choices,
            usage=usage,
            system_fingerprint=self.target.fingerprint,
        ).model_dump(mode="json")

    # ------------------------------------------------------------------ SSE
    def head(self) -> Iterable[str]:
        if self.echo:
            for i in range(len(self.offsets)):
                yield sse_data(self._body([self.echo_choice(i)], None))

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[str]:
        if chunk.text or (chunk.logprobs and self.want_lp) or chunk.finish_reason:
            yield sse_data(self._body([self.step(index, chunk)], None))
        else:
            self.completion_tokens += len(chunk.token_ids)

    def usage(self) -> str:
        return sse_data(self._body([], self._usage()))

    # ------------------------------------------------------------------ JSON
    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.parts[index].append(self.step(index, chunk))

    def body(self) -> dict[str, Any]:
        choices = [
            _merge(p) if p else CompletionChoice(index=i, text="", finish_reason="stop")
            for i, p in enumerate(self.parts)
        ]
        return self._body(choices, self._usage())


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
    return CompletionChoice(
        index=parts[0].index, text="".join(p.text for p in parts), logprobs=lp, finish_reason=finish
    )
