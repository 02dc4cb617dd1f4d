"""The llama_cpp engine as the gateway serves it: llama.cpp in a supervised child process
(:mod:`livelora.gateway.engines.llama_cpp.process`), so a native crash fails the requests the child held and the
engine restarts, instead of ending the gateway (issue 46; docs/serving.md, "When llama.cpp crashes").

:class:`SupervisedLlamaCppEngine` validates requests against its own tokenizer and adapter table and proxies
generation, scoring and adapter loads to the child. When the child dies every request it held gets a 503
:class:`~livelora.gateway.engines.llama_cpp.process.EngineCrashedError` naming the cause, the cause is logged once
(signal, native build, advice), and a new child starts with the adapter versions that were loaded; requests that
arrive meanwhile wait up to :data:`RESTART_WAIT_S`. :data:`CRASH_LIMIT` crashes within :data:`CRASH_WINDOW_S` end
the restarts: :attr:`failure` names the cause (``/health`` answers 503) and, with ``exit_on_failure``, the process
gets SIGTERM (the gateway drains and ``livelora serve`` exits 1 with the message).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from livelora.clients.errors import RateLimitError, UnavailableError
from livelora.gateway.engines.base import (
    AdapterCheck,
    GenerationChunk,
    SamplingParams,
    TokenLogprob,
    check_score_request,
)
from livelora.gateway.engines.llama_cpp.engine import LlamaCppEngine
from livelora.gateway.engines.llama_cpp.process import EngineCrashedError, EngineProcess, describe_exit

log = logging.getLogger(__name__)

#: Crashes within CRASH_WINDOW_S seconds after which the engine is not restarted (the gateway reports it failed).
CRASH_LIMIT = 3
CRASH_WINDOW_S = 300.0
#: Seconds a request waits for a restarting engine before a 503 with Retry-After.
RESTART_WAIT_S = 120.0
#: Seconds a child may take to load the model.
START_TIMEOUT_S = 600.0


class SupervisedLlamaCppEngine(LlamaCppEngine):
    """:class:`~livelora.gateway.engines.llama_cpp.engine.LlamaCppEngine` with llama.cpp in a child process.

    Args: as :class:`LlamaCppEngine` (passed to the child's engine), plus ``exit_on_failure``: SIGTERM this process
    when the crash-loop bound is reached (the gateway's setting; a library user reads :attr:`failure`).
    """

    def __init__(self, model: str | None = None, *, exit_on_failure: bool = False, **kw: Any):
        super().__init__(model, **kw)
        self._child_kwargs = {"model": model, **kw}
        self.exit_on_failure = exit_on_failure
        self._proc: EngineProcess | None = None
        self._ready = threading.Event()
        self._crashes: collections.deque[float] = collections.deque()
        self._closing = False
        self.restarts = 0  # children started after a crash

    # ----- lifecycle -----------------------------------------------------------------
    def start_sync(self) -> None:
        """Load the tokenizer here and start the child (which loads llama.cpp).

        Raises:
            BadRequestError: as :meth:`LlamaCppEngine.start_sync` (raised in the child, carried over).
        """
        if self._proc is not None:
            return
        self._load_tokenizer()
        self._spawn()

    def _spawn(self) -> None:
        """Start a child, wait for its engine, load the adapter versions this engine has; it serves from then on."""
        proc = EngineProcess(self._child_kwargs, self._on_exit)
        try:
            self.vocab_size = proc.wait_ready(START_TIMEOUT_S)
            for name, path in list(self._adapters.paths.items()):
                proc.call_sync("load_adapter", name, path)
        except BaseException:
            proc.stop(timeout=5)
            raise
        self._proc = proc
        self._ready.set()

    async def close(self) -> None:
        self._closing = True
        proc, self._proc = self._proc, None
        self._ready.clear()
        if proc is not None:
            await asyncio.to_thread(proc.stop)

    def num_unfinished_requests(self) -> int:
        return 0 if self._proc is None else len(self._proc.streams)

    # ----- crashes -------------------------------------------------------------------
    def _on_exit(self, proc: EngineProcess, code: int) -> None:
        """(The pipe's reader thread.) Fail what ``proc`` held; restart it, or give up after a crash loop."""
        cause = f"the llama_cpp engine's process (pid {proc.pid}, {self.weights} weights) {describe_exit(code)}"
        current = not self._closing and proc is self._proc
        if current:
            self._ready.clear()
            self._crashed(cause)
        then = "the gateway stops" if self.failure else "the engine restarts, retry"
        proc.fail_all(EngineCrashedError(f"{cause} while it held this request; {then}", retry_after=5))
        if current:
            self._restart()

    def _crashed(self, cause: str) -> None:
        """Count a crash and log its cause once (signal, build, advice); at :data:`CRASH_LIMIT` within
        :data:`CRASH_WINDOW_S` set :attr:`failure` (and SIGTERM this process with ``exit_on_failure``)."""
        from livelora.gateway.engines.llama_cpp.canary import crash_advice, native_build

        now = time.monotonic()
        self._crashes.append(now)
        while now - self._crashes[0] > CRASH_WINDOW_S:
            self._crashes.popleft()
        advice = f"{native_build()}; {crash_advice(self.weights)}"
        if len(self._crashes) < CRASH_LIMIT:
            log.error("%s; it restarts with its %d adapter versions; %s", cause, len(self._adapters.paths), advice)
            return
        self.failure = (
            f"{cause}: {len(self._crashes)} crashes within {CRASH_WINDOW_S:.0f} s, so it is not restarted and the "
            f"gateway stops; {advice}"
        )
        log.error("%s", self.failure)
        if self.exit_on_failure:
            os.kill(os.getpid(), signal.SIGTERM)  # drain; `livelora serve` then exits 1 with the failure

    def _restart(self) -> None:
        while not self._closing and self.failure is None:
            try:
                self._spawn()
            except Exception as exc:  # counts as another crash
                self._crashed(f"the llama_cpp engine's process could not restart: {exc}")
                continue
            self.restarts += 1
            log.warning("the llama_cpp engine's process restarted (pid %d)", self._proc.pid if self._proc else 0)
            return

    async def _serving(self) -> EngineProcess:
        """The child serving now; waits up to :data:`RESTART_WAIT_S` while it restarts.

        Raises:
            UnavailableError: the engine failed (crash loop), is closed, or did not restart in time (Retry-After).
        """
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            if self.failure is not None:
                raise UnavailableError(self.failure, code="engine_failed", retry_after=60)
            proc = self._proc
            if self._ready.is_set() and proc is not None:
                return proc
            if self._closing or time.monotonic() > deadline:
                raise UnavailableError("the llama_cpp engine is restarting after a crash; retry", retry_after=5)
            await asyncio.sleep(0.05)

    # ----- requests ------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """See :meth:`Engine.generate`; validation errors are raised here, the rest in the child.

        Raises:
            As :meth:`TransformersEngine.generate`; UnavailableError: see :meth:`_serving` (on first iteration).
        """
        if self._tokenizer is None:
            raise UnavailableError("the engine is not started")
        prompt = self._check_tokens(prompt_token_ids, "prompt")
        params = self._check_params(params, len(prompt))
        self._adapters.check(adapter)
        waiting = self.num_unfinished_requests() - self.max_batch_size
        if waiting >= self.max_waiting:
            raise RateLimitError(f"{waiting} requests are queued; retry later", retry_after=1.0)
        return self._stream(request_id or uuid.uuid4().hex, prompt, params, adapter)

    async def _stream(
        self, rid: str, prompt: list[int], params: SamplingParams, adapter: str | None
    ) -> AsyncIterator[GenerationChunk]:
        proc = await self._serving()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def deliver(items: list[Any]) -> None:  # the pipe's reader thread
            try:
                loop.call_soon_threadsafe(lambda: [queue.put_nowait(item) for item in items])
            except RuntimeError:  # the consumer's loop is closed
                pass

        proc.streams[rid] = deliver
        finished = False
        try:
            proc.send(("gen", rid, prompt, params, adapter))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            proc.streams.pop(rid, None)
            if not finished:
                try:
                    proc.send(("cancel", rid))
                except EngineCrashedError:
                    pass

    async def score(
        self, token_ids: Sequence[int], adapter: str | None = None, top_logprobs: int = 0
    ) -> list[TokenLogprob | None]:
        """See :meth:`Engine.score` (in the child)."""
        ids = check_score_request(token_ids, top_logprobs, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        self._adapters.check(adapter)
        return await (await self._serving()).call("score", ids, adapter, top_logprobs)

    async def load_adapter(self, name: str, path: str) -> None:
        """See :meth:`Engine.load_adapter`: the child reads ``path`` and installs it."""

        async def install(p) -> tuple[str, Any]:
            return "", await (await self._serving()).call("load_adapter", name, str(p))

        await self._adapters.load_with(name, path, install)

    async def load_and_check(self, name: str, path: str, canary_token_ids: Sequence[int]) -> AdapterCheck:
        """See :meth:`Engine.load_and_check` (the child hashes, installs and scores in one pause of its loop)."""
        ids = check_score_request(canary_token_ids, 0, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

        async def install(p) -> tuple[str, Any]:
            check = await (await self._serving()).call("load_and_check", name, str(p), ids)
            return check.sha256, check

        _, check = await self._adapters.load_with(name, path, install)
        return check

    async def unload_adapter(self, name: str) -> None:
        """See :meth:`Engine.unload_adapter`."""

        async def remove() -> None:
            await (await self._serving()).call("unload_adapter", name)

        await self._adapters.unload_with(name, remove)
