"""Door checks of signals: what the trainer would refuse is refused at the door, with a 400.

A signal answered 2xx is trained unless something only the trainer can know goes wrong. Demonstrations,
preferences and ratings are checked with the trainer's own tokenization (:mod:`livelora.core.chat_tokens`)
against the base model's context (a datum's ``model_input`` is ``prompt + completion − 1`` tokens); a failure is a
:class:`~livelora.clients.errors.ContextLengthExceededError` stating the limit and the counts, or a
``BadRequestError``, and nothing is queued. What each signal must fit: ``docs/internals/live-training.md``.
"""

from __future__ import annotations

import threading

from livelora.clients.errors import BadRequestError, ContextLengthExceededError
from livelora.clients.types.signals import DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.core.chat_tokens import chat_pair, datum_length, rated_completion_ids


class SignalChecker:
    """Checks a signal event before it is queued (``SignalService(check_event=SignalChecker(...).check)``).

    Checks run on worker threads, one at a time (a lock): a Hugging Face tokenizer sets a flag on its shared Rust
    tokenizer for each ``encode`` call, so give the checker a tokenizer of its own, not the one the gateway's
    event loop encodes prompts with.

    Args:
        tokenizer: the base model's tokenizer (the trainer loads the same one), used only by this checker.
        max_tokens: the trainer's context length in tokens
            (:func:`livelora.core.chat_tokens.model_context_length`).
    """

    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self._lock = threading.Lock()

    def _fits(self, what: str, prompt: list[int], completion: list[int], param: str, fix: str) -> None:
        n = datum_length(prompt, completion)
        if n > self.max_tokens:
            raise ContextLengthExceededError(
                f"The trainer's maximum context length is {self.max_tokens} tokens. However, this {what} is {n} "
                f"tokens once tokenized as the trainer will ({len(prompt)} in the prompt, {len(completion)} in the "
                f"reply, less the last one, which is only a target). Please {fix}.",
                param=param,
            )

    def check(self, event: RatingEvent | PreferenceEvent | DemonstrationEvent) -> None:
        """Raise if ``event`` cannot be trained.

        Raises:
            ContextLengthExceededError: too long for the trainer's context (param: the field to shorten).
            BadRequestError: a rated completion with nothing to learn from; a message the chat template
                cannot render.
        """
        with self._lock:
            self._check(event)

    def _check(self, event: RatingEvent | PreferenceEvent | DemonstrationEvent) -> None:
        if isinstance(event, DemonstrationEvent):
            conv = [{"role": m.role, "content": m.content} for m in event.messages]
            prompt, reply = chat_pair(self.tokenizer, conv[:-1], conv[-1]["content"])
            self._fits("demonstration", prompt, reply, "messages", "shorten the messages")
        elif isinstance(event, PreferenceEvent):
            if event.messages is not None:
                conv = [{"role": m.role, "content": m.content} for m in event.messages]
                for name in ("chosen", "rejected"):
                    prompt, reply = chat_pair(self.tokenizer, conv, getattr(event, name))
                    self._fits("preference", prompt, reply, name, f"shorten the messages or {name}")
            else:
                for name in ("chosen", "rejected"):
                    self._fits(
                        "preference",
                        list(event.prompt_token_ids or []),
                        list(getattr(event, f"{name}_token_ids") or []),
                        f"{name}_completion_id",
                        "rate shorter completions",
                    )
        elif isinstance(event, RatingEvent):
            completion = rated_completion_ids(self.tokenizer, event.completion_token_ids, event.finish_reason)
            if not completion:
                raise BadRequestError(
                    f"completion {event.completion_id!r} has no tokens to learn from", param="completion_id"
                )
            self._fits(
                "rated completion",
                list(event.prompt_token_ids),
                completion,
                "completion_id",
                "rate a shorter completion",
            )
