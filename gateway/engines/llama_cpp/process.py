"""The llama_cpp engine's native part in a child process (issue 46): a crash in llama.cpp ends that process, not
the gateway.

:class:`EngineProcess` is the gateway's side of one child: it starts it (``multiprocessing``, spawn), sends it
requests over a pipe and routes what comes back. :func:`child_main` is the child: an in-process
:class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine` (batching loop, llama.cpp, sampling,
detokenization) serving the pipe's requests. Only requests, :class:`~livelora.gateway.engines.base.GenerationChunk`
items, scores and errors cross the pipe (pickled); adapter weights go by path.

Messages to the child: ``("gen", rid, prompt, params, adapter)``, ``("cancel", rid)``, ``("call", cid, op, args)``
(``op`` in :data:`CALLS`), ``("stop",)``. From the child: ``("ready", vocab_size)``, ``("failed", error)``,
``("out", rid, items)`` (chunks, or one error), ``("ret", cid, result, error)``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from livelora.clients.errors import InternalError, LiveloraError, UnavailableError

log = logging.getLogger(__name__)

#: Engine methods the gateway may call in the child.
CALLS = ("score", "load_adapter", "load_and_check", "unload_adapter")


class EngineCrashedError(UnavailableError):
    """The engine's child process died while it held this request (503, ``code`` ``engine_crashed``)."""

    default_code = "engine_crashed"


class EngineProcess:
    """The gateway's side of one engine child process.

    Args:
        kwargs: the :class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine` arguments the child builds
            its engine with.
        on_exit: called once, on the reader thread, with this object and the child's exit code (negative: the
            signal) after the child ended; every request it held is still open then (:meth:`fail_all`).
    """

    def __init__(self, kwargs: dict[str, Any], on_exit: Callable[[EngineProcess, int], None]):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child_conn, kwargs), name="livelora-llama-cpp", daemon=True)
        self.proc.start()
        child_conn.close()
        self.pid = self.proc.pid
        self.on_exit = on_exit
        self.lock = threading.Lock()  # sends, and the open tables against the end
        self.alive = True
        self.streams: dict[str, Callable[[list[Any]], None]] = {}
        self.calls: dict[int, Callable[[Any, BaseException | None], None]] = {}
        self.ids = itertools.count()

    def wait_ready(self, timeout: float) -> int:
        """Wait until the child's engine started; returns its vocabulary size and starts the reader thread.

        Raises:
            What the child's start raised; EngineCrashedError: the child ended first or took over ``timeout`` s.
        """
        try:
            if not self.conn.poll(timeout):
                raise EngineCrashedError(f"the llama_cpp engine's process did not start in {timeout:.0f} s")
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join()
            raise EngineCrashedError(f"the llama_cpp engine's process {describe_exit(self.proc.exitcode)}") from None
        if kind == "failed":
            raise value
        threading.Thread(target=self._read, name="livelora-llama-cpp-pipe", daemon=True).start()
        return int(value)

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "out":
                    deliver = self.streams.get(msg[1])
                    if deliver is not None:
                        deliver(msg[2])
                else:  # ("ret", cid, result, error)
                    settle = self.calls.pop(msg[1], None)
                    if settle is not None:
                        settle(msg[2], msg[3])
        except (EOFError, OSError):
            pass
        self.proc.join()
        with self.lock:
            self.alive = False
        self.on_exit(self, self.proc.exitcode if self.proc.exitcode is not None else -1)

    def send(self, msg: tuple) -> None:
        """Send ``msg`` to the child. Raises :class:`EngineCrashedError` once it is gone."""
        with self.lock:
            if self.alive:
                try:
                    self.conn.send(msg)
                    return
                except OSError:
                    pass
        raise EngineCrashedError("the llama_cpp engine's process is gone; it restarts, retry", retry_after=5)

    def fail_all(self, err: BaseException) -> None:
        """Finish every open stream and call with ``err``."""
        for deliver in list(self.streams.values()):
            deliver([err])
        self.streams.clear()
        calls, self.calls = self.calls, {}
        for settle in calls.values():
            settle(None, err)

    async def call(self, op: str, *args: Any) -> Any:
        """``op(*args)`` (:data:`CALLS`) on the child's engine; what it raises is raised here."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        cid = next(self.ids)
        self.calls[cid] = lambda result, exc: _threadsafe(loop, _settle, fut, result, exc)
        try:
            self.send(("call", cid, op, args))
            return await fut
        finally:
            self.calls.pop(cid, None)

    def call_sync(self, op: str, *args: Any, timeout: float = 600) -> Any:
        """:meth:`call` from a thread without an event loop."""
        done = threading.Event()
        box: list[Any] = [None, None]

        def settle(result: Any, exc: BaseException | None) -> None:
            box[:] = [result, exc]
            done.set()

        cid = next(self.ids)
        self.calls[cid] = settle
        self.send(("call", cid, op, args))
        if not done.wait(timeout):
            raise EngineCrashedError(f"the llama_cpp engine's process did not answer {op} in {timeout:.0f} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def stop(self, timeout: float = 30) -> None:
        """Ask the child to close its engine and end; kill it after ``timeout`` s."""
        try:
            self.send(("stop",))
        except EngineCrashedError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def describe_exit(code: int | None) -> str:
    """``was killed by SIGSEGV (signal 11)`` or ``exited with status 1``."""
    from livelora.gateway.engines.llama_cpp.canary import signal_name

    if code is not None and code < 0:
        return f"was killed by {signal_name(code)}"
    return f"exited with status {code}"


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's event loop is closed: nobody waits
        pass


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not fut.done():
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it crosses the pipe as itself (a livelora error), else an :class:`InternalError` naming it."""
    return exc if isinstance(exc, LiveloraError) else InternalError(f"llama_cpp engine: {type(exc).__name__}: {exc}")


