"""The worker thread of :class:`~.transformers_engine.TransformersEngine`: continuous batching.

One thread owns the model. Its loop, repeated while there is work:

1. run queued commands (adapter load/unload, :meth:`score`) *between* forward
   passes (before admitting, between prefill groups, before decoding), so they
   never disturb a forward pass of running sequences and wait at most one pass;
2. drop cancelled sequences from the batch (their KV rows are freed);
3. admit waiting sequences up to ``max_batch_size``: prefill them in groups of
   similar prompt length (left-padded, one forward per group, shortest first;
   :func:`prefill_groups`), sample their first token, and merge their KV cache
   rows into the running :class:`~.kv_batch.KVBatch`;
4. one decode step for every running sequence: feed each row's last token,
   sample the next one for all rows at once (:func:`~.sampling.sample_batch`),
   stream the chunks, and drop finished rows.

Adapters: rows of one batch may use different adapters (or the base model).
Every LoRA ``Linear`` layer computes each row's own update in one stacked pass
(:class:`MixedRows`: two matmuls per layer whatever the number of versions;
base rows get none), so a batch needs no peft state switch. peft's own
forward (``adapter_names=``, active adapter, disabled layers) remains for what
the stacked pass does not cover: DoRA, LoRA bias, LoRA on embeddings, or rows
of versions with different LoRA shapes in one batch. With no adapter loaded at
all the plain transformers model is called.

Adapter versions live in **LoRA slots** (peft adapters named ``livelora_slot_<n>``).
A version's name maps to its slot; unloading a version frees its slot, and the
next version of the same shape is copied into a free slot in place, which takes
milliseconds where peft's ``add_adapter`` takes a fifth of a second. A slot is
only overwritten when no queued or running sequence uses the version it held
(unloading refuses otherwise), so version names are never served with another
version's weights.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from livelora.adapters.models import MODEL_BUILD_LOCK
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
        self.admitting: list[Sequence] = []  # taken from waiting, not yet prefilled
        self.commands: collections.deque[Callable[[], None]] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.lora_enabled = True
        #: adapter version name -> the LoRA slot holding its weights; free slots await the next version
        self.versions: dict[str, LoraSlot] = {}
        self.free_slots: list[LoraSlot] = []
        self._slot_counter = 0
        self.active_slot: str | None = None  # peft's active adapter, for single-version batches
        self.mixed_rows: MixedRows | None = None  # set during a batched mixed-version forward
        #: slot names of a mixed batch -> {id(LoRA module): (A, B) stacks}; see MixedRows
        self.stacks: dict[tuple[str, ...], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.lora_linear_only = True  # every LoRA layer is a peft lora.Linear (else no batched path)
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
                        self.admitting = self.admitting[len(group):]
                        self._run_commands()
                if self.running:
                    with torch.inference_mode():
                        self._decode_step()
            except Exception as exc:  # a fault of ours: fail every running sequence, keep serving
                log.exception("engine step failed")
                err = exc if isinstance(exc, LiveloraError) else InternalError(f"engine step failed: {exc}")
                for s in self.running + [s for group in groups for s in group]:  # admitted ones too
                    self._finish_with_error(s, err)
                self.running, self.batch, self.admitting = [], KVBatch(), []
        self._abort_all()

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
        slots = [self.versions[a] if a is not None else None for a in adapters]
        rows = self._batched_rows(slots)
        if rows is not None:  # every LoRA layer serves each row its own version (see MixedRows)
            self.mixed_rows = rows
            try:
                return self.model(**kw).logits
            finally:
                self.mixed_rows = None
        # peft's own paths: DoRA, LoRA bias, LoRA on non-Linear layers, or versions of several shapes
        if all(a is None for a in adapters):
            self._set_lora(False)
            return self.model(**kw).logits
        self._set_lora(True)
        if len(set(adapters)) == 1:
            self._activate(slots[0].name)
            return self.model(**kw).logits
        names = [s.name if s is not None else BASE_ADAPTER for s in slots]
        return self.peft(adapter_names=names, **kw).logits

    def _activate(self, slot: str) -> None:
        """Make ``slot`` peft's active adapter (used by forwards without ``adapter_names``)."""
        if self.active_slot != slot:
            self.peft.base_model.set_adapter(slot, inference_mode=True)
            self.active_slot = slot

    def _batched_rows(self, slots: list[LoraSlot | None]) -> MixedRows | None:
        """The :class:`MixedRows` of a batch, or ``None`` when peft's own forward must run (versions of
        different shapes, DoRA or LoRA bias, or LoRA on layers other than ``nn.Linear``)."""
        used = list(dict.fromkeys(s for s in slots if s is not None))
        if not self.lora_linear_only or not all(s.batchable for s in used) or \
                len({s.signature for s in used}) > 1:
            return None
        key = tuple(s.name for s in used)
        stacks = self.stacks.pop(key, None)
        if stacks is None:
            stacks = {}
            while len(self.stacks) >= MAX_STACK_SETS:
                self.stacks.pop(next(iter(self.stacks)))
        self.stacks[key] = stacks  # most recently used last
        position = {s.name: i for i, s in enumerate(used)}
        return MixedRows(key, [position[s.name] if s is not None else -1 for s in slots], stacks)

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

    def load_adapter(self, name: str, config, weights: dict[str, torch.Tensor], source: str,
                     canary: list[int] | None = None) -> list[TokenLogprob | None] | None:
        """Install adapter version ``name`` (a peft ``LoraConfig`` and its state dict, read by the caller)
        into a LoRA slot; with ``canary``, score those tokens on it in the same pause of the decode loop.

        A free slot of the same shape (:func:`slot_signature`) has its tensors overwritten in place (a few
        milliseconds); otherwise a new slot is created with peft ``add_adapter`` (about 0.2 s on CPU for
        SmolLM2 at rank 16 on every linear layer), and a spare one is prepared :data:`SPARE_DELAY_S`
        later so the next version finds it free.

        Returns:
            :meth:`score` of ``canary`` on the new version, or ``None`` without ``canary``.

        Raises:
            BadRequestError: not a LoRA config, or the weights do not fit (missing tensors, wrong shapes);
                nothing changes.
        """
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise BadRequestError(f"adapter at {source} is {config.peft_type}; only LoRA adapters are served",
                                  param="path")
        config.inference_mode = True
        signature = slot_signature(config)
        slot = next((s for s in self.free_slots if s.signature == signature), None)
        if slot is not None:
            self.free_slots.remove(slot)
        else:
            slot = self._new_slot(config, signature, source)
        try:
            self._fill(slot, weights, source)
        except Exception as exc:
            self.free_slots.append(slot)  # its contents are garbage, but no version maps to it
            if isinstance(exc, LiveloraError):
                raise
            raise BadRequestError(f"adapter at {source} does not fit this base model: {exc}", param="path") from exc
        self.versions[name] = slot
        if not any(s.signature == signature for s in self.free_slots):  # later: not while the swap is served
            timer = threading.Timer(SPARE_DELAY_S, self.call, args=(lambda: self._prepare_spare(config, signature),))
            timer.daemon = True
            timer.start()
        if canary is None:
            return None
        try:
            return self.score(canary, name, 0)
        except BaseException:
            self.unload_adapter(name)
            raise

    def _new_slot(self, config, signature: str, source: str) -> LoraSlot:
        from peft import PeftModel

        slot = LoraSlot(f"{SLOT_PREFIX}{self._slot_counter}", signature)
        self._slot_counter += 1
        created = self.peft is None
        t0 = time.perf_counter()
        try:
            with MODEL_BUILD_LOCK:  # another thread may be loading a model (see the lock's doc)
                if created:
                    self.peft = PeftModel(self.model, config, adapter_name=slot.name)
                    self.peft.eval()
                else:
                    self.peft.add_adapter(slot.name, config)
        except Exception as exc:
            self._delete_slot(slot)
            raise BadRequestError(f"adapter at {source} does not fit this base model: {exc}", param="path") from exc
        self.lora_enabled = True
        self._set_lora(False)
        self.active_slot = None  # peft may have changed its active adapter
        slot.batchable = not getattr(config, "use_dora", False) and not getattr(config, "lora_bias", False)
        self._patch_lora_layers()
        self.stacks.clear()
        log.info("created LoRA slot %s in %.3f s (%d slots, %d free)", slot.name, time.perf_counter() - t0,
                 len(self.versions) + len(self.free_slots) + 1, len(self.free_slots))
        return slot

    def _patch_lora_layers(self) -> None:
        """Route every peft LoRA ``Linear`` through :func:`_lora_linear_forward` (once per layer)."""
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.peft.modules():
            if isinstance(module, LoraLinear):
                if not getattr(module, "_livelora_patched", False):
                    module.forward = functools.partial(_lora_linear_forward, self, module, module.forward)
                    module._livelora_patched = True
            elif isinstance(module, BaseTunerLayer):
                self.lora_linear_only = False

    def _prepare_spare(self, config, signature: str) -> None:
        """Create one free slot of ``signature`` unless one is free already or no loaded version has that shape
        any more (runs between forward passes, :data:`SPARE_DELAY_S` after a load)."""
        if any(s.signature == signature for s in self.free_slots) or \
                not any(v.signature == signature for v in self.versions.values()):
            return
        try:
            self.free_slots.append(self._new_slot(config, signature, "spare slot"))
        except LiveloraError as exc:  # only an optimisation: the next load creates its slot itself
            log.warning("could not prepare a spare LoRA slot: %s", exc)

    def _fill(self, slot: LoraSlot, weights: dict[str, torch.Tensor], source: str) -> None:
        """Copy ``weights`` (keys as peft saves them, without the adapter name) into ``slot``'s tensors."""
        from peft.utils import set_peft_model_state_dict

        for key in [k for k in self.stacks if slot.name in k]:  # they hold copies of this slot's tensors
            del self.stacks[key]

        if slot.params is None:
            marker = f".{slot.name}."
            slot.params = {n.replace(marker, "."): p for n, p in self.peft.named_parameters() if marker in n}
        if weights.keys() == slot.params.keys():
            for key, tensor in weights.items():
                target = slot.params[key]
                if tensor.shape != target.shape:
                    raise BadRequestError(f"adapter at {source}: tensor {key} has shape {tuple(tensor.shape)}, "
                                          f"this base model needs {tuple(target.shape)}", param="path")
            for key, tensor in weights.items():
                slot.params[key].copy_(tensor)
            return
        # other key spellings (older peft versions, other tools): peft's own loader maps them
        result = set_peft_model_state_dict(self.peft, weights, adapter_name=slot.name)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{slot.name}." in k]
        if missing:
            raise BadRequestError(f"adapter at {source} lacks weights for {len(missing)} LoRA tensors, "
                                  f"e.g. {missing[0].replace(f'.{slot.name}.', '.')}", param="path")

    def _delete_slot(self, slot: LoraSlot) -> None:
        self.active_slot = None  # peft may change its active adapter
        self.stacks.clear()
        if self.peft is None or slot.name not in self.peft.peft_config:
            return
        if len(self.peft.peft_config) == 1:
            self.peft.base_model.unload()  # removes every LoRA layer; self.model is the plain model again
            self.peft = None
            self.lora_enabled = True
            self.lora_linear_only = True
        else:
            with warnings.catch_warnings():  # "adapter ... was active which is now deleted": we never use active
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(slot.name)

    def unload_adapter(self, name: str) -> None:
        """Remove adapter version ``name``; :class:`ConflictError` while a live sequence uses it.

        Its slot becomes free for the next version of the same shape; at most :data:`MAX_FREE_SLOTS`
        free slots per shape are kept, and when no version is loaded at all the LoRA layers are removed
        (the plain model serves again at full speed).
        """
        users = [s for s in list(self.running) + list(self.waiting) + self.admitting
                 if s.adapter == name and not (s.cancelled or s.finished)]
        if users:
            raise ConflictError(f"adapter {name!r} is in use by {len(users)} running or queued sequences",
                                param="name")
        slot = self.versions.pop(name, None)
        if slot is None:
            return
        self.free_slots.append(slot)
        same = [s for s in self.free_slots if s.signature == slot.signature]
        extra = same if not self.versions else same[:-MAX_FREE_SLOTS]
        for s in extra:
            self.free_slots.remove(s)
            self._delete_slot(s)


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


