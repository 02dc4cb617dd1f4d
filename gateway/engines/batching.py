"""The continuous-batching loop every CPU engine shares (:class:`BatchingLoop`), over a :class:`ModelBackend`.

One thread owns the model. While there is work it runs queued commands (adapter load/unload,
:meth:`BatchingLoop.score`) between forward passes, drops cancelled sequences, admits waiting ones up to
``max_batch_size`` (prefilled in groups of similar prompt length, :func:`prefill_groups`), and runs one decode step
for every running sequence; sampling, stop handling and streaming are the loop's. The forward passes, the KV cache
and the adapter weights are the backend's: :class:`~livelora.gateway.engines.transformers.backend.TransformersBackend`
(LoRA slots, :mod:`.lora_slots`) or :class:`~livelora.gateway.engines.llama_cpp.backend.LlamaBackend` (llama.cpp
lanes). A version is unloaded only when no queued, admitted or running sequence uses it. The loop step by step:
``docs/internals/engines.md``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from livelora.clients.errors import ConflictError, InternalError, LiveloraError
from livelora.core import metrics
from livelora.gateway.engines.base import GenerationChunk, SamplingParams, TokenLogprob
from livelora.gateway.engines.detokenize import IncrementalDetokenizer, StopStringMatcher
from livelora.gateway.engines.residency import Residency
from livelora.gateway.engines.sampling import RowSampling, sample_batch

log = logging.getLogger(__name__)

#: Runs a callable on the loop's thread between two steps (:meth:`BatchingLoop.call`).
Schedule = Callable[[Callable[[], None]], None]
#: One forward pass's rows and their next-token logits, float ``(len(rows), vocab)``.
Forward = tuple[list["Sequence"], torch.Tensor]


@dataclass(eq=False)
class Sequence:
    """One generation request as the worker sees it: its state, its delivery, and what a sampled token does
    to it (:meth:`advance`)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter: str | None
    sampling: RowSampling
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    deliver: Callable[[list[Any]], None]  # thread-safe: hands items to the consumer's event loop
    num_generated: int = 0
    next_token: int = -1
    finished: bool = False
    cancelled: bool = False
    outbox: list[Any] = field(default_factory=list)

    def send(self, items: list[Any]) -> None:
        """Hand ``items`` to the consumer; a closed consumer event loop (nobody listening) cancels the sequence."""
        try:
            self.deliver(items)
        except RuntimeError:
            self.cancelled = True

    def fail(self, err: BaseException) -> None:
        """Finish with ``err`` (delivered to the consumer, who raises it) unless already finished."""
        if not self.finished:
            self.finished = True
            self.send([err])

    def advance(self, tok: int, lp: float, top: list[tuple[int, float]], eos_ids: set[int]) -> GenerationChunk:
        """Account one sampled token (stop token, stop string, ``max_tokens``); return the chunk to stream."""
        p = self.params
        self.num_generated += 1
        self.next_token = tok
        if self.sampling.penalties:
            self.sampling.penalties.record(tok)
        if self.sampling.banned and self.num_generated >= p.min_tokens:
            self.sampling.banned = ()  # end tokens may be sampled from now on
        want_lp = p.logprobs
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids):
            text, matched = self.stopper.feed(self.detok.flush())
            if matched is None:
                text += self.stopper.flush()
            self.finished = True
            reason = matched if matched is not None else (tok if tok in p.stop_token_ids else None)
            stop_lp = TokenLogprob(tok, lp, top) if want_lp else None
            return GenerationChunk([], text, [] if want_lp else None, "stop", reason, stop_lp)
        token_lp = [TokenLogprob(tok, lp, top)] if want_lp else None
        text, matched = self.stopper.feed(self.detok.push(tok))
        if matched is None and self.num_generated >= p.max_tokens:
            more, matched = self.stopper.feed(self.detok.flush())
            text += more
            if matched is None:
                text += self.stopper.flush()
                self.finished = True
                return GenerationChunk([tok], text, token_lp, "length", None)
        if matched is not None:
            self.finished = True
            return GenerationChunk([tok], text, token_lp, "stop", matched)
        return GenerationChunk([tok], text, token_lp)


