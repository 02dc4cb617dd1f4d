"""OpenAI request → engine glue shared by the chat and legacy completion routes.

* :func:`check_common` rejects parameters the engines cannot honour (400 naming
  ``param``; defaults such as ``0`` / ``null`` / ``{}`` are accepted).
* :func:`budget` resolves the completion-token budget against the context
  window and raises ``context_length_exceeded`` with the real numbers
  (contract A03/A04/A11).
* :class:`ChoiceStream` runs the ``n`` choices of a request as separate
  :meth:`Engine.generate` calls, so they join the engine's batch and run
  concurrently, and yields their chunks interleaved as ``(choice_index,
  chunk)``. :meth:`ChoiceStream.abort` cancels every generation (client
  disconnect, contract A12); it never awaits, so it is safe inside a cancelled
  scope. :meth:`livelora.gateway.services.serving.ServedRequest.generate` starts one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, UnsupportedParameterError
from livelora.clients.types.openai import _SamplingFields
from livelora.gateway.engines.base import Engine, GenerationChunk, SamplingParams

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """``chatcmpl-<32 hex>`` / ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: integer Unix seconds."""
    return int(time.time())


def log_ignored(body: _SamplingFields, route: str) -> None:
    """Log (debug) the unknown fields a request carried; they are accepted and ignored (contract A07)."""
    extra = sorted(body.model_extra or {})
    if extra:
        log.debug("%s: ignoring fields %s", route, ", ".join(extra))


def check_common(body: _SamplingFields) -> None:
    """Reject sampling parameters no engine honours.

    Raises:
        UnsupportedParameterError: non-zero ``frequency_penalty`` / ``presence_penalty``,
            or a non-empty ``logit_bias``.
    """
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        if value not in (None, 0):
            raise UnsupportedParameterError(f"{name} is not supported by this server; send 0 or omit it", param=name)
    if body.logit_bias:
        raise UnsupportedParameterError("logit_bias is not supported by this server; omit it", param="logit_bias")


def budget(prompt_len: int, requested: int | None, param: str, max_len: int, prompt_param: str) -> int:
    """The completion-token budget (tokens).

    Args:
        prompt_len: prompt tokens.
        requested: the request's ``max_tokens`` / ``max_completion_tokens``, or ``None``
            (then everything left in the context window).
        param: name of the field ``requested`` came from.
        max_len: context window (prompt + completion tokens).
        prompt_param: field holding the prompt (``messages`` / ``prompt``).

    Raises:
        BadRequestError: ``requested < 1`` (code ``integer_below_min_value``).
        ContextLengthExceededError: the prompt leaves no room, or prompt + requested > ``max_len``.
    """
    if requested is not None and requested < 1:
        raise BadRequestError(
            f"{param} must be at least 1, got {requested}", param=param, code="integer_below_min_value"
        )
    completion = requested if requested is not None else max(max_len - prompt_len, 0)
    if prompt_len >= max_len or prompt_len + completion > max_len:
        fault = prompt_param if prompt_len >= max_len or requested is None else param
        asked = f"{completion} in the completion" if requested is not None else "at least 1 in the completion"
        total = prompt_len + max(completion, 1)
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_len} tokens. However, you requested {total} tokens "
            f"({prompt_len} in the {prompt_param}, {asked}). Please reduce the length of the "
            f"{prompt_param} or of {param}.",
            param=fault,
        )
    return completion


def sampling_params(
    body: _SamplingFields, max_tokens: int, choice: int, *, logprobs: bool = False, top_logprobs: int = 0
) -> SamplingParams:
    """Engine parameters for choice ``choice``; its seed is ``seed + choice`` (``None`` if unseeded)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # only the most likely token survives: greedy
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=body.top_k or 0,
        seed=None if body.seed is None else body.seed + choice,
        stop=body.stop_tuple(),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


@dataclass(frozen=True)
class Job:
    """One generation: prompt token ids, shape ``(T,)``, and its parameters; ``prompt_text`` is the prompt as
    the completion log keeps it (``None`` for chat, whose log keeps the messages)."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    prompt_text: str | None = None


_DONE = object()


class ChoiceStream:
    """Concurrent generations whose chunks come out interleaved as ``(index, chunk)``.

    Iterating raises the first engine error. Call :meth:`abort` when done or
    abandoned (idempotent, never awaits).
    """

    def __init__(
        self,
        engine: Engine,
        jobs: Sequence[Job],
        adapter: str | None,
        request_id: str,
        gate: Callable[[], AbstractAsyncContextManager] | None = None,
    ):
        self._engine = engine
        self._gate = gate or contextlib.nullcontext
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(jobs)
        self._tasks = [
            asyncio.create_task(self._run(i, job, adapter, f"{request_id}-{i}")) for i, job in enumerate(jobs)
        ]
        for task in self._tasks:  # runs even for a task cancelled before it started
            task.add_done_callback(lambda _task: self._queue.put_nowait((-1, _DONE)))

    async def _run(self, index: int, job: Job, adapter: str | None, request_id: str) -> None:
        gen = None
        try:
            async with self._gate():  # a batch slot of the caller's share (admission), held until the end
                try:
                    gen = self._engine.generate(job.prompt_ids, job.params, adapter=adapter, request_id=request_id)
                    async for chunk in gen:
                        self._queue.put_nowait((index, chunk))
                finally:
                    aclose = getattr(gen, "aclose", None)
                    if aclose is not None:
                        try:
                            await aclose()
                        except BaseException:
                            pass
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait((index, exc))

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> tuple[int, GenerationChunk]:
        while self._running:
            index, item = await self._queue.get()
            if item is _DONE:
                self._running -= 1
                continue
            if isinstance(item, BaseException):
                self.abort()
                raise item
            return index, item
        raise StopAsyncIteration

    def abort(self) -> None:
        """Cancel every generation that is still running (frees the engine's batch slots)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
