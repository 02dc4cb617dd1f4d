"""Engine jobs and the choices of one request run together.

* :class:`Job` is one generation: prompt token ids and engine parameters (:mod:`.plans` makes them).
* :class:`ChoiceStream` runs the ``n`` choices of a request as separate :meth:`Engine.generate` calls, so they
  join the engine's batch and run concurrently, and yields their chunks interleaved as ``(choice_index,
  chunk)``. :meth:`ChoiceStream.abort` cancels every generation (client disconnect, contract A12); it never
  awaits, so it is safe inside a cancelled scope. A served request starts one (:mod:`.serving`).
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

from livelora.gateway.engines.base import Engine, GenerationChunk, SamplingParams

log = logging.getLogger(__name__)


#: response id prefix → the route kind its metrics are labelled with
KINDS = {"chatcmpl": "chat", "cmpl": "completion", "msg": "messages"}


def new_id(prefix: str) -> str:
    """``chatcmpl-<32 hex>`` / ``cmpl-<32 hex>``; ``msg_<32 hex>`` (the Messages API's spelling)."""
    return f"{prefix}{'_' if prefix == 'msg' else '-'}{uuid.uuid4().hex}"


def now() -> int:
    """``created``: integer Unix seconds."""
    return int(time.time())


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
