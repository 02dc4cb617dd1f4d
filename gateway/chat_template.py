"""Render OpenAI chat messages to prompt token ids with the tokenizer's own chat template.

Mapping from the OpenAI message shapes (contract §1.1) to what a Hugging Face
chat template reads (``{"role": str, "content": str}``):

* ``developer`` is rendered as ``system`` (it "replaces system" for newer models).
* ``content`` given as a list of parts is the concatenation of its ``text``
  parts joined with ``"\\n"`` (as vLLM does); an ``image_url``, ``input_audio``
  or ``file`` part is a 400 naming that part (text-only models).
* An ``assistant`` message with ``content: null`` and ``tool_calls`` (what
  LangChain sends for past tool-calling turns) is rendered with the calls as
  JSON text, one per line, since templates without tool support have no slot
  for them; ``content: ""`` is rendered as is.
* ``tool`` / ``function`` messages are passed with their role; a template that
  cannot render them raises, which becomes a 400 on ``messages``.
* A message-level ``name`` is accepted and not rendered (OpenAI uses it only to
  tell participants apart).
* Content is plain text: control-token look-alikes in it (``<|im_end|>``) stay
  ordinary characters, so the number of control tokens in a prompt depends only
  on its messages' roles and number (:mod:`livelora.core.chat_tokens`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
from livelora.clients.types.openai import ChatMessage
from livelora.core.chat_tokens import render_chat

_ROLE_MAP = {"developer": "system"}


def message_text(message: ChatMessage, index: int) -> str:
    """The text of one message's content.

    Raises:
        UnsupportedParameterError: a non-text content part (param ``messages[i].content[j]``).
    """
    content = message.content
    if content is None:
        calls = message.tool_calls or []
        return "\n".join(json.dumps(call.get("function", call), ensure_ascii=False) for call in calls)
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in ("text", "refusal"):
            text = part.text if part.type == "text" else (part.model_extra or {}).get("refusal")
            if not isinstance(text, str):
                raise BadRequestError(
                    f"content part of type {part.type!r} needs a string "
                    f"{'text' if part.type == 'text' else 'refusal'} field",
                    param=f"messages[{index}].content[{j}]",
                )
            texts.append(text)
        else:
            raise UnsupportedParameterError(
                f"content parts of type {part.type!r} are not supported: the served model reads text only",
                param=f"messages[{index}].content[{j}]",
            )
    return "\n".join(texts)


def render_messages(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Prompt token ids for ``messages``, ending with the assistant generation prompt.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: the request's messages (non-empty).

    Returns:
        Token ids, shape ``(T,)``; control tokens come from the template only, never from content.

    Raises:
        UnsupportedParameterError: non-text content.
        BadRequestError: no chat template, or the template cannot render the conversation (param
            ``messages``); control-token text in a message under a template that rewrites content
            (param ``messages[i].content``).
    """
    conversation = [
        {"role": _ROLE_MAP.get(m.role, m.role), "content": message_text(m, i)} for i, m in enumerate(messages)
    ]
    return render_chat(tokenizer, conversation, add_generation_prompt=True, param="messages")
