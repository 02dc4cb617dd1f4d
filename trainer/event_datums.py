"""Signal events → training datums under the base model's tokenizer and chat template
(:mod:`livelora.core.chat_tokens`): :class:`EventDatums` (part of :class:`~livelora.trainer.online.OnlineTrainer`)
and :func:`completion_datum`; :func:`rated_batch` builds the live loop's KTO batch of rated chat replies (the gate
tests and ``bench/gate_thresholds.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, LiveloraError
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.clients.types.tinker import Datum, ModelInput, TensorData
from livelora.core.base_models import BaseModelRef, load_tokenizer
from livelora.core.chat_tokens import chat_pair, rated_completion_ids
from livelora.trainer.scheduler import Batch, kto_class_weights
from livelora.trainer.settings import TrainingSection


def completion_datum(
    prompt_ids: list[int], completion_ids: list[int], extra: dict[str, TensorData] | None = None
) -> Datum:
    """A datum over ``prompt + completion`` whose weights select the completion targets.

    Shapes: ``model_input`` N = P + C − 1 tokens; ``target_tokens`` and ``weights`` (N,).

    Raises:
        BadRequestError: empty prompt or empty completion.
    """
    if not prompt_ids or not completion_ids:
        raise BadRequestError(
            "a training example needs a non-empty prompt and a non-empty completion", param="completion"
        )
    tokens = list(prompt_ids) + list(completion_ids)
    n = len(tokens) - 1
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(completion_ids)
    inputs = {
        "target_tokens": TensorData.from_list(tokens[1:], "int64"),
        "weights": TensorData.from_list(weights, "float32"),
    }
    assert len(weights) == n
    inputs.update(extra or {})
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


class EventDatums:
    """The datums each event trains on: a rating → ``kto`` (with its ``label``), a demonstration →
    ``cross_entropy``, a preference → two ``dpo`` datums; the loss and learning rate of a batch; the events that
    cannot be trained (:meth:`screen`).

    Args:
        base_ref: the base model (its tokenizer, loaded on first use).
        config: hyperparameters (``beta``, ``kto_lr``, ``sft_lr``, ``dpo_lr``).
    """

    def __init__(self, base_ref: BaseModelRef, config: TrainingSection):
        self.base_ref, self.config = base_ref, config
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The base model's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.base_ref)
        return self._tokenizer

    def chat_pair(self, prompt: list[ChatMessage], reply: str) -> tuple[list[int], list[int]]:
        """``(prompt_ids, completion_ids)`` of a reply to ``prompt`` under the chat template
        (the completion includes the template's end-of-turn tokens; see
        :func:`livelora.core.chat_tokens.chat_pair`)."""
        return chat_pair(self.tokenizer, [{"role": m.role, "content": m.content} for m in prompt], reply)

    # ------------------------------------------------------------------ batches → datums

    def rated_completion(self, ev: RatingEvent) -> list[int]:
        """The completion ids a rating trains on: the served ids, plus the tokenizer's end-of-turn (EOS) id
        when the reply ended with ``finish_reason == "stop"`` (:func:`livelora.core.chat_tokens.
        rated_completion_ids`, which the gateway's door check uses too)."""
        return rated_completion_ids(self.tokenizer, ev.completion_token_ids, ev.finish_reason)

    def event_datums(self, ev: RatingEvent | DemonstrationEvent | PreferenceEvent) -> list[Datum]:
        """The datums of one event: one for a rating (``kto``, with its ``label``) or a demonstration
        (``cross_entropy``), two for a preference (chosen, rejected).

        Raises:
            BadRequestError: the event cannot become a training example (e.g. empty completion).
        """
        if isinstance(ev, RatingEvent):
            return [
                completion_datum(
                    ev.prompt_token_ids,
                    self.rated_completion(ev),
                    {"label": TensorData.from_list([1.0 if ev.rating else 0.0], "float32")},
                )
            ]
        if isinstance(ev, DemonstrationEvent):
            return [completion_datum(*self.chat_pair(ev.messages[:-1], ev.messages[-1].content))]
        if ev.prompt_token_ids is not None:
            prompt, chosen, rejected = ev.prompt_token_ids, ev.chosen_token_ids, ev.rejected_token_ids
        else:
            prompt, chosen = self.chat_pair(ev.messages, ev.chosen)
            _, rejected = self.chat_pair(ev.messages, ev.rejected)
        return [completion_datum(prompt, chosen or []), completion_datum(prompt, rejected or [])]

    def screen(self, batch: Batch, max_seq_len: int, vocab_size: int) -> dict[int, str]:
        """The events of ``batch`` that cannot be trained, as ``{index in batch.events: reason}``.

        Each event is checked alone, as the step would check it: its datums can be built, every datum's
        ``model_input`` fits the model's context (``max_seq_len`` tokens, reason code
        ``context_length_exceeded``) and its input and target token ids lie in the vocabulary. The worker
        dead-letters these events alone and trains the rest of the batch.
        """
        bad: dict[int, str] = {}
        for i, ev in enumerate(batch.events):
            try:
                data = self.event_datums(ev)
                for datum in data:
                    tokens = datum.model_input.to_ints()
                    if len(tokens) > max_seq_len:
                        raise ContextLengthExceededError(
                            f"{len(tokens)} tokens exceed the trainer's context length of {max_seq_len}"
                        )
                    targets = datum.loss_fn_inputs["target_tokens"].data
                    out = next((t for t in (*tokens, *targets) if not 0 <= t < vocab_size), None)
                    if out is not None:
                        raise BadRequestError(f"token id {out} is outside the vocabulary [0, {vocab_size})")
            except LiveloraError as exc:
                if exc.category != "user":
                    raise
                bad[i] = f"{exc.code}: {exc.message}" if exc.code else exc.message
        return bad

    def datums(self, batch: Batch) -> tuple[list[Datum], str, dict[str, float], float]:
        """``(datums, loss_fn, loss_fn_config, learning_rate)`` for one batch (:meth:`event_datums` of each
        event, in order: datum ``i`` of a KTO/SFT batch is event ``i``; datums ``2i, 2i+1`` of a DPO batch).
        With ``batch.example_weights`` each KTO/DPO datum carries its event's weight as ``example_weight``.

        Raises:
            BadRequestError: an event cannot become a training example (e.g. empty completion).
        """
        c = self.config
        data = [d for ev in batch.events for d in self.event_datums(ev)]
        weights = getattr(batch, "example_weights", None)
        if weights is not None and batch.kind in ("kto", "dpo"):  # rater agreement (trainer/signal_governor.py)
            per = len(data) // max(len(batch.events), 1)
            for i, a in enumerate(weights):
                for d in data[i * per : (i + 1) * per]:
                    d.loss_fn_inputs["example_weight"] = TensorData.from_list([float(a)], "float32")
        if batch.kind == "kto":
            cfg = {
                "beta": c.beta,
                "desirable_weight": batch.desirable_weight,
                "undesirable_weight": batch.undesirable_weight,
            }
            return data, "kto", cfg, c.kto_lr
        if batch.kind == "sft":
            return data, "cross_entropy", {}, c.sft_lr
        return data, "dpo", {"beta": c.beta}, c.dpo_lr


def rated_batch(
    chat_pair: Callable[[list[ChatMessage], str], tuple[list[int], list[int]]],
    endpoint: str,
    rated: list[tuple[str, str, bool]],
    tag: str = "1",
) -> Batch:
    """A KTO batch of ``(question, reply, liked)`` ratings of one-turn chats, as the live loop logs and batches
    them: token ids by ``chat_pair`` (:meth:`EventDatums.chat_pair`) with the reply's last two template tokens
    cut (a served completion ends before them), stream ids ``{tag}-{i}``, the class weights of
    :func:`~livelora.trainer.scheduler.kto_class_weights`."""
    evs = []
    for i, (question, reply, up) in enumerate(rated):
        prompt, completion = chat_pair([ChatMessage(role="user", content=question)], reply)
        evs.append(
            RatingEvent(
                id=f"feedback-{uuid.uuid4().hex}",
                endpoint=endpoint,
                created=int(time.time()),
                completion_id=f"c{i}-{uuid.uuid4().hex[:6]}",
                prompt_token_ids=prompt,
                completion_token_ids=completion[:-2],
                finish_reason="stop",
                rating=up,
                rating_key=f"c{i}:/u",
                user="u",
            )
        )
    liked = sum(up for _q, _r, up in rated)
    batch = Batch(endpoint, "kto", evs, [f"{tag}-{i}" for i in range(len(rated))])
    batch.desirable_weight, batch.undesirable_weight = kto_class_weights(liked, len(rated) - liked)
    return batch