# ----- the child ---------------------------------------------------------------------------------------------------
def child_main(conn, kwargs: dict[str, Any]) -> None:
    """The child process: start a :class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine` with
    ``kwargs``, answer ``("ready", vocab_size)`` (or ``("failed", error)``) and serve the pipe until ``stop`` or
    until the gateway's end of the pipe closes."""
    import faulthandler
    import os

    # before torch loads libgomp (llama.cpp's OpenMP too): spin 100 rounds at a barrier, as libgomp does in the
    # gateway's own process, where torch's thread pool beside llama.cpp's team makes more threads than cores; alone
    # here it would spin 300,000 and, on busy cores, wait for a descheduled partner (1 stream, load 10 on 2 cores:
    # 1.6-3.6 tok/s instead of 31; docs/serving.md, "The engine's process")
    os.environ.setdefault("GOMP_SPINCOUNT", "100")
    from livelora.gateway.engines.llama_cpp.engine import LlamaCppEngine

    faulthandler.enable(all_threads=True)  # a native crash writes the Python stacks to stderr (the gateway's log)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = LlamaCppEngine(**kwargs)
        engine.start_sync()
    except BaseException as exc:
        conn.send(("failed", _portable(exc)))
        return
    conn.send(("ready", engine.vocab_size))
    asyncio.run(_ChildServer(conn, engine).serve())


class _ChildServer:
    """The child's event loop: one task per generation or call, fed by a thread that reads the pipe."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.tasks: dict[str, asyncio.Task] = {}
        self.calls: set[asyncio.Task] = set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple] = asyncio.Queue()

        def read() -> None:  # reader thread
            try:
                while True:
                    msg = self.conn.recv()
                    loop.call_soon_threadsafe(inbox.put_nowait, msg)
                    if msg[0] == "stop":
                        return
            except (EOFError, OSError):  # the gateway is gone
                loop.call_soon_threadsafe(inbox.put_nowait, ("stop",))

        threading.Thread(target=read, name="livelora-pipe", daemon=True).start()
        while True:
            msg = await inbox.get()
            if msg[0] == "gen":
                self.tasks[msg[1]] = asyncio.create_task(self._generate(*msg[1:]))
            elif msg[0] == "cancel":
                task = self.tasks.pop(msg[1], None)
                if task is not None:
                    task.cancel()
            elif msg[0] == "call" and msg[2] in CALLS:
                call = asyncio.create_task(self._call(msg[1], msg[2], msg[3]))
                self.calls.add(call)
                call.add_done_callback(self.calls.discard)
            elif msg[0] == "stop":
                break
        await self.engine.close()

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the gateway is gone; the reader ends the loop
            pass

    async def _generate(self, rid: str, prompt: list[int], params, adapter: str | None) -> None:
        try:
            async for chunk in self.engine.generate(prompt, params, adapter=adapter, request_id=rid):
                self._send(("out", rid, [chunk]))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self._send(("out", rid, [_portable(exc)]))
        finally:
            self.tasks.pop(rid, None)

    async def _call(self, cid: int, op: str, args: tuple) -> None:
        try:
            result = await getattr(self.engine, op)(*args)
        except BaseException as exc:
            self._send(("ret", cid, None, _portable(exc)))
            return
        self._send(("ret", cid, result, None))
