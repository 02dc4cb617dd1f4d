"""The worker thread of :class:`~livelora.gateway.engines.transformers.engine.TransformersEngine`: continuous batching.

One thread owns the model (:class:`Worker`). While there is work it runs queued commands (adapter load/unload,
:meth:`Worker.score`) between forward passes, drops cancelled sequences, admits waiting ones up to
``max_batch_size`` (prefilled in groups of similar prompt length, :func:`prefill_groups`, then merged into the
running :class:`~livelora.gateway.engines.transformers.kv_batch.KVBatch`), and runs one decode step for every running
sequence. Rows may use different adapter versions (:mod:`.lora_slots`); a version is unloaded only when no queued,
admitted or running sequence uses it. The loop step by step: ``docs/internals/engines.md``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from livelora.clients.errors import ConflictError, InternalError, LiveloraError
from livelora.core import metrics
from livelora.gateway.engines.base import GenerationChunk, SamplingParams, TokenLogprob
from livelora.gateway.engines.detokenize import IncrementalDetokenizer, StopStringMatcher
from livelora.gateway.engines.lora_slots import LoraSlots
from livelora.gateway.engines.sampling import RowSampling, prompt_logprobs, sample_batch
from livelora.gateway.engines.transformers.kv_batch import KVBatch, left_padded

log = logging.getLogger(__name__)


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


class Worker:
    """Owns the model and the running batch (the loop: docs/internals/engines.md).

    Args:
        model: the transformers causal LM (eval mode, on ``device``).
        tokenizer: its tokenizer.
        eos_ids: token ids that end a sequence unless ``ignore_eos``.
        max_batch_size: running sequences at most; more wait in the queue.
        max_prefill_tokens: padded prompt tokens per prefill forward (at least one prompt is admitted).
        merge_lora: serve a version that every row uses from merged weights (:class:`~.lora_slots.MergedVersion`).
        quantize: the model's linear layers serve int8 weights (:mod:`.quantized`); merged versions are re-quantized.
        serving: a :class:`~livelora.core.cpu_share.ServingFlag` beaten while sequences run or wait (a trainer
            process on this machine then keeps to its thread budget), or ``None``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        eos_ids: set[int],
        max_batch_size: int,
        max_prefill_tokens: int,
        device: str,
        share: tuple[Any, int, int] | None = None,
        merge_lora: bool = True,
        quantize: bool = False,
        serving: Any = None,
    ):
        self.model = model  # the plain transformers model (LoRA layers are injected into it when adapters load)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.device = device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batch = KVBatch()
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.admitting: list[Sequence] = []  # taken from waiting, not yet prefilled
        self.commands: collections.deque[Callable[[], None]] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        #: adapter versions in LoRA slots, and the forward pass that serves each row its own version
        self.slots = self._new_slots(merge_lora, quantize)
        self.steps = 0  # decode steps run (for tests and stats)
        #: ``(TrainingFlag, threads when idle, threads while a training step runs)`` or None (never changed)
        self.share = share
        self.serving = serving
        self.threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name="livelora-engine", daemon=True)

    # ----- called from other threads -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self.cond:
            self.waiting.append(seq)
            self.cond.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker thread between two steps."""
        with self.cond:
            self.commands.append(fn)
            self.cond.notify()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

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
                    self.admitting = [s for group in groups for s in group]
                    for group in groups:  # commands (a swap) may run between prefill groups and before decoding
                        with torch.inference_mode():
                            self._prefill(group)
                        self.admitting = self.admitting[len(group) :]
                        self._run_commands()
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
        """Use fewer torch threads while a training step runs on this machine, all of them otherwise
        (:mod:`livelora.core.cpu_share`: an OpenMP thread sharing its core with a step stalls every
        parallel region of the engine)."""
        if self.share is None:
            return
        flag, idle, busy = self.share
        want = busy if flag.active() else idle
        if want != self.threads:
            torch.set_num_threads(want)  # this thread runs the engine's kernels
            self.threads = torch.get_num_threads()

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

    # ----- what a model backend provides (:mod:`livelora.gateway.engines.llama_cpp.worker` replaces these) ------------
    def _new_slots(self, merge: bool, quantize: bool) -> LoraSlots:
        return LoraSlots(self.model, self.call, merge=merge, quantize=quantize)

    def _reset_batch(self) -> None:
        """Forget every running sequence and its cache (after a failed step, or when closing)."""
        self.running, self.batch = [], KVBatch()

    def read_adapter(self, path: Path) -> tuple[Any, Any, str]:
        """Read a PEFT directory off the worker thread: ``(config, weights for load_adapter, sha256)``."""
        from livelora.gateway.engines.transformers.adapters import read_adapter

        return read_adapter(path, self.device)

    # ----- forward passes -------------------------------------------------------------
    def forward(self, adapters: list[str | None], **kw) -> torch.Tensor:
        """One forward pass; returns logits ``(B, T_kept, V)``. ``adapters`` has one entry per row
        (:meth:`~.lora_slots.LoraSlots.forward`)."""
        return self.slots.forward(adapters, **kw)

    def _admit(self) -> list[list[Sequence]]:
        """Take waiting sequences (FIFO, up to ``max_batch_size`` running and ``max_prefill_tokens`` prompt
        tokens per round) and return them in prefill groups of similar length (:func:`prefill_groups`),
        shortest first, so a short prompt neither waits for nor is padded to a long one."""
        free = self.max_batch_size - len(self.running)
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        with self.cond:
            while self.waiting and len(admitted) < free:
                seq = self.waiting[0]
                if seq.cancelled:
                    self.waiting.popleft()
                    continue
                if admitted and len(seq.prompt) > budget:
                    break
                budget -= len(seq.prompt)
                admitted.append(self.waiting.popleft())
        return prefill_groups(admitted)

    def _prefill(self, group: list[Sequence]) -> None:
        from transformers import DynamicCache

        ids, mask, pos = left_padded([s.prompt for s in group], self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.forward(
            [s.adapter for s in group],
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        new = KVBatch()
        new.merge(cache, mask)
        self._sample_and_emit(group, logits[:, -1, :])
        keep = [i for i, s in enumerate(group) if not s.finished]
        new.select(keep)
        if keep:
            self.batch.merge(new.cache, new.mask)
            self.running.extend(group[i] for i in keep)

    def _decode_step(self) -> None:
        ids = torch.tensor([[s.next_token] for s in self.running], dtype=torch.long, device=self.device)
        mask, pos = self.batch.step_inputs()
        logits = self.forward(
            [s.adapter for s in self.running],
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=self.batch.cache,
            use_cache=True,
        )
        self.steps += 1
        metrics.BATCH_SIZE.observe(len(self.running))
        self._sample_and_emit(self.running, logits[:, -1, :])
        self._drop([s for s in self.running if s.finished])

    def _drop(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        gone_ids = {id(s) for s in gone}
        keep = [i for i, s in enumerate(self.running) if id(s) not in gone_ids]
        self.batch.select(keep)
        self.running = [self.running[i] for i in keep]

    # ----- sampling and streaming -------------------------------------------------------
    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        step = sample_batch(logits, [s.sampling for s in seqs])
        for i, seq in enumerate(seqs):
            if seq.cancelled:
                seq.finished = True
                continue
            seq.send([seq.advance(step.token_ids[i], step.logprobs[i], step.top[i], self.eos_ids)])

    # ----- commands (run on this thread between steps) ----------------------------------
    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.forward([adapter], input_ids=ids, use_cache=False)
        chosen, tops = prompt_logprobs(logits[0], ids[0], top_k)
        return [None] + [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids[1:], chosen, tops)]

    def load_adapter(
        self, name: str, config, weights: dict[str, torch.Tensor], source: str, canary: list[int] | None = None
    ) -> list[TokenLogprob | None] | None:
        """Install adapter version ``name`` (a peft ``LoraConfig`` and its state dict, read by the caller)
        into a LoRA slot (:meth:`~.lora_slots.LoraSlots.install`); with ``canary``, score those tokens on it in
        the same pause of the decode loop.

        Returns:
            :meth:`score` of ``canary`` on the new version, or ``None`` without ``canary``.

        Raises:
            BadRequestError: not a LoRA config, or the weights do not fit (missing tensors, wrong shapes);
                nothing changes.
        """
        self._install(name, config, weights, source)
        if canary is None:
            return None
        try:
            return self.score(canary, name, 0)
        except BaseException:
            self.unload_adapter(name)
            raise

    def unload_adapter(self, name: str) -> None:
        """Remove adapter version ``name``; :class:`ConflictError` while a live sequence uses it.

        Its slot becomes free for the next version of the same shape (:meth:`~.lora_slots.LoraSlots.release`).
        """
        self._check_unused(name)
        self.slots.release(name)

    def _install(self, name: str, config, weights, source: str) -> None:
        """Put version ``name`` where the forward passes find it (a LoRA slot here)."""
        self.slots.install(name, config, weights, source)

    def _check_unused(self, name: str) -> None:
        """Raises :class:`ConflictError` while a queued, admitted or running sequence uses adapter ``name``."""
        users = [
            s
            for s in list(self.running) + list(self.waiting) + self.admitting
            if s.adapter == name and not (s.cancelled or s.finished)
        ]
        if users:
            raise ConflictError(f"adapter {name!r} is in use by {len(users)} running or queued sequences", param="name")


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
