"""Chat rendering in the base model's own format, with loss masks that train only assistant tokens.

The format is the tokenizer's chat template (``apply_chat_template``, the template the gateway serves with),
so what a recipe trains is exactly what ``/v1/chat/completions`` later shows the model. For SmolLM2 that is
ChatML::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
                                                                              ^^^^^^^^^^^^^^^^^^^^ weight 1

An assistant turn's trained span is the text the template adds for that message after the generation prompt
(its content and the end-of-turn marker, trailing whitespace excluded); everything else has weight 0.
The template must render conversations as prefixes of each other (true of ChatML, Llama 3, Qwen, ...):
a template that rewrites earlier turns is refused with a clear error rather than mis-masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, str]


class TemplateError(ValueError):
    """The chat template cannot be split into per-message spans (not prefix-stable), or a message is invalid."""


class ChatRenderer:
    """Renders chat messages to token ids with per-token weights (1 = an assistant token to train).

    Args:
        tokenizer: a Hugging Face *fast* tokenizer with a chat template (offsets are needed for the masks).
        system_prompt: prepended as a ``system`` message when a conversation has none (None = leave the
            template's own default, e.g. SmolLM2's "You are a helpful AI assistant named SmolLM...").

    Raises:
        TemplateError: the tokenizer is not fast or has no chat template.
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError("ChatRenderer needs a fast tokenizer (character offsets give the loss mask)")
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; give the model's template or a chat model")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        eot = tokenizer.eos_token_id
        #: token ids that end an assistant turn (sampling stops there); the tokenizer's EOS.
        self.stop_token_ids: list[int] = [eot] if eot is not None else []

    def _messages(self, messages: Sequence[Message]) -> list[Message]:
        out = []
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("content"), str)
                or m.get("role") not in ("system", "user", "assistant")
            ):
                raise TemplateError(
                    f"messages[{i}] must be {{'role': system|user|assistant, 'content': str}}, got {m!r:.200}"
                )
            out.append({"role": m["role"], "content": m["content"]})
        if self.system_prompt is not None and (not out or out[0]["role"] != "system"):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    def _text(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what a sampler continues)."""
        text = self._text(self._messages(messages), True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def supervised(self, messages: Sequence[Message], train_on: str = "all_assistant") -> tuple[list[int], list[float]]:
        """Token ids of the whole conversation and one weight per token.

        Args:
            messages: ``[{"role", "content"}, ...]``, at least one assistant message.
            train_on: ``"all_assistant"`` (every assistant turn) or ``"last_assistant"``.

        Returns: ``(tokens_T, weights_T)``; ``weights_T[i] = 1.0`` when token i belongs to a trained
        assistant span (content + end-of-turn marker), else 0.0.

        Raises:
            TemplateError: no assistant message, an invalid message, or a template that is not prefix-stable.
        """
        msgs = self._messages(messages)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise TemplateError("a supervised example needs at least one assistant message")
        if train_on == "last_assistant":
            turns = turns[-1:]
        elif train_on != "all_assistant":
            raise TemplateError(f"train_on must be all_assistant or last_assistant, got {train_on!r}")
        full = self._text(msgs, False)
        spans = []
        for k in turns:
            before = self._text(msgs[:k], True)
            upto = self._text(msgs[: k + 1], False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise TemplateError(
                    "the chat template is not prefix-stable (it rewrites earlier turns); "
                    "assistant masks cannot be derived from it"
                )
            spans.append((len(before), len(upto.rstrip())))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        weights = []
        for start, end in enc["offset_mapping"]:
            weights.append(1.0 if any(a <= start < b for a, b in spans) and end > start else 0.0)
        return list(enc["input_ids"]), weights

    def completion_tokens(self, text: str) -> list[int]:
        """Token ids of an assistant reply as the template ends it (content + end-of-turn token)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.stop_token_ids

    def decode(self, tokens: Sequence[int]) -> str:
        """Reply text of sampled tokens (special tokens such as the end-of-turn marker dropped)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
