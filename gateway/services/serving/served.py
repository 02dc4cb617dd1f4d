"""A served request from admission to its last token: the one place where its chunks are recorded and metered.

:class:`ServedRequest` is what :meth:`~.serving.Serving.serve` (chat, legacy completions) and
:meth:`~.serving.Serving.begin` (Tinker samples) return. Iterating it yields the engine chunks of every choice as
``(choice index, chunk)``; on the way each chunk is checked against the drain deadline, given to the completion
recorder, observed for the latency metrics and counted. When the choices end the tokens are metered once and the
choices logged; :meth:`ServedRequest.close` (idempotent, never awaits) ends it early: generations aborted, slots
and version lease released, what was generated so far metered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from livelora.clients.types.openai import CompletionUsage
from livelora.core import metrics
from livelora.gateway.engines.base import Engine, GenerationChunk, TokenLogprob
from livelora.gateway.middleware.drain import Drain
from livelora.gateway.services.live.completion_log import CompletionRecorder
from livelora.gateway.services.serving.admission import Ticket
from livelora.gateway.services.serving.generation import ChoiceStream, Job
from livelora.gateway.services.serving.request_fields import IGNORED_HEADER

if TYPE_CHECKING:
    from livelora.gateway.services.serving.serve import ServingTarget
    from livelora.gateway.services.tenants.usage import MeteringService

log = logging.getLogger(__name__)

#: Response header carrying the completion id (what ``POST /v1/feedback`` takes) of a served request.
COMPLETION_HEADER = "X-Livelora-Completion-Id"


@dataclass
class ServedRequest:
    """An admitted request; see the module docstring.

    Attributes:
        id: the response id (``chatcmpl-…``/``cmpl-…``; ``""`` when none was asked for).
        created: Unix time, seconds.
        target: the weights serving it.
        jobs: one engine generation per choice, ``per_prompt`` consecutive ones per prompt.
        ticket: its admission ticket (the version lease is released with it).
        engine: the engine that serves it.
        recorder: collects the choices for the completion log (``None``: not logged).
        drain: the gateway's drain state (``None``: never drained).
        payer: ``(tenant, API key id)`` the request's tokens are metered for.
        metering: the gateway's token counters (``None``: not metered).
        kind: ``chat`` / ``completion`` / ``sample``: the label of its latency and token metrics.
        per_prompt: choices per prompt (``n``).
        prompt_logprobs: per prompt, its scored logprobs (an echoed prompt with ``logprobs``; else empty).
        ignored: the unknown request fields ignored (``LIVELORA_UNKNOWN_FIELDS=ignore``), named in a header.
    """

    id: str
    created: int
    target: ServingTarget
    jobs: list[Job]
    ticket: Ticket
    engine: Engine
    recorder: CompletionRecorder | None = field(default=None)
    drain: Drain | None = field(default=None)
    payer: tuple[str, str | None] = ("default", None)
    metering: MeteringService | None = field(default=None)
    kind: str = "chat"
    per_prompt: int = 1
    prompt_logprobs: list[list[TokenLogprob | None]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()
    started: float = field(default_factory=time.monotonic)
    _last: dict[int, float] = field(default_factory=dict)
    _accounted: bool = False
    _choices: ChoiceStream | None = None
    _generated: int = 0
    _finished: bool = False

    @property
    def headers(self) -> dict[str, str]:
        """Response headers naming the weights that answer, the completion id (when the request has one) and the
        unknown fields ignored (when any)."""
        headers = {**self.target.headers, COMPLETION_HEADER: self.id} if self.id else dict(self.target.headers)
        if self.ignored:
            headers[IGNORED_HEADER] = ", ".join(self.ignored)
        return headers

    @property
    def prompts(self) -> list[list[int]]:
        """Each prompt's token ids once (its ``per_prompt`` choices share it)."""
        return [list(job.prompt_ids) for job in self.jobs[:: self.per_prompt]]

    def usage(self) -> CompletionUsage:
        """Tokens so far: every prompt once, every generated token (what the ``usage`` field says and is metered;
        the end-of-sequence or stop token that ends a choice is not counted, as the completion log keeps it)."""
        prompt = sum(len(job.prompt_ids) for job in self.jobs[:: self.per_prompt])
        return CompletionUsage(
            prompt_tokens=prompt, completion_tokens=self._generated, total_tokens=prompt + self._generated
        )

    # ------------------------------------------------------------------ the choices
    def start(self) -> None:
        """Start every job in the engine batch (the chunks come out of iterating the request)."""
        self._choices = ChoiceStream(self.engine, self.jobs, self.target.adapter, self.id, gate=self.ticket.run_slot)

    def __aiter__(self) -> ServedRequest:
        return self

    async def __anext__(self) -> tuple[int, GenerationChunk]:
        """The next chunk of any choice, recorded, observed and counted; at the end the request is metered, its
        slots released and its choices logged.

        Raises:
            DrainExpired: the gateway's grace period is over (503). LiveloraError: what the engine raised.
        """
        try:
            if self._choices is None:  # nothing to generate (an echo with max_tokens 0)
                raise StopAsyncIteration
            index, chunk = await anext(self._choices)
        except StopAsyncIteration:
            await self._finish()
            raise
        if self.drain is not None:
            self.drain.check_running()
        if self.recorder is not None:
            self.recorder.add(index, chunk)
        self.observe(index, chunk)
        self._generated += len(chunk.token_ids)
        return index, chunk

    async def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        await self.account(self._tokens())
        self.close()
        if self.recorder is not None:
            await self.recorder.save()

    def abort(self) -> None:
        """Cancel the running generations (the iteration then ends as if they had finished)."""
        if self._choices is not None:
            self._choices.abort()

    def close(self) -> None:
        """End the request (idempotent, never awaits): abort what runs, release its slots and version lease, and
        meter what was generated if it was not metered yet."""
        self.abort()
        self.release()
        self.account_later(self._tokens())

    def _tokens(self) -> dict[str, int]:
        usage = self.usage()
        return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}

    # ------------------------------------------------------------------ parts
    async def score(self, token_ids: Sequence[int], top_logprobs: int = 0) -> list[TokenLogprob | None]:
        """Prompt logprobs of ``token_ids`` under the request's weights (:meth:`Engine.score`)."""
        return await self.engine.score(token_ids, self.target.adapter, top_logprobs=top_logprobs)

    def release(self) -> None:
        """Give the admission slots and the version lease back (idempotent)."""
        self.ticket.release()

    def observe(self, index: int, chunk: GenerationChunk) -> None:
        """Latency metrics of one engine chunk of choice ``index``: time to first token (first chunk of the
        request), inter-token latency (a chunk of k tokens counts its gap / k, k times), generated tokens."""
        n = len(chunk.token_ids)
        if not n:
            return
        t = time.monotonic()
        if not self._last:
            metrics.TTFT.labels(self.kind).observe(t - self.started)
        prev = self._last.get(index)
        if prev is not None:
            gap = (t - prev) / n
            for _ in range(n):
                metrics.INTER_TOKEN.labels(self.kind).observe(gap)
        self._last[index] = t
        metrics.GENERATED_TOKENS.labels(self.kind).inc(n)

    async def account(self, tokens: dict[str, int], subject: str | None = None) -> None:
        """Meter the request's ``tokens`` (``{kind: n}``, :data:`~livelora.core.metering.KINDS`) once for
        :attr:`payer` and ``subject`` (default: the endpoint, else the model name); later calls do nothing."""
        if self._accounted:
            return
        self._accounted = True
        if "prompt" in tokens:
            metrics.PROMPT_TOKENS.labels(self.kind).inc(tokens["prompt"])
        done = tokens.get("completion", tokens.get("sampled", 0))
        elapsed = time.monotonic() - self.started
        if done and elapsed > 0:
            metrics.TOKENS_PER_SECOND.labels(self.kind).observe(done / elapsed)
        subject = subject or self.target.endpoint or self.target.model
        log.info(
            "served %s %s: %s",
            self.kind,
            self.id or "-",
            tokens,
            extra={
                "completion_id": self.id or None,
                "tenant": self.payer[0],
                "version": self.target.version,
                "endpoint": subject,
            },
        )
        if self.metering is not None:
            await self.metering.record(self.payer[0], self.payer[1], subject, tokens)

    def account_later(self, tokens: dict[str, int], subject: str | None = None) -> None:
        """:meth:`account` from synchronous code (an aborted request): scheduled on the running loop."""
        if not self._accounted:
            task = asyncio.get_running_loop().create_task(self.account(tokens, subject))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)


_PENDING: set[asyncio.Task] = set()
