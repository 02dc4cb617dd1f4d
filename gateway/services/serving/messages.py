"""The Anthropic Messages API on the chat path: a Messages request is served as the chat request it asks for.

:func:`chat_request` turns a ``/v1/messages`` body into a :class:`~livelora.clients.types.openai.ChatCompletionRequest`
(system prompt first, consecutive turns of one role joined, ``stop_sequences`` as ``stop``, ``metadata.user_id``
as ``user``), so :meth:`~.serving.Serving.serve` plans, admits, records and meters it like a chat;
:func:`check_request` refuses what cannot be honoured (images, documents, tool use, extended thinking, prefill,
...) with a 400 naming it; :func:`stop_reason` maps how a generation ended to Anthropic's ``stop_reason``. What is
accepted and refused: ``docs/clients.md``.
"""

from __future__ import annotations

from livelora.clients.errors import BadRequestError, UnsupportedParameterError
from livelora.clients.types.anthropic import ContentBlockParam, CountTokensRequest, MessagesRequest, StopReason
from livelora.clients.types.openai import ChatCompletionRequest, ChatMessage
from livelora.core.control_tokens import control_tokens
from livelora.gateway.engines.base import GenerationChunk

#: Content block types refused, by what they are (any other non-text type: refused by its name).
_BLOCKS = {
    "image": "images",
    "document": "documents",
    "search_result": "search results",
    "tool_use": "tool use",
    "tool_result": "tool use",
    "server_tool_use": "server tools",
    "web_search_tool_result": "server tools",
    "thinking": "extended thinking",
    "redacted_thinking": "extended thinking",
    "container_upload": "code execution containers",
}
#: Top-level fields refused when set. Other unknown fields are accepted and change nothing, as on Anthropic's
#: API (docs/clients.md); the OpenAI routes refuse an unknown field unless LIVELORA_UNKNOWN_FIELDS=ignore
#: (:mod:`.request_fields`).
_FIELDS = {
    "mcp_servers": "MCP servers",
    "container": "code execution containers",
    "context_management": "context management",
    "output_config": "output configuration (structured outputs, effort)",
    "output_format": "structured outputs",
}


def _refuse(what: str, where: str) -> UnsupportedParameterError:
    return UnsupportedParameterError(
        f"{where}: this server does not support {what} (the served model reads and writes text only)", param=where
    )


def block_text(block: ContentBlockParam, where: str) -> str:
    """The text of one content block.

    Raises:
        UnsupportedParameterError: a block that is not ``text``, or a text block with citations (400 naming it).
        BadRequestError: a text block without a string ``text``.
    """
    if block.type != "text":
        raise _refuse(_BLOCKS.get(block.type, f"content blocks of type {block.type!r}"), where)
    if (block.model_extra or {}).get("citations"):
        raise _refuse("citations", f"{where}.citations")
    if not isinstance(block.text, str):
        raise BadRequestError(f"{where}: a text block needs a string 'text' field", param=where)
    return block.text


def _text(content: str | list[ContentBlockParam], where: str) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block_text(block, f"{where}[{j}]") for j, block in enumerate(content))


def check_request(body: MessagesRequest | CountTokensRequest) -> None:
    """Refuse the fields of ``body`` that cannot be honoured (content blocks are checked by :func:`chat_messages`).

    Raises:
        UnsupportedParameterError: ``tools``, a ``tool_choice`` other than ``none``, ``thinking`` other than
            ``disabled``, or a field of :data:`_FIELDS` (400 naming it).
    """
    if body.tools:
        raise _refuse("tool use", "tools")
    if body.tool_choice is not None and body.tool_choice.get("type") != "none":
        raise _refuse("tool use", "tool_choice")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise _refuse("extended thinking", "thinking")
    extra = body.model_extra or {}
    for name, what in _FIELDS.items():
        if extra.get(name):
            raise _refuse(what, name)


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[ChatMessage]:
    """The chat messages ``body`` asks to answer: the system prompt, then one message per run of turns of one role
    (Anthropic combines consecutive turns of a role into one; their texts are joined by ``"\\n"``, as the text
    blocks of one turn are).

    Raises:
        UnsupportedParameterError: a non-text block, or a final assistant turn (prefill, 400).
        BadRequestError: a text block without text.
    """
    check_request(body)
    out: list[ChatMessage] = []
    if body.system is not None:
        system = _text(body.system, "system")
        if system:
            out.append(ChatMessage(role="system", content=system))
    turns: list[tuple[str, list[str]]] = []
    for i, message in enumerate(body.messages):
        text = _text(message.content, f"messages[{i}].content")
        if turns and turns[-1][0] == message.role:
            turns[-1][1].append(text)
        else:
            turns.append((message.role, [text]))
    if turns[-1][0] == "assistant":
        raise UnsupportedParameterError(
            "messages: a final assistant turn (prefill, continuing the assistant's answer) is not supported by this "
            "server; end the messages with a user turn",
            param="messages",
        )
    out += [ChatMessage(role=role, content="\n".join(texts)) for role, texts in turns]
    return out


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request asks for (see the module docstring).

    Raises:
        UnsupportedParameterError, BadRequestError: see :func:`chat_messages`.
    """
    chat = ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stream=bool(body.stream),
        user=body.metadata.user_id if body.metadata is not None else None,
    )
    if body.stop_sequences:  # the Messages API has no cap of 4 (OpenAI's): set past the chat type's validator
        chat = chat.model_copy(update={"stop": list(body.stop_sequences)})
    return chat


def stop_reason(chunk: GenerationChunk, stops: list[str] | None, tokenizer) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` of a generation's final chunk: ``max_tokens`` for the token budget,
    ``stop_sequence`` (with the sequence) for a requested stop sequence (matched as text, or as the control token
    it names), else ``end_turn``."""
    if chunk.finish_reason == "length":
        return "max_tokens", None
    matched = chunk.stop_reason
    if isinstance(matched, int):
        controls = control_tokens(tokenizer)
        matched = next((s for s in stops or () if controls.get(s) == matched), None)
    if isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return "end_turn", None
