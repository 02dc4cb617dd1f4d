"""The event loop's side of the transformers engine's worker thread (:mod:`livelora.gateway.engines.batching`).

:func:`on_worker` awaits a function run on the worker between two steps; :func:`stream` submits a sequence and
yields its chunks (an error the worker delivers is raised; leaving early cancels the sequence).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from livelora.gateway.engines.base import GenerationChunk


async def on_worker(worker, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on ``worker``'s thread between two steps; what it raises is raised here."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:  # worker thread
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the caller
            result, exc = None, e
        loop.call_soon_threadsafe(_settle, fut, result, exc)

    worker.call(run)
    return await fut


async def stream(worker, seq) -> AsyncIterator[GenerationChunk]:
    """Submit ``seq`` (an :class:`~livelora.gateway.engines.batching.Sequence`) and yield its chunks until one has a
    finish reason."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(items: list[Any]) -> None:  # worker thread
        loop.call_soon_threadsafe(_put_all, queue, items)

    seq.deliver = deliver
    worker.submit(seq)
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        if not seq.finished:
            seq.cancelled = True
            worker.wake()


def no_consumer(items: list[Any]) -> None:
    """A sequence's ``deliver`` until :func:`stream` sets its own."""
    raise RuntimeError("sequence has no consumer")


def _put_all(queue: asyncio.Queue, items: list[Any]) -> None:
    for item in items:
        queue.put_nowait(item)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
