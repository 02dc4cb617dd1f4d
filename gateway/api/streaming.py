"""The one response encoding of the generation routes (chat, legacy completions, Messages): plain JSON or SSE.

:func:`respond` iterates a :class:`~livelora.gateway.services.serving.served.ServedRequest` (which records, observes
and meters each chunk) and answers with a route's :class:`ChoiceEncoder` shapes. Engine errors before the first
chunk are plain HTTP errors (it is awaited before a stream starts); after that the encoder's :meth:`failure`
events end the stream (OpenAI routes: one ``data: {"error": {...}}`` event, contract A11, then ``[DONE]`` when the
drain deadline passed; :class:`OpenAIStreamEnd`); a plain request answers 503. A client that goes away aborts the
generations (contract A12); OpenAI streams end with ``data: [DONE]``, after the usage chunk when
``stream_options.include_usage``.

SSE framing (contract §1.3, A06): ``[event: <name>\\n]data: <json>\\n\\n`` with LF separators, ASCII-safe JSON
(U+2028/U+2029/U+0085 escaped), keep-alive pings as SSE comments (``: ping - <time>``) or the encoder's own ping
event, media type ``text/event-stream; charset=utf-8``; sse-starlette watches the receive channel, so a
disconnect cancels the event generator within one receive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from livelora.gateway.api.errors import error_event
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.middleware.drain import DrainExpired
from livelora.gateway.services.serving.served import ServedRequest

log = logging.getLogger(__name__)

DONE = "[DONE]"
PING_INTERVAL_S = 15
#: One SSE event: a data string (OpenAI routes), or ``{"event": name, "data": string}`` (named events).
Event = str | Mapping[str, str]


def sse_data(payload: Mapping[str, Any]) -> str:
    """One event's data: compact, ASCII-safe JSON."""
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":"))


def sse_response(
    events: AsyncIterator[Event],
    headers: Mapping[str, str] | None = None,
    ping: Callable[[], ServerSentEvent] | None = None,
) -> EventSourceResponse:
    """Stream ``events`` as SSE; ``ping`` makes the keep-alive event (default: an SSE comment)."""
    return EventSourceResponse(
        events,
        sep="\n",
        ping=PING_INTERVAL_S,
        ping_message_factory=ping,
        headers=dict(headers or {}),
        media_type="text/event-stream",
    )


class ChoiceEncoder(Protocol):
    """A route's wire shapes for one request (chat: :mod:`.chat`, legacy completions: :mod:`.completions`,
    Messages: :mod:`.messages`)."""

    #: ``"chat"`` / ``"completion"`` / ``"messages"``, for logs.
    kind: str
    #: Whether the client asked for SSE.
    stream: bool
    #: The keep-alive event of its streams (``None``: an SSE comment).
    ping: Callable[[], ServerSentEvent] | None

    def head(self) -> Iterable[Event]:
        """SSE events sent before the first chunk."""

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[Event]:
        """SSE events for one engine chunk of choice ``index``."""

    def tail(self) -> Iterable[Event]:
        """SSE events after the last chunk."""

    def failure(self, exc: BaseException) -> Iterable[Event]:
        """SSE events ending a stream that failed after its headers (``exc``: what failed)."""

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Collect one engine chunk of choice ``index`` for the JSON body."""

    def body(self) -> dict[str, Any]:
        """The JSON response body once every choice is done."""


class OpenAIStreamEnd:
    """How OpenAI streams end (:meth:`ChoiceEncoder.tail`, :meth:`ChoiceEncoder.failure`): the usage chunk when
    ``include_usage``, then ``[DONE]``; a failure is one error event (then ``[DONE]`` when the drain deadline
    passed, so clients end cleanly). Mixed into an encoder with ``include_usage`` and ``usage()``."""

    include_usage: bool
    ping = None

    def usage(self) -> str:
        raise NotImplementedError

    def tail(self) -> Iterable[Event]:
        if self.include_usage:
            yield self.usage()
        yield DONE

    def failure(self, exc: BaseException) -> Iterable[Event]:
        yield error_event(exc)
        if isinstance(exc, DrainExpired):
            yield DONE


async def respond(served: ServedRequest, encoder: ChoiceEncoder, request: Request) -> Response:
    """Answer with ``encoder``'s shapes of ``served``'s choices: SSE when ``encoder.stream``, else one JSON body.

    Raises:
        LiveloraError: what the engine raises before the response starts (the request is closed).
    """
    if encoder.stream:
        return await _stream(served, encoder)
    return await _complete(served, encoder, request)


async def _complete(served: ServedRequest, encoder: ChoiceEncoder, request: Request) -> JSONResponse:
    watcher = abort_on_disconnect(served, request)
    try:
        async for index, chunk in served:
            encoder.add(index, chunk)
    finally:
        watcher.cancel()
        served.close()
    return JSONResponse(encoder.body(), headers=served.headers)


async def _stream(served: ServedRequest, encoder: ChoiceEncoder) -> Response:
    try:  # errors before the first token are plain HTTP errors
        first: Any = await anext(served, None)
    except DrainExpired as exc:  # past the grace period already: said in the stream, as for any later chunk
        first = exc
    except BaseException:
        served.close()
        raise

    async def events() -> AsyncIterator[Event]:
        try:
            for data in encoder.head():
                yield data
            if isinstance(first, DrainExpired):
                raise first
            pending = [first] if first is not None else []
            while True:
                item = pending.pop() if pending else await anext(served, None)
                if item is None:
                    break
                for data in encoder.events(*item):
                    yield data
            for data in encoder.tail():
                yield data
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # after the headers: the encoder's failure events, then close (contract A11)
            if not isinstance(exc, DrainExpired):
                log.exception("%s stream %s failed", encoder.kind, served.id)
            for data in encoder.failure(exc):
                yield data
        finally:
            served.close()

    async def on_disconnect(_message) -> None:
        served.close()

    response = sse_response(events(), served.headers, encoder.ping)
    response.client_close_handler_callable = on_disconnect
    return response


def abort_on_disconnect(served: ServedRequest, request: Request) -> asyncio.Task:
    """Abort ``served``'s generations when the client of a non-streaming request goes away; cancel the returned
    task when done."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("client disconnected; aborting its generation")
                served.abort()
                return

    return asyncio.create_task(watch())
