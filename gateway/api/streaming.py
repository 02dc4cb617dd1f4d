"""The one response lifecycle of the generation routes (chat and legacy completions), plain JSON or SSE.

:func:`respond` runs a :class:`~livelora.gateway.services.serving.ServedRequest` to its response; a route
supplies only a :class:`ChoiceEncoder` (its wire shapes). Whatever the route:

* the encoder's :meth:`~ChoiceEncoder.prepare` runs first (the legacy route scores an echoed prompt there),
  then the choices start in the engine batch;
* engine errors raised before the first chunk are plain HTTP errors (the stream's first chunk is awaited before
  the response starts); failures after that go out as one ``data: {"error": {...}}`` event and the stream
  closes (contract A11);
* every chunk goes to the completion-log recorder, which logs the choices once they are all done;
* a client that goes away aborts the generations (contract A12), and the admission ticket (with the version
  lease) is released exactly once, whatever ends the request;
* streams end with ``data: [DONE]``, after the usage chunk when ``stream_options.include_usage``;
* a gateway shutting down (:mod:`livelora.gateway.services.drain`) ends a request still running at the end of
  its grace period: a stream with one error event and ``[DONE]``, a plain request with 503.

SSE framing is exactly what OpenAI clients parse (contract §1.3, A06): every event is ``data: <json>\\n\\n``
with LF separators, the JSON is ASCII-safe (``json.dumps`` default ``ensure_ascii=True``, so
U+2028/U+2029/U+0085 are escaped), keep-alive pings are SSE comments (``: ping - <time>``), which
openai-python ignores, and the media type is ``text/event-stream; charset=utf-8``. sse-starlette watches the
receive channel, so a client disconnect cancels the event generator within one receive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from livelora.clients.types.openai import CompletionUsage
from livelora.gateway.api.errors import error_event
from livelora.gateway.engines.base import GenerationChunk
from livelora.gateway.services.drain import DrainExpired
from livelora.gateway.services.generation import ChoiceStream
from livelora.gateway.services.serving import ServedRequest

log = logging.getLogger(__name__)

DONE = "[DONE]"
PING_INTERVAL_S = 15


def sse_data(payload: Mapping[str, Any]) -> str:
    """One event's data: compact, ASCII-safe JSON."""
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":"))


def sse_response(events: AsyncIterator[str], headers: Mapping[str, str] | None = None) -> EventSourceResponse:
    """Stream ``events`` (each already a data string, the last ``[DONE]``) as SSE."""
    return EventSourceResponse(
        events, sep="\n", ping=PING_INTERVAL_S, headers=dict(headers or {}), media_type="text/event-stream"
    )


class ChoiceEncoder(Protocol):
    """A route's wire shapes for one request (chat: :mod:`.chat`, legacy completions: :mod:`.completions`)."""

    #: ``"chat"`` / ``"completion"``, for logs.
    kind: str
    #: Whether the client asked for SSE.
    stream: bool
    #: Whether a usage chunk precedes ``[DONE]`` (``stream_options.include_usage``).
    include_usage: bool

    async def prepare(self) -> None:
        """Work before generation starts (may raise: the request fails with a plain HTTP error)."""

    def head(self) -> Iterable[str]:
        """SSE data sent before the first chunk."""

    def events(self, index: int, chunk: GenerationChunk) -> Iterable[str]:
        """SSE data for one engine chunk of choice ``index``."""

    def usage(self) -> str:
        """The SSE usage chunk."""

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Collect one engine chunk of choice ``index`` for the JSON body."""

    def body(self) -> dict[str, Any]:
        """The JSON response body once every choice is done."""

    def usage_totals(self) -> CompletionUsage:
        """Tokens so far: what the ``usage`` field says (and what is metered)."""


def _tokens(encoder: ChoiceEncoder) -> dict[str, int]:
    usage = encoder.usage_totals()
    return {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens}


async def respond(served: ServedRequest, encoder: ChoiceEncoder, request: Request) -> Response:
    """Run ``served`` and answer with ``encoder``'s shapes: SSE when ``encoder.stream``, else one JSON body.

    Raises:
        LiveloraError: what ``encoder.prepare`` or the engine raise before the response starts (the ticket is
            released).
    """
    try:
        if served.metering is not None:  # over a daily token limit: 429, nothing runs
            await served.metering.quotas.check_tokens(served.payer[0], ("prompt", "completion"))
        await encoder.prepare()
        choices = served.generate()
    except BaseException:
        served.release()
        raise
    if encoder.stream:
        return await _stream(served, choices, encoder)
    return await _complete(served, choices, encoder, request)


async def _complete(
    served: ServedRequest, choices: ChoiceStream, encoder: ChoiceEncoder, request: Request
) -> JSONResponse:
    watcher = abort_on_disconnect(choices, request)
    try:
        async for index, chunk in choices:
            if served.drain is not None:
                served.drain.check_running()  # 503 once the gateway's grace period is over
            if served.recorder is not None:
                served.recorder.add(index, chunk)
            served.observe(index, chunk)
            encoder.add(index, chunk)
        await served.account(_tokens(encoder))
    finally:
        watcher.cancel()
        choices.abort()
        served.release()
        served.account_later(_tokens(encoder))  # aborted: what was generated so far
    if served.recorder is not None:
        await served.recorder.save()
    return JSONResponse(encoder.body(), headers=served.headers)


async def _stream(served: ServedRequest, choices: ChoiceStream, encoder: ChoiceEncoder) -> Response:
    def cleanup() -> None:
        choices.abort()
        served.release()
        served.account_later(_tokens(encoder))  # ended early: what was generated so far

    try:  # errors before the first token are plain HTTP errors
        first = await anext(choices, None)
    except BaseException:
        cleanup()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for data in encoder.head():
                yield data
            pending = [first] if first is not None else []
            while True:
                item = pending.pop() if pending else await anext(choices, None)
                if item is None:
                    break
                if served.drain is not None:
                    served.drain.check_running()  # the gateway is shutting down: past its grace period?
                index, chunk = item
                if served.recorder is not None:
                    served.recorder.add(index, chunk)
                served.observe(index, chunk)
                for data in encoder.events(index, chunk):
                    yield data
            if encoder.include_usage:
                yield encoder.usage()
            await served.account(_tokens(encoder))
            if served.recorder is not None:
                await served.recorder.save()
            yield DONE
        except asyncio.CancelledError:
            raise
        except DrainExpired as exc:  # shut down mid-stream: the error, then [DONE], so clients end cleanly
            yield error_event(exc)
            yield DONE
        except Exception as exc:  # after the headers: one error event, then close (contract A11)
            log.exception("%s stream %s failed", encoder.kind, served.id)
            yield error_event(exc)
        finally:
            cleanup()

    async def on_disconnect(_message) -> None:
        cleanup()

    response = sse_response(events(), served.headers)
    response.client_close_handler_callable = on_disconnect
    return response


def abort_on_disconnect(choices: ChoiceStream, request: Request) -> asyncio.Task:
    """Abort ``choices`` when the client of a non-streaming request goes away; cancel the returned task when
    done."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("client disconnected; aborting its generation")
                choices.abort()
                return

    return asyncio.create_task(watch())