#: peft adapter names of the worker's LoRA slots are this prefix plus a counter (never a version name).
SLOT_PREFIX = "livelora_slot_"
#: Seconds after a load before a spare slot is created (a pause of decoding of ~0.2 s on CPU), so that it
#: does not delay the first requests on the version just installed.
SPARE_DELAY_S = 2.0
#: Free slots kept per shape for the next versions (a new slot costs a peft ``add_adapter``, a slot of
#: rank 16 on every linear layer of SmolLM2-135M holds 9 MB in float32).
MAX_FREE_SLOTS = 4
#: LoraConfig fields that do not change the LoRA modules' shapes or forward at inference.
_SIGNATURE_IGNORES = {"base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
                      "lora_dropout", "peft_version", "auto_mapping", "task_type"}


def slot_signature(config) -> str:
    """A key equal for two LoRA configs whose adapters have the same modules, ranks and scalings, so one's
    weights can be copied into the other's slot (canonical JSON of the config minus :data:`_SIGNATURE_IGNORES`)."""
    def canon(value):
        if isinstance(value, (set, frozenset)):
            return sorted(canon(v) for v in value)
        if isinstance(value, (list, tuple)):
            return [canon(v) for v in value]
        if isinstance(value, dict):
            return {str(k): canon(v) for k, v in value.items()}
        if hasattr(value, "value"):  # enums
            return value.value
        return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)

    fields = {k: canon(v) for k, v in config.to_dict().items() if k not in _SIGNATURE_IGNORES}
    return json.dumps(fields, sort_keys=True)


