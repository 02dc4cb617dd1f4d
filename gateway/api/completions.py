"""``POST /v1/completions``: the legacy text-completion route.

The handler hands the parsed request to :meth:`~livelora.gateway.services.serving.serve.Serving.serve` (prompts,
budgets and jobs: :func:`~livelora.gateway.services.serving.plans.plan_completion`) and encodes what it serves with
:class:`CompletionEncoder` through :func:`~livelora.gateway.api.streaming.respond`. Prompt forms, ``echo``,
legacy ``logprobs``, refused parameters and how choices are logged: ``docs/internals/wire-types.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from livelora.clients.types.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
)
from livelora.gateway.api.deps import CallerDep, PrincipalDep, ServingDep, TokenTextsDep
from livelora.gateway.api.logprobs import TextOffsets, TokenTexts, completion_logprobs
from livelora.gateway.api.streaming import OpenAIStreamEnd, respond, sse_data
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.services.serving.served import ServedRequest

log = logging.getLogger(__name__)
router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    serving: ServingDep,
    texts: TokenTextsDep,
    caller: CallerDep,
    principal: PrincipalDep,
) -> Response:
    """Complete each prompt ``n`` times; each choice is its own generation in the engine batch."""
    served = await serving.serve(body, principal, caller=caller)
    return await respond(served, CompletionEncoder(served, body, texts), request)


class CompletionEncoder(OpenAIStreamEnd):
    """Legacy completion shapes of one request (:class:`~livelora.gateway.api.streaming.ChoiceEncoder`): echo
    text, text offsets, token counts; streamed chunks have the response's own shape."""

    kind = "completion"

    def __init__(self, served: ServedRequest, body: CompletionRequest, texts: TokenTexts):
        self.served, self.target, self.texts = served, served.target, texts
        self.n = body.n
        self.prompts = served.prompts
        self.echo, self.want_lp, self.top_n = bool(body.echo), body.logprobs is not None, body.logprobs or 0
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.prompt_texts = [texts.decode(ids) for ids in self.prompts] if body.echo else []
        self.prompt_only = body.max_tokens == 0  # echo with max_tokens 0: the prompt's logprobs, no generation
        self.offsets = [TextOffsets() for _ in served.jobs]
        self.parts: list[list[CompletionChoice]] = [[] for _ in self.offsets]
        if self.echo and not self.stream:  # each choice starts with its echo
            for i in range(len(self.parts)):
                self.parts[i].append(self.echo_choice(i))

    def echo_choice(self, index: int) -> CompletionChoice:
        """The prompt part of choice ``index`` (text and, with logprobs, the prompt's logprobs)."""
        p = index // self.n
        lp = None
        if self.want_lp:
            lp = completion_logprobs(
                self.texts, self.served.prompt_logprobs[p], self.prompts[p], self.top_n, self.offsets[index]
            )
        else:
            self.offsets[index].chars = len(self.prompt_texts[p])
        finish = "length" if self.prompt_only else None
        return CompletionChoice(index=index, text=self.prompt_texts[p], logprobs=lp, finish_reason=finish)

    def step(self, index: int, chunk: GenerationChunk) -> CompletionChoice:
        """The part of choice ``index`` that ``chunk`` adds."""
        lp = None
        if self.want_lp:
            items = chunk.logprobs or []
            ids = [i.token_id for i in items]
            lp = completion_logprobs(self.texts, list(items), ids, self.top_n, self.offsets[index], chunk.stop_token)
        return CompletionChoice(index=index, text=chunk.text, logprobs=lp, finish_reason=chunk.finish_reason)

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

    def usage(self) -> str:
        return sse_data(self._body([], self.served.usage()))

    # ------------------------------------------------------------------ JSON
    def add(self, index: int, chunk: GenerationChunk) -> None:
        self.parts[index].append(self.step(index, chunk))

    def body(self) -> dict[str, Any]:
        choices = [
            _merge(p) if p else CompletionChoice(index=i, text="", finish_reason="stop")
            for i, p in enumerate(self.parts)
        ]
        return self._body(choices, self.served.usage())


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