class ModelBackend(Protocol):
    """What :class:`BatchingLoop` asks of a model: forward passes over its own KV cache, adapter versions, scoring.

    Every method but :meth:`read_adapter` and :meth:`close` runs on the loop's thread. The loop keeps the running
    rows in admission order; ``keep`` arguments are indices into the rows a call names, in that order.
    """

    #: threads the backend's kernels use now (:meth:`set_threads` changes it)
    threads: int

    def set_threads(self, n: int) -> None:
        """Run the kernels on ``n`` threads from the next forward pass on."""

    def prefill(self, group: list[Sequence]) -> Iterator[Forward]:
        """Forward the prompts of ``group``, yielding each pass's rows (together, ``group``) and logits; before the
        next pass (or the end) the loop has sampled those rows and called :meth:`admit` on them."""

    def admit(self, rows: list[Sequence], keep: list[int]) -> None:
        """After their prefill: ``rows[i]`` for ``i`` in ``keep`` join the running batch (after the running rows,
        in order); the others (finished at their first token) release what they hold."""

    def decode(self, running: list[Sequence]) -> Iterator[Forward]:
        """One decode step: forward each running row's ``next_token``, yielding each pass's rows and logits (the
        loop samples them before the next pass)."""

    def decoded(self, running: list[Sequence]) -> None:
        """After a decode step over ``running`` (before its finished rows are dropped): the step count a backend
        keeps to merge a version that serves every row."""

    def drop(self, running: list[Sequence], keep: list[int]) -> None:
        """Only ``running[i]`` for ``i`` in ``keep`` stay in the batch; the others release their KV cache."""

    def reset(self) -> None:
        """Forget every running row and its KV cache (after a failed step, or when closing)."""

    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        """Prompt logprobs of ``token_ids`` on ``adapter``: ``None`` for the first token, then each token's
        logprob given the ones before it with its ``top_k`` alternatives."""

    def read_adapter(self, path: Path) -> tuple[Any, Any, str]:
        """(Any thread.) Read a PEFT directory: ``(its config, weights for install, sha256 of the weights file)``.

        Raises:
            BadRequestError: unreadable files, not a LoRA, or an adapter this backend cannot apply.
        """

    def install(self, name: str, config: Any, weights: Any, source: str) -> None:
        """Serve adapter version ``name`` from :meth:`read_adapter`'s ``config`` and ``weights``.

        Raises:
            BadRequestError: the weights do not fit this base; nothing changes.
        """

    def uninstall(self, name: str) -> None:
        """Free adapter version ``name``, resident or cold (no sequence uses it any more)."""

    def evict(self, name: str) -> None:
        """Make resident version ``name`` cold: free its weights, keeping a copy on the backend's own disk."""

    def restore(self, name: str) -> None:
        """Make cold version ``name`` resident again from its copy (:meth:`evict`)."""

    def version_bytes(self, name: str) -> int:
        """Memory resident version ``name`` takes (bytes)."""

    def close(self, stepping: bool) -> None:
        """(Any thread, after the loop stopped.) Free what the backend holds; ``stepping``: the loop's thread is
        still inside a step (its native memory must stay)."""