@dataclass(eq=False)
class LoraSlot:
    """One peft adapter inside the served model, reused by successive adapter versions of one shape.

    Attributes:
        name: the peft adapter name (:data:`SLOT_PREFIX` + n); never exposed as a version name.
        signature: :func:`slot_signature` of the config it was created with.
        params: saved-key → parameter map for in-place copies, built on first fill.
        batchable: plain LoRA (no DoRA, no LoRA bias), so :class:`MixedRows` can serve it.
    """

    name: str
    signature: str
    params: dict[str, torch.nn.Parameter] | None = None
    batchable: bool = True  # plain LoRA (no DoRA, no LoRA bias): MixedRows can serve it


#: Stack sets kept, one per set of versions seen together in a batch (each holds a copy of their LoRA
#: weights: 9 MB per version of rank 16 on SmolLM2-135M).
MAX_STACK_SETS = 8


class MixedRows:
    """A batch's rows and their versions (several, one, or only the base model), served in one pass per
    LoRA layer.

    peft's mixed-batch forward loops over the versions present in every layer (index the rows, two small
    matmuls, scatter back: about 5 operations per version per layer), and switching its active adapter
    or enabling/disabling its LoRA layers walks every module (20-25 ms on SmolLM2). Here the U versions' factors are
    concatenated along the rank, ``A = [A_1; …; A_U]`` of shape ``(Σr, d_in)`` and
    ``B = [s_1 B_1ᵀ; …; s_U B_Uᵀ]`` of shape ``(Σr, d_out)`` (``s_u`` = the version's LoRA scaling), and a
    0/1 mask ``M`` of shape ``(rows, 1, Σr)`` keeps each row's own block, so that for row b on version u

        y_b = W x_b + ((x_b Aᵀ) ⊙ M_b) B = W x_b + s_u B_u A_u x_b,

    the LoRA update of Hu et al. (2021), eq. 3; base rows have an all-zero mask. Two matmuls per layer
    whatever U is (the idea of S-LoRA / Punica's batched LoRA kernels, in plain torch). Stacks are built
    on first use per set of versions and dropped whenever a slot's weights change.

    Attributes:
        key: the slot names, in mask order.
        rows: per batch row, the index of its version in ``key`` or -1 for the base model.
        stacks: ``id(module) -> (A, B)`` for this ``key`` (shared across forwards, filled lazily).
    """

    def __init__(self, key: tuple[str, ...], rows: list[int], stacks: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.key, self.rows, self.stacks = key, rows, stacks
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def layer(self, module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(A, B, mask)`` of one LoRA layer for this batch, or ``None`` if no version adapts it."""
        if not self.key:  # every row on the base model
            return None
        entry = self.stacks.get(id(module))
        if entry is None:
            if not all(name in module.lora_A for name in self.key):
                return None
            with torch.no_grad():
                a = torch.cat([module.lora_A[n].weight for n in self.key], 0)
                b = torch.cat([module.lora_B[n].weight.t() * module.scaling[n] for n in self.key], 0)
            entry = self.stacks[id(module)] = (a, b)
        widths = tuple(module.lora_A[n].weight.shape[0] for n in self.key)
        mask = self._masks.get(widths)
        if mask is None:
            a = entry[0]
            mask = torch.zeros(len(self.rows), 1, a.shape[0], dtype=a.dtype, device=a.device)
            starts = [sum(widths[:i]) for i in range(len(widths))]
            for row, u in enumerate(self.rows):
                if u >= 0:
                    mask[row, 0, starts[u]:starts[u] + widths[u]] = 1
            self._masks[widths] = mask
        return entry[0], entry[1], mask


def _lora_linear_forward(worker: Worker, module, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Forward of a peft LoRA ``Linear``: peft's own, except during a :class:`MixedRows` pass.

    Shapes: ``x`` ``(rows, T, d_in)`` → ``(rows, T, d_out)``.
    """
    rows = worker.mixed_rows
    if rows is None:
        return peft_forward(x, *args, **kwargs)
    result = module.base_layer(x, *args, **kwargs)
    layer = rows.layer(module)
    if layer is None:
        return result
    a, b, mask = layer
    return result + (((x.to(a.dtype) @ a.t()) * mask) @ b).to(result.dtype)
