"""The online training backend: turns a scheduled batch into one optimizer step and one new adapter version.

Per lineage one :class:`~livelora.trainer.model.TrainingModel` is kept in memory.
It starts from the lineage's newest stored version (weights and, when saved,
AdamW state) or, for a new lineage, from a fresh adapter (``lora_B = 0``, so
version 1's parent is the base model). Each step is ``forward_backward`` +
``optim_step`` + ``save_state``, so every update is a new immutable version
``<lineage>@<n+1>`` whose manifest names its parent ``n``.

Datums (Tinker alignment: input ``tokens[:-1]``, targets ``tokens[1:]``,
``weights`` 1 on completion targets, 0 on the prompt):

* rating → ``kto`` datum (``label`` 1 = thumbs up/desirable, 0 = down), built from the
  **exact served token ids** in the event (plus the end-of-turn token the engine sampled but does not
  report, for replies that ended with ``stop``); ``loss_fn_config`` carries the batch's
  class weights λ_D/λ_U and β. The reference model is the base model (adapter
  disabled), computed by the TrainingModel (TRL's choice for a LoRA policy,
  ../shared/reference/losses.md §1).
* demonstration → ``cross_entropy`` datum: prompt = chat template of all but the
  last message with the generation prompt; completion = the rest of the
  template's rendering of the whole conversation (the reply and its end-of-turn
  tokens), so the model also learns to stop.
* preference → two ``dpo`` datums (chosen, rejected), from served token ids or
  from the chat template for the inline form.

Hyperparameters are the trainer's :class:`~livelora.trainer.settings.TrainingSection` (losses.md §5/§6:
LoRA LR ≈ 10× the full-FT guidance, KTO/DPO β = 0.1).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from livelora.adapters.models import BaseModelRef, load_tokenizer
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import BadRequestError
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.clients.types.tinker import AdamParams, Datum, ModelInput, TensorData
from livelora.trainer.scheduler import Batch
from livelora.trainer.settings import TrainingSection

log = logging.getLogger(__name__)


def completion_datum(prompt_ids: list[int], completion_ids: list[int],
                     extra: dict[str, TensorData] | None = None) -> Datum:
    """A datum over ``prompt + completion`` whose weights select the completion targets.

    Shapes: ``model_input`` N = P + C − 1 tokens; ``target_tokens`` and ``weights`` (N,).

    Raises:
        BadRequestError: empty prompt or empty completion.
    """
    if not prompt_ids or not completion_ids:
        raise BadRequestError("a training example needs a non-empty prompt and a non-empty completion",
                              param="completion")
    tokens = list(prompt_ids) + list(completion_ids)
    n = len(tokens) - 1
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(completion_ids)
    inputs = {"target_tokens": TensorData.from_list(tokens[1:], "int64"),
              "weights": TensorData.from_list(weights, "float32")}
    assert len(weights) == n
    inputs.update(extra or {})
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


class OnlineTrainer:
    """Implements :class:`~livelora.trainer.worker.TrainingBackend` with real TrainingModels.

    Args:
        base_ref: the base model every lineage is trained on.
        home: ``LIVELORA_HOME`` (adapter store).
        config: hyperparameters (``lora``, ``kto_lr``, ``sft_lr``, ``dpo_lr``, ``beta``, ``grad_clip_norm``,
            ``save_optimizer``, ``device``); default: the environment's.
    """

    def __init__(self, base_ref: BaseModelRef, home: Path | str, config: TrainingSection | None = None):
        self.base_ref = base_ref
        self.store = AdapterStore(home)
        self.config = config or TrainingSection()
        self._tokenizer = None
        self._models: dict[str, Any] = {}
        self._fresh = None  # a TrainingModel built ahead by warm_up(), taken by the next lineage model_for() needs

    def warm_up(self) -> None:
        """Load the tokenizer and build one TrainingModel (base weights, LoRA layers of ``config.lora``) ahead of
        time, so that the first update of a lineage does not pay for them (about 2 s of a first KTO step of
        ~10 s on the 2-core CPU). :meth:`model_for` takes it for a new lineage, or loads a stored version
        into it when the shapes agree. Idempotent."""
        from livelora.trainer.model import TrainingModel

        _ = self.tokenizer
        if self._fresh is None:
            self._fresh = TrainingModel(self.base_ref, self.config.lora, device=self.config.device)

    @property
    def tokenizer(self):
        """The base model's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.base_ref)
        return self._tokenizer

    def model_for(self, lineage: str):
        """The lineage's TrainingModel, resumed from its newest version if any."""
        from livelora.trainer.model import TrainingModel

        model = self._models.get(lineage)
        if model is None:
            versions = self.store.list(lineage)
            fresh, self._fresh = self._fresh, None
            if versions:
                latest = versions[-1]
                if fresh is not None:
                    try:  # load_state checks everything before it changes the model
                        fresh.load_state(self.store, lineage, latest.version, with_optimizer=latest.has_optimizer)
                        model = fresh
                    except BadRequestError:  # another LoRA shape: build one like the version below
                        pass
                if model is None:
                    model = TrainingModel.from_version(self.base_ref, self.store, lineage, latest.version,
                                                       with_optimizer=latest.has_optimizer,
                                                       device=self.config.device)
            else:
                model = fresh or TrainingModel(self.base_ref, self.config.lora, device=self.config.device)
            self._models[lineage] = model
        return model

    # ------------------------------------------------------------------ tokenization

    def _template(self, messages: list[ChatMessage], generation_prompt: bool) -> list[int]:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_pair(self, prompt: list[ChatMessage], reply: str) -> tuple[list[int], list[int]]:
        """``(prompt_ids, completion_ids)`` of a reply to ``prompt`` under the chat template
        (the completion includes the template's end-of-turn tokens)."""
        prompt_ids = self._template(prompt, True)
        full = self._template([*prompt, ChatMessage(role="assistant", content=reply)], False)
        if full[:len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
            return prompt_ids, full[len(prompt_ids):]
        eos = self.tokenizer.eos_token_id
        return prompt_ids, list(self.tokenizer.encode(reply, add_special_tokens=False)) + (
            [eos] if eos is not None else [])

    # ------------------------------------------------------------------ batches → datums

    def rated_completion(self, ev: RatingEvent) -> list[int]:
        """The completion ids a rating trains on: the served ids, plus the tokenizer's end-of-turn (EOS) id
        when the reply ended with ``finish_reason == "stop"`` (the engine samples that token but does not
        report it), so a rating also judges where the reply stopped; ``length`` replies stay as served."""
        ids = list(ev.completion_token_ids)
        eos = self.tokenizer.eos_token_id
        if ev.finish_reason == "stop" and eos is not None and (not ids or ids[-1] != eos):
            ids.append(int(eos))
        return ids

    def datums(self, batch: Batch) -> tuple[list[Datum], str, dict[str, float], float]:
        """``(datums, loss_fn, loss_fn_config, learning_rate)`` for one batch.

        Raises:
            BadRequestError: an event cannot become a training example (e.g. empty completion).
        """
        c = self.config
        if batch.kind == "kto":
            data = []
            for ev in batch.events:
                assert isinstance(ev, RatingEvent)
                data.append(completion_datum(ev.prompt_token_ids, self.rated_completion(ev), {
                    "label": TensorData.from_list([1.0 if ev.rating else 0.0], "float32")}))
            cfg = {"beta": c.beta, "desirable_weight": batch.desirable_weight,
                   "undesirable_weight": batch.undesirable_weight}
            return data, "kto", cfg, c.kto_lr
        if batch.kind == "sft":
            data = []
            for ev in batch.events:
                assert isinstance(ev, DemonstrationEvent)
                data.append(completion_datum(*self.chat_pair(ev.messages[:-1], ev.messages[-1].content)))
            return data, "cross_entropy", {}, c.sft_lr
        data = []
        for ev in batch.events:
            assert isinstance(ev, PreferenceEvent)
            if ev.prompt_token_ids is not None:
                prompt, chosen, rejected = ev.prompt_token_ids, ev.chosen_token_ids, ev.rejected_token_ids
            else:
                prompt, chosen = self.chat_pair(ev.messages, ev.chosen)
                _, rejected = self.chat_pair(ev.messages, ev.rejected)
            data += [completion_datum(prompt, chosen), completion_datum(prompt, rejected)]
        return data, "dpo", {"beta": c.beta}, c.dpo_lr

    # ------------------------------------------------------------------ one step

    def train(self, batch: Batch) -> Manifest:
        """One optimizer step on ``batch`` and one new version of ``batch.lineage``.

        Returns:
            The new version's manifest (``parent`` = the version trained from, ``metrics`` = the step's
            loss metrics, ``grad_norm``, ``update_norm``, the class weights and the event count).

        Raises:
            BadRequestError: bad data (nothing changes in the model: validation runs before the step).
        """
        data, loss_fn, cfg, lr = self.datums(batch)
        model = self.model_for(batch.lineage)
        try:
            out = model.forward_backward(data, loss_fn, cfg)
            opt = model.optim_step(AdamParams(learning_rate=lr, grad_clip_norm=self.config.grad_clip_norm,
                                              eps=1e-8))
        except BaseException:
            model.zero_grad()
            raise
        metrics = {**out.metrics, **opt, "events:sum": float(len(batch.events))}
        if loss_fn == "kto":
            metrics.update({"desirable_weight:mean": batch.desirable_weight,
                            "undesirable_weight:mean": batch.undesirable_weight})
        save = model.save_state if self.config.save_optimizer else model.save_weights
        manifest = save(self.store, batch.lineage, metrics=metrics)
        log.info("%s: %s step on %d events, loss %.4f", manifest.name, loss_fn, len(batch.events),
                 metrics.get("loss:sum", float("nan")))
        return manifest

    def path_of(self, manifest: Manifest) -> Path:
        """Directory of a version."""
        return self.store.version_dir(manifest.lineage, manifest.version)
