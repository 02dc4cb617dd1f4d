"""The worker thread of :class:`~.transformers_engine.TransformersEngine`: continuous batching.

One thread owns the model. Its loop, repeated while there is work:

1. run queued commands (adapter load/unload, :meth:`score`) *between* steps,
   so they never disturb a forward pass of running sequences;
2. drop cancelled sequences from the batch (their KV rows are freed);
3. admit waiting sequences up to ``max_batch_size``: prefill them together
   (left-padded, one forward), sample their first token, and merge their KV
   cache rows into the running :class:`~.kv_batch.KVBatch`;
4. one decode step for every running sequence: feed each row's last token,
   sample the next one for all rows at once (:func:`~.sampling.sample_batch`),
   stream the chunks, and drop finished rows.

Adapters: rows of one batch may use different adapters. When any row uses an
adapter the forward goes through peft with ``adapter_names=`` (one name per row,
``"__base__"`` for base rows; peft's mixed-batch LoRA forward). When no row uses
an adapter the LoRA layers are switched off, so base-only batches run at base
speed; with no adapter loaded at all the plain transformers model is called.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from livelora.clients.errors import BadRequestError, ConflictError, InternalError, LiveloraError
from livelora.gateway.engines.base import GenerationChunk, SamplingParams, TokenLogprob
from livelora.gateway.engines.detokenize import IncrementalDetokenizer, StopStringMatcher
from livelora.gateway.engines.kv_batch import KVBatch, left_padded
from livelora.gateway.engines.sampling import RowSampling, prompt_logprobs, sample_batch

log = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in adapter_names


@dataclass(eq=False)
class Sequence:
    """One generation request as the worker sees it."""

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


class Worker:
    """Owns the model and the running batch; see the module docstring.

    Args:
        model: the transformers causal LM (eval mode, on ``device``).
        tokenizer: its tokenizer.
        eos_ids: token ids that end a sequence unless ``ignore_eos``.
        max_batch_size: running sequences at most; more wait in the queue.
        max_prefill_tokens: padded prompt tokens per prefill forward (at least one prompt is admitted).
    """

    def __init__(self, model, tokenizer, *, eos_ids: set[int], max_batch_size: int,
                 max_prefill_tokens: int, device: str):
        self.model = model  # the plain transformers model (LoRA layers are injected into it when adapters load)
        self.peft = None  # PeftModel wrapping self.model once an adapter is loaded
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.device = device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batch = KVBatch()
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.commands: collections.deque[Callable[[], None]] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.lora_enabled = True
        self.steps = 0  # decode steps run (for tests and stats)
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
        return sum(not (s.cancelled or s.finished) for s in list(self.running) + list(self.waiting))

    # ----- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.commands or self.waiting or self.running):
                    self.cond.wait()
                if self.stopping:
                    break
                commands = list(self.commands)
                self.commands.clear()
            with torch.no_grad():  # not inference_mode: adapter loads create parameters
                for fn in commands:
                    fn()
            try:
                with torch.inference_mode():
                    self._drop([s for s in self.running if s.cancelled])
                    self._admit()
                    if self.running:
                        self._decode_step()
            except Exception as exc:  # a fault of ours: fail every running sequence, keep serving
                log.exception("engine step failed")
                err = exc if isinstance(exc, LiveloraError) else InternalError(f"engine step failed: {exc}")
                for s in self.running:
                    self._finish_with_error(s, err)
                self.running, self.batch = [], KVBatch()
        self._abort_all()

    def _abort_all(self) -> None:
        err = InternalError("the engine was closed")
        with self.cond:
            pending = list(self.running) + list(self.waiting)
            self.waiting.clear()
        for s in pending:
            self._finish_with_error(s, err)
        self.running, self.batch = [], KVBatch()

    def _finish_with_error(self, seq: Sequence, err: BaseException) -> None:
        if not seq.finished:
            seq.finished = True
            self._send(seq, [err])

    def _send(self, seq: Sequence, items: list[Any]) -> None:
        try:
            seq.deliver(items)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            seq.cancelled = True

    # ----- forward passes -------------------------------------------------------------
    def _set_lora(self, enabled: bool) -> None:
        if self.peft is not None and enabled != self.lora_enabled:
            if enabled:
                self.peft.base_model.enable_adapter_layers()
            else:
                self.peft.base_model.disable_adapter_layers()
            self.lora_enabled = enabled

    def forward(self, adapters: list[str | None], **kw) -> torch.Tensor:
        """One forward pass; returns logits ``(B, T_kept, V)``. ``adapters`` has one entry per row."""
        if self.peft is None:
            return self.model(**kw).logits
        if all(a is None for a in adapters):
            self._set_lora(False)
            return self.model(**kw).logits
        self._set_lora(True)
        names = [a if a is not None else BASE_ADAPTER for a in adapters]
        return self.peft(adapter_names=names, **kw).logits

    def _admit(self) -> None:
        free = self.max_batch_size - len(self.running)
        group: list[Sequence] = []
        with self.cond:
            while self.waiting and len(group) < free:
                seq = self.waiting[0]
                if seq.cancelled:
                    self.waiting.popleft()
                    continue
                longest = max([len(s.prompt) for s in group] + [len(seq.prompt)])
                if group and longest * (len(group) + 1) > self.max_prefill_tokens:
                    break
                group.append(self.waiting.popleft())
        if not group:
            return
        from transformers import DynamicCache

        ids, mask, pos = left_padded([s.prompt for s in group], self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.forward([s.adapter for s in group], input_ids=ids, attention_mask=mask, position_ids=pos,
                              cache=cache, use_cache=True, logits_to_keep=1)
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
        logits = self.forward([s.adapter for s in self.running], input_ids=ids, attention_mask=mask,
                              position_ids=pos, cache=self.batch.cache, use_cache=True)
        self.steps += 1
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
            chunk = self._advance(seq, step.token_ids[i], step.logprobs[i], step.top[i])
            self._send(seq, [chunk])

    def _advance(self, seq: Sequence, tok: int, lp: float, top: list[tuple[int, float]]) -> GenerationChunk:
        """Account one sampled token to ``seq``; return the chunk to stream."""
        p = seq.params
        seq.num_generated += 1
        seq.next_token = tok
        want_lp = p.logprobs
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            text, matched = seq.stopper.feed(seq.detok.flush())
            if matched is None:
                text += seq.stopper.flush()
            seq.finished = True
            reason = matched if matched is not None else (tok if tok in p.stop_token_ids else None)
            return GenerationChunk([], text, [] if want_lp else None, "stop", reason)
        token_lp = [TokenLogprob(tok, lp, top)] if want_lp else None
        text, matched = seq.stopper.feed(seq.detok.push(tok))
        if matched is None and seq.num_generated >= p.max_tokens:
            more, matched = seq.stopper.feed(seq.detok.flush())
            text += more
            if matched is None:
                text += seq.stopper.flush()
                seq.finished = True
                return GenerationChunk([tok], text, token_lp, "length", None)
        if matched is not None:
            seq.finished = True
            return GenerationChunk([tok], text, token_lp, "stop", matched)
        return GenerationChunk([tok], text, token_lp)

    # ----- commands (run on this thread between steps) ----------------------------------
    def score(self, token_ids: list[int], adapter: str | None, top_k: int) -> list[TokenLogprob | None]:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.forward([adapter], input_ids=ids, use_cache=False)
        chosen, tops = prompt_logprobs(logits[0], ids[0], top_k)
        return [None] + [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids[1:], chosen, tops)]

    def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA directory as adapter ``name``; on failure nothing changes."""
        from peft import PeftConfig, PeftModel
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        try:
            config = PeftConfig.from_pretrained(path)
            weights = load_peft_weights(path, device=self.device)
        except Exception as exc:
            raise BadRequestError(f"cannot read adapter at {path}: {exc}", param="path") from exc
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise BadRequestError(f"adapter at {path} is {config.peft_type}; only LoRA adapters are served",
                                  param="path")
        config.inference_mode = True
        created = self.peft is None
        try:
            if created:
                self.peft = PeftModel(self.model, config, adapter_name=name)
                self.peft.eval()
            else:
                self.peft.add_adapter(name, config)
            result = set_peft_model_state_dict(self.peft, weights, adapter_name=name)
            missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{name}." in k]
            if missing:
                raise BadRequestError(f"adapter at {path} lacks weights for {len(missing)} LoRA tensors, "
                                      f"e.g. {missing[0]}", param="path")
        except Exception as exc:
            self._remove_adapter(name, created)
            if isinstance(exc, LiveloraError):
                raise
            raise BadRequestError(f"adapter at {path} does not fit this base model: {exc}", param="path") from exc
        self.lora_enabled = True
        self._set_lora(False)

    def _remove_adapter(self, name: str, last: bool) -> None:
        if self.peft is None:
            return
        if last:
            self.peft.base_model.unload()  # removes every LoRA layer; self.model is the plain model again
            self.peft = None
            self.lora_enabled = True
        elif name in self.peft.peft_config:
            self.peft.delete_adapter(name)

    def unload_adapter(self, name: str) -> None:
        """Remove adapter ``name``; :class:`ConflictError` while a live sequence uses it."""
        users = [s for s in list(self.running) + list(self.waiting)
                 if s.adapter == name and not (s.cancelled or s.finished)]
        if users:
            raise ConflictError(f"adapter {name!r} is in use by {len(users)} running or queued sequences",
                                param="name")
        if self.peft is None or name not in self.peft.peft_config:
            return
        self._remove_adapter(name, last=len(self.peft.peft_config) == 1)
