"""``APIFuture``: the result of an asynchronous server op, usable blocking, with ``await``, or as a
``concurrent.futures.Future``.

The op is submitted before the future is returned (so submission order is call order); the future then
long-polls ``retrieve_future`` on a background thread until the server reports a result or an error.
Internal poll outcomes form a small tagged union: ``None`` = not done yet (re-poll at once), a dict with
``"error"`` = failed (raised as the :mod:`livelora.clients.errors` class the server named), any other
dict = the result, parsed by the future's ``parse`` function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from livelora.clients.errors import InternalError, LiveloraError, UnavailableError, error_from_dict

T = TypeVar("T")
U = TypeVar("U")

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="livelora-future")


def failed_error(record: dict[str, Any]) -> LiveloraError:
    """The exception of a failed op's ``{"error", "category", "class"?, "code"?, "param"?}``."""
    if record.get("class"):
        return error_from_dict(
            {
                "class": record["class"],
                "message": record["error"],
                "param": record.get("param"),
                "code": record.get("code"),
            }
        )
    err = InternalError(str(record.get("error")))
    err.category = str(record.get("category", "unknown"))
    return err


class APIFuture(Generic[T]):
    """A pending result.

    * ``result(timeout=None)``: block until done; raises the op's error, or ``TimeoutError``.
    * ``await future``: the same from async code (does not block the event loop).
    * ``future()``: the underlying ``concurrent.futures.Future``.
    """

    def __init__(self, cf: concurrent.futures.Future):
        self._cf = cf

    @classmethod
    def polling(
        cls, transport: Any, request_id: str, parse: Callable[[dict[str, Any]], T], max_wait_s: float | None = None
    ) -> APIFuture[T]:
        """A future that polls ``request_id`` and parses its result with ``parse``."""
        return cls(_POOL.submit(_poll, transport, request_id, parse, max_wait_s))

    @classmethod
    def from_callable(cls, fn: Callable[[], T]) -> APIFuture[T]:
        """A future of ``fn()`` run on the SDK's thread pool (for multi-step operations)."""
        return cls(_POOL.submit(fn))

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        cf: concurrent.futures.Future = concurrent.futures.Future()
        cf.set_result(value)
        return cls(cf)

    def result(self, timeout: float | None = None) -> T:
        """The result (seconds ``timeout``; None = wait forever).

        Raises:
            TimeoutError: not done within ``timeout`` (the op keeps running on the server).
            LiveloraError: the op failed (the server's error class and message).
        """
        try:
            return self._cf.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no result within {timeout} s") from None

    def future(self) -> concurrent.futures.Future:
        return self._cf

    def done(self) -> bool:
        return self._cf.done()

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._cf).__await__()

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of ``fn(result)``."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(cf: concurrent.futures.Future) -> None:
            try:
                out.set_result(fn(cf.result()))
            except BaseException as exc:  # handed to the caller
                out.set_exception(exc)

        self._cf.add_done_callback(done)
        return APIFuture(out)


def _poll(transport: Any, request_id: str, parse: Callable[[dict[str, Any]], Any], max_wait_s: float | None) -> Any:
    start = time.monotonic()
    backoff = 0.5
    while True:
        try:
            record = transport.retrieve_future(request_id)
        except UnavailableError:  # server restarting or busy: back off (up to 30 s), like the tinker SDK
            if max_wait_s is not None and time.monotonic() - start > max_wait_s:
                raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            continue
        backoff = 0.5
        if record is None:
            if max_wait_s is not None and time.monotonic() - start > max_wait_s:
                raise TimeoutError(f"request {request_id} did not finish within {max_wait_s} s")
            continue
        if "error" in record:
            raise failed_error(record)
        return parse(record)


class SeqCounter:
    """Thread-safe counter handing out consecutive integers (seq ids reserved at call time)."""

    def __init__(self, start: int):
        self._next = start
        self._lock = threading.Lock()

    def take(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive values; returns the first."""
        with self._lock:
            first = self._next
            self._next += n
            return first
