"""Chat messages → token ids, with control tokens only where the chat template puts them.

Used by every path that turns chat text into ids (the gateway's prompts, its door checks of signals, the
trainer's datums: :func:`render_chat`, :func:`chat_pair`), so the ids a version is trained on are the ids the
gateway would serve for the same conversation. The template is rendered twice, with the real contents and with
a placeholder per message; control tokens are parsed only where the template wrote them, and the text between
them is encoded with :func:`~livelora.clients.tokens.encode_text`. For ordinary content the ids equal a plain
``encode(apply_chat_template(...))``. One tokenizer object must not encode from two threads at once. Why, and
what happens with templates that transform content: ``docs/internals/tokens.md``.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Mapping, Sequence

from livelora.clients.errors import BadRequestError
from livelora.clients.tokens import encode_text
from livelora.core.control_tokens import control_pattern, control_tokens, find_control_text

Conversation = Sequence[Mapping[str, str]]


def _template(tokenizer, conversation: Conversation, add_generation_prompt: bool, options: Mapping) -> str:
    return tokenizer.apply_chat_template(
        [dict(m) for m in conversation], add_generation_prompt=add_generation_prompt, tokenize=False, **options
    )


def render_chat(
    tokenizer,
    conversation: Conversation,
    *,
    add_generation_prompt: bool,
    param: str = "messages",
    continue_final_message: bool = False,
    template_kwargs: Mapping | None = None,
) -> list[int]:
    """Token ids of ``conversation`` under the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        conversation: ``[{"role": str, "content": str}, ...]`` (content is plain text).
        add_generation_prompt: end with the template's assistant header (a prompt to answer).
        param: the request field named in errors.
        continue_final_message: end right after the final message's content (no end of turn), so a reply
            continues it (transformers' ``continue_final_message``, as vLLM).
        template_kwargs: extra variables for the template (vLLM's ``chat_template_kwargs``).

    Returns:
        Token ids, shape ``(T,)``; control tokens only from the template.

    Raises:
        BadRequestError: no chat template, the template cannot render the conversation (param ``param``), or
            a message holds control-token text under a template that rewrites content and the installed
            transformers cannot sanitize it (``param[i].content``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequestError("the served model has no chat template; use /v1/completions", param=param)
    messages = [dict(m) for m in conversation]
    options = dict(template_kwargs or {})
    if continue_final_message:
        options["continue_final_message"] = True
    try:
        real = _template(tokenizer, messages, add_generation_prompt, options)
    except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates, TypeError
        raise BadRequestError(f"the model's chat template cannot render these messages: {exc}", param=param) from exc
    ids = _segmented(tokenizer, messages, add_generation_prompt, real, options)
    if ids is not None:
        return ids
    for i, m in enumerate(messages):
        found = find_control_text(tokenizer, str(m.get("content") or ""))
        if found is None:
            continue
        if "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters:
            out = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                sanitize_control_tokens=True,
                **options,
            )
            return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]
        raise BadRequestError(
            f"message {i} contains the control-token text {found!r}, and this model's chat template rewrites "
            "message content, so it cannot be kept as plain text; remove it",
            param=f"{param}[{i}].content",
        )
    return list(tokenizer.encode(real, add_special_tokens=False))


def _segmented(
    tokenizer, conversation: list[dict], add_generation_prompt: bool, real: str, options: Mapping
) -> list[int] | None:
    """The ids by the placeholder method, or ``None`` when the template does not copy contents verbatim. With
    ``continue_final_message`` the skeleton ends right after the final message's placeholder."""
    options = dict(options)
    cut = options.pop("continue_final_message", False)
    contents = [str(m.get("content") or "") for m in conversation]
    nonce = secrets.token_hex(8)
    marks = [f"@@livelora{nonce}x{i}@@" for i in range(len(conversation))]
    try:
        skeleton = _template(
            tokenizer, [{**m, "content": mark} for m, mark in zip(conversation, marks)], add_generation_prompt, options
        )
    except Exception:  # a template that inspects content: fall back
        return None
    if not contents or any(skeleton.count(mark) != 1 for mark in marks):
        return None
    if cut:
        skeleton = skeleton[: skeleton.index(marks[-1]) + len(marks[-1])]
    pieces: list[tuple[bool, str]] = []  # (is_content, text)
    rest = skeleton
    order = sorted(range(len(marks)), key=lambda i: skeleton.index(marks[i]))
    for i in order:
        before, _, rest = rest.partition(marks[i])
        pieces += [(False, before), (True, contents[i])]
    pieces.append((False, rest))
    if "".join(text for _, text in pieces) != real:
        return None
    return _encode_pieces(tokenizer, pieces)


def _encode_pieces(tokenizer, pieces: list[tuple[bool, str]]) -> list[int]:
    """Control tokens parsed in template pieces only; every text run between them encoded as plain text.
    An added token's ``lstrip``/``rstrip`` flags eat the whitespace next to it, as the tokenizer does."""
    controls = control_tokens(tokenizer)
    pattern = control_pattern(tokenizer)
    flags = {str(t): t for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    ids: list[int] = []
    run = ""
    strip_next = False

    def add_text(text: str) -> None:
        nonlocal run, strip_next
        if strip_next:
            text = text.lstrip()
            strip_next = not text
        run += text

    for is_content, text in pieces:
        if is_content or pattern is None:
            add_text(text)
            continue
        pos = 0
        for match in pattern.finditer(text):
            add_text(text[pos : match.start()])
            token = flags.get(match.group(0))
            if getattr(token, "lstrip", False):
                run = run.rstrip()
            ids += encode_text(tokenizer, run)
            run = ""
            ids.append(controls[match.group(0)])
            strip_next = bool(getattr(token, "rstrip", False))
            pos = match.end()
        add_text(text[pos:])
    ids += encode_text(tokenizer, run)
    return ids


def chat_pair(tokenizer, prompt: Conversation, reply: str, param: str = "messages") -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of an assistant ``reply`` to ``prompt`` (what a demonstration or an
    inline preference trains on).

    ``prompt_ids`` is the template's rendering of ``prompt`` with the generation prompt; ``completion_ids`` is
    the rest of the rendering of ``prompt + [reply]`` (the reply and the template's end-of-turn tokens), when
    the first is a prefix of the second; otherwise the reply's plain-text ids plus the EOS token.

    Raises:
        BadRequestError: as :func:`render_chat`.
    """
    prompt_ids = render_chat(tokenizer, prompt, add_generation_prompt=True, param=param)
    full = render_chat(
        tokenizer, [*prompt, {"role": "assistant", "content": reply}], add_generation_prompt=False, param=param
    )
    if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
        return prompt_ids, full[len(prompt_ids) :]
    eos = tokenizer.eos_token_id
    return prompt_ids, encode_text(tokenizer, reply) + ([int(eos)] if eos is not None else [])


def rated_completion_ids(tokenizer, completion_ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The completion ids a rating trains on: the served ids, plus the tokenizer's end-of-turn (EOS) id when the
    reply ended with ``finish_reason == "stop"`` (the engine samples that token but does not report it), so a
    rating also judges where the reply stopped; ``length`` replies stay as served. Shape ``(C,)`` or ``(C+1,)``."""
    ids = [int(t) for t in completion_ids]
    eos = tokenizer.eos_token_id
    if finish_reason == "stop" and eos is not None and (not ids or ids[-1] != eos):
        ids.append(int(eos))
    return ids


def datum_length(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> int:
    """Tokens of the trainer's ``model_input`` for a prompt + completion datum (Tinker alignment: the last
    token is only a target): ``P + C − 1``."""
    return len(prompt_ids) + len(completion_ids) - 1


def model_context_length(ref) -> int:
    """:func:`training_context_length` of a resolved base model (``core.base_models.BaseModelRef``): reads its
    ``config.json`` (local) or the transformers config (hub id)."""
    if ref.is_local:
        import json
        from pathlib import Path

        return training_context_length(json.loads((Path(ref.path) / "config.json").read_text()))
    from transformers import AutoConfig

    return training_context_length(AutoConfig.from_pretrained(ref.path))


def training_context_length(config: Mapping | object) -> int:
    """The trainer's limit on a datum's ``model_input`` (tokens): the base model config's
    ``max_position_embeddings`` (2048 when absent), as ``TrainingModel.max_seq_len`` defaults to.

    Args:
        config: a transformers ``PretrainedConfig`` or the ``config.json`` mapping.
    """
    value = (
        config.get("max_position_embeddings")
        if isinstance(config, Mapping)
        else getattr(config, "max_position_embeddings", None)
    )
    return int(value or 2048)