class BatchingLoop:
    """The thread that admits, steps and streams every sequence (the loop: docs/internals/engines.md).

    Args:
        make_backend: builds the :class:`ModelBackend` given :meth:`call` (for work it defers to the loop's thread).
        eos_ids: token ids that end a sequence unless ``ignore_eos``.
        max_batch_size: running sequences at most; more wait in the queue.
        max_prefill_tokens: prompt tokens per admission round (at least one prompt is admitted).
        share: ``(TrainingFlag, threads when idle, threads while a training step runs)``, or ``None``: the
            backend's threads are then never changed (:mod:`livelora.core.cpu_share`).
        serving: a :class:`~livelora.core.cpu_share.ServingFlag` beaten while sequences run or wait (a trainer
            process on this machine then keeps to its thread budget), or ``None``.
        max_resident: adapter versions whose weights stay in the backend at most (:mod:`.residency`; ``None``:
            derived from ``memory``, the device's bytes).
    """

    def __init__(
        self,
        make_backend: Callable[[Schedule], ModelBackend],
        *,
        eos_ids: set[int],
        max_batch_size: int,
        max_prefill_tokens: int,
        share: tuple[Any, int, int] | None = None,
        serving: Any = None,
        max_resident: int | None = None,
        memory: int = 0,
    ):
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.admitting: list[Sequence] = []  # taken from waiting, not yet prefilled
        self.commands: collections.deque[Callable[[], None]] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.steps = 0  # decode steps run (for tests and stats)
        self.share = share
        self.serving = serving
        self.backend = make_backend(self.call)
        #: resident and cold adapter versions (a waiting sequence on a cold one is admitted once it is loaded back)
        self.residency = Residency(self.backend, max_resident, memory, max_batch_size)
        self.thread = threading.Thread(target=self._run, name="livelora-engine", daemon=True)

    # ----- called from other threads -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self.cond:
            self.waiting.append(seq)
            self.cond.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread between two steps."""
        with self.cond:
            self.commands.append(fn)
            self.cond.notify()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        """Abort every sequence, end the thread (waiting up to 30 s for a step) and close the backend."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.backend.close(self.thread.is_alive())

    def num_unfinished(self) -> int:
        return sum(not (s.cancelled or s.finished) for s in list(self.running) + list(self.waiting) + self.admitting)

    # ----- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.commands or self.waiting or self.running):
                    self.cond.wait()
                if self.stopping:
                    break
            self._run_commands()
            self._share_cores()
            if self.serving is not None and (self.running or self.waiting):
                self.serving.beat()
            groups: list[list[Sequence]] = []
            try:
                with torch.inference_mode():
                    self._drop([s for s in self.running if s.cancelled])
                for _ in range(ADMISSION_ROUNDS):  # arrivals during a prefill get theirs before the decode step
                    groups = self._admit()
                    if not groups:
                        break
                    self._prefill_all(groups)
                if self.running:
                    with torch.inference_mode():
                        self._decode_step()
            except Exception as exc:  # a fault of ours: fail every running sequence, keep serving
                log.exception("engine step failed")
                err = exc if isinstance(exc, LiveloraError) else InternalError(f"engine step failed: {exc}")
                for s in self.running + [s for group in groups for s in group]:  # admitted ones too
                    s.fail(err)
                self._reset_batch()
                self.admitting = []
        self._abort_all()

    def _share_cores(self) -> None:
        """Use fewer threads while a training step runs on this machine, all of them otherwise
        (:mod:`livelora.core.cpu_share`: an OpenMP thread sharing its core with a step stalls every
        parallel region of the engine)."""
        if self.share is None:
            return
        flag, idle, busy = self.share
        want = busy if flag.active() else idle
        if want != self.backend.threads:
            self.backend.set_threads(want)

    def _run_commands(self) -> None:
        """Run the queued commands (adapter loads and unloads, scoring)."""
        with self.cond:
            commands = list(self.commands)
            self.commands.clear()
        with torch.no_grad():  # not inference_mode: adapter loads create parameters
            for fn in commands:
                try:
                    fn()
                except Exception:  # a command reports its own errors to its caller; this is a bug of ours
                    log.exception("engine command failed")

    def _abort_all(self) -> None:
        err = InternalError("the engine was closed")
        with self.cond:
            pending = list(self.running) + list(self.waiting)
            self.waiting.clear()
        for s in pending:
            s.fail(err)
        self._reset_batch()

    def _reset_batch(self) -> None:
        """Forget every running sequence and its cache (after a failed step, or when closing)."""
        self.running = []
        self.backend.reset()

    # ----- admission and steps ----------------------------------------------------------
    def _admit(self) -> list[list[Sequence]]:
        """Take waiting sequences (FIFO, up to ``max_batch_size`` running and ``max_prefill_tokens`` prompt
        tokens per round) and return them in prefill groups of similar length (:func:`prefill_groups`),
        shortest first, so a short prompt neither waits for nor is padded to a long one."""
        free = self.max_batch_size - len(self.running)
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while len(admitted) < free:
            with self.cond:  # only this thread takes from the queue: its head stays while the lock is released
                seq = self.waiting[0] if self.waiting else None
            if seq is None or (admitted and len(seq.prompt) > budget and not seq.cancelled):
                break
            ready = seq.cancelled or self._resident(seq, admitted)
            if ready is False:  # its version waits for a resident one to drain (FIFO: nothing overtakes it)
                break
            with self.cond:
                self.waiting.popleft()
            if ready is True and not seq.cancelled:
                budget -= len(seq.prompt)
                admitted.append(seq)
        return prefill_groups(admitted)

    def _resident(self, seq: Sequence, admitted: list[Sequence]) -> bool | None:
        """Load ``seq``'s version back if it is cold: ``True`` (ready), ``False`` (every resident version has
        rows in flight: wait), ``None`` (it could not be loaded: ``seq`` failed)."""
        busy = {s.adapter for s in self.running + self.admitting + admitted}
        try:
            return self.residency.ensure(seq.adapter, busy)
        except Exception as exc:
            log.exception("could not load cold version %s back", seq.adapter)
            seq.fail(exc if isinstance(exc, LiveloraError) else InternalError(f"could not load {seq.adapter}: {exc}"))
            return None

    def _prefill_all(self, groups: list[list[Sequence]]) -> None:
        """Prefill ``groups`` one after the other; commands (a swap) may run between them and before decoding."""
        self.admitting = [s for group in groups for s in group]
        for group in groups:
            with torch.inference_mode():
                for rows, logits in self.backend.prefill(group):
                    self._sample_and_emit(rows, logits)
                    keep = [i for i, s in enumerate(rows) if not s.finished]
                    self.backend.admit(rows, keep)
                    self.running.extend(rows[i] for i in keep)
            self.admitting = self.admitting[len(group) :]
            self._run_commands()

    def _decode_step(self) -> None:
        for rows, logits in self.backend.decode(self.running):
            self._sample_and_emit(rows, logits)
        self.steps += 1
        metrics.BATCH_SIZE.observe(len(self.running))
        self.backend.decoded(self.running)
        self._drop([s for s in self.running if s.finished])

    def _drop(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        gone_ids = {id(s) for s in gone}
        keep = [i for i, s in enumerate(self.running) if id(s) not in gone_ids]
        self.backend.drop(self.running, keep)
        self.running = [self.running[i] for i in keep]

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        step = sample_batch(logits, [s.sampling for s in seqs])
        for i, seq in enumerate(seqs):
            if seq.cancelled:
                seq.finished = True
                continue
            seq.send([seq.advance(step.token_ids[i], step.logprobs[i], step.top[i], self.eos_ids)])

    # ----- commands (run on this thread between steps) ----------------------------------
    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        """:meth:`ModelBackend.score` (a cold version is loaded back, beyond the limit if it must)."""
        self.residency.ensure(adapter, self._busy(), force=True)
        return self.backend.score(token_ids, adapter, top_k)

    def _busy(self) -> set[str | None]:
        """Versions of the running and admitted rows (never made cold)."""
        return {s.adapter for s in self.running + self.admitting}

    def load_adapter(
        self, name: str, config, weights, source: str, canary: list[int] | None = None
    ) -> list[TokenLogprob | None] | None:
        """Install adapter version ``name`` (``config`` and ``weights`` from :meth:`ModelBackend.read_adapter`,
        read by the caller); with ``canary``, score those tokens on it in the same pause of the decode loop.

        Returns:
            :meth:`score` of ``canary`` on the new version, or ``None`` without ``canary``.

        Raises:
            BadRequestError: not a LoRA config, or the weights do not fit (missing tensors, wrong shapes);
                nothing changes.
        """
        self.residency.make_room(1, self._busy())
        self.backend.install(name, config, weights, source)
        self.residency.added(name, self._busy())
        if canary is None:
            return None
        try:
            return self.score(canary, name, 0)
        except BaseException:
            self.unload_adapter(name)
            raise

    def unload_adapter(self, name: str) -> None:
        """Remove adapter version ``name``.

        Raises:
            ConflictError: a queued, admitted or running sequence uses it; nothing changes.
        """
        users = [
            s
            for s in list(self.running) + list(self.waiting) + self.admitting
            if s.adapter == name and not (s.cancelled or s.finished)
        ]
        if users:
            raise ConflictError(f"adapter {name!r} is in use by {len(users)} running or queued sequences", param="name")
        self.residency.forget(name)
        self.backend.uninstall(name)


#: Admission rounds per decode step: sequences that arrive while the first round prefills are admitted
#: before the step instead of after it (shorter time to first token, one step's delay for the running ones).
ADMISSION_ROUNDS = 2
#: A prefill group's padded tokens may exceed its real prompt tokens by this factor plus PAD_ALLOWANCE.
PAD_SLACK = 1.25
PAD_ALLOWANCE = 8


def prefill_groups(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Split sequences to prefill into groups of similar prompt length, shortest first.

    A left-padded group of n prompts costs ``n * longest`` token positions; on a CPU, where a forward pass
    is compute-bound, padding is pure waste, so a group is closed when adding the next (longer) prompt would
    make its padded size exceed ``PAD_SLACK * real tokens + PAD_ALLOWANCE``.
    """
    groups: list[list[Sequence]] = []
    current: list[Sequence] = []
    real = 0
    for seq in sorted(seqs, key=lambda s: len(s.prompt)):
        n = len(seq.prompt)
        if current and n * (len(current) + 1) > PAD_SLACK * (real + n) + PAD_ALLOWANCE:
            groups.append(current)
            current, real = [], 0
        current.append(seq)
        real += n
    if current:
        groups.append(current)
    return groups
