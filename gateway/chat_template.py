"""Render OpenAI chat messages to prompt token ids with the tokenizer's own chat template.

:func:`render_messages` maps the OpenAI message shapes to the ``{"role", "content"}`` a Hugging Face template
reads (``developer`` as ``system``, text parts joined with ``"\\n"``, past ``tool_calls`` as JSON text; a
non-text part is a 400 naming it) and renders them with :mod:`livelora.core.chat_tokens`, so control-token
look-alikes in content stay ordinary characters. The mapping in full: ``docs/internals/tokens.md``.
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


def render_request(tokenizer, body) -> list[int]:
    """Prompt token ids of a chat request (a :class:`~livelora.clients.types.openai.ChatCompletionRequest`), with
    its template extensions: ``add_generation_prompt`` (default true), ``continue_final_message``,
    ``chat_template_kwargs``. Raises: as :func:`render_messages`."""
    cont = bool(body.continue_final_message)
    add = body.add_generation_prompt if body.add_generation_prompt is not None else not cont
    return render_messages(
        tokenizer,
        body.messages,
        add_generation_prompt=add,
        continue_final_message=cont,
        template_kwargs=body.chat_template_kwargs,
    )


def render_messages(
    tokenizer,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Prompt token ids for ``messages``, ending with the assistant generation prompt (by default; or right after
    the final message with ``continue_final_message``).

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: the request's messages (non-empty).
        template_kwargs: extra template variables (``chat_template_kwargs``).

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
    return render_chat(
        tokenizer,
        conversation,
        add_generation_prompt=add_generation_prompt,
        param="messages",
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
