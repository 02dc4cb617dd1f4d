"""The one policy for the fields of a chat or legacy completion request: honoured, accepted without effect, or
refused with a 400 naming the field.

Every field the request types declare is honoured (some only at a neutral value: :data:`NEUTRAL_ONLY`); the
OpenAI fields that change nothing livelora serves are accepted (:data:`NO_EFFECT`); OpenAI and vLLM fields it
cannot honour are refused (:data:`REFUSED`); any other field is refused as OpenAI does (``unknown_parameter``),
unless ``LIVELORA_UNKNOWN_FIELDS=ignore``, which ignores it and names it in the ``X-Livelora-Ignored-Fields``
response header. The table as users read it: ``docs/clients.md``.
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import BadRequestError, UnsupportedParameterError

#: Response header naming the unknown fields a request carried (``LIVELORA_UNKNOWN_FIELDS=ignore``).
IGNORED_HEADER = "X-Livelora-Ignored-Fields"

#: Declared fields every engine honours, per route; a value one cannot honour (`tools`, `suffix`, ...) is a 400
#: naming the field (:mod:`.plans`).
HONOURED: dict[str, frozenset[str]] = {
    "chat": frozenset(
        {
            *("model", "messages", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options"),
            *("max_completion_tokens", "max_tokens", "logprobs", "top_logprobs", "logit_bias", "response_format"),
            *("tools", "tool_choice", "functions"),
            *("top_k", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output"),
            *("skip_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"),
            *("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"),
        }
    ),
    "completions": frozenset(
        {
            *("model", "prompt", "n", "temperature", "top_p", "seed", "stop", "stream", "stream_options"),
            *("max_tokens", "echo", "logprobs", "logit_bias", "suffix", "best_of"),
            *("top_k", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output"),
            *("skip_special_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"),
        }
    ),
}

#: OpenAI fields that change nothing livelora serves: accepted with any value (name → why).
NO_EFFECT: dict[str, str] = {
    "user": "kept in the completion log; changes no output",
    "metadata": "not stored (completions are not stored for the OpenAI dashboard)",
    "store": "the same",
    "service_tier": "one tier",
    "safety_identifier": "no moderation",
    "prompt_cache_key": "prompt caching is automatic",
    "prompt_cache_retention": "the same",
    "reasoning_effort": "the served model does not reason separately",
    "verbosity": "the same",
    "parallel_tool_calls": "tools are refused",
}

#: Declared fields served only at one value (name → (values served, why)); another value is a 400.
NEUTRAL_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "modalities": ((["text"],), "only the 'text' modality is supported"),
}

#: OpenAI and vLLM fields that cannot be honoured: refused whenever given (not null) (name → why).
REFUSED: dict[str, str] = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "function_call": "functions are not supported: the served model's chat template has no tool-calling format",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "best_of_n": "not supported",
    "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "guided_json": "output cannot be constrained",
    "guided_regex": "output cannot be constrained",
    "guided_choice": "output cannot be constrained",
    "guided_grammar": "output cannot be constrained",
    "guided_decoding_backend": "output cannot be constrained",
    "structured_outputs": "output cannot be constrained",
    "prompt_logprobs": "use /v1/completions with echo and logprobs",
    "truncate_prompt_tokens": "prompts are never truncated",
    "spaces_between_special_tokens": "not supported",
    "return_tokens_as_token_ids": "not supported",
    "return_token_ids": "not supported",
    "documents": "not supported",
    "chat_template": "the served model's own chat template is used",
    "mm_processor_kwargs": "the served model reads text only",
    "priority": "requests are admitted in order",
    "logits_processors": "not supported",
    "add_special_tokens": "not supported",
    "cache_salt": "not supported",
    "vllm_xargs": "not supported",
    "kv_transfer_params": "not supported",
    "echo": "echo is a parameter of /v1/completions only",
    "response_format": "output cannot be constrained to a format on /v1/completions",
    "max_completion_tokens": "it is not a parameter of /v1/completions; use max_tokens",
    "top_logprobs": "on /v1/completions, logprobs is the number of alternatives",
}

#: ``chat_template_kwargs`` keys the gateway sets itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict"}
)


def check_fields(body: Any, *, ignore_unknown: bool) -> list[str]:
    """Refuse what a chat or legacy completion request cannot have; return the unknown fields ignored.

    Args:
        body: a :class:`~livelora.clients.types.openai.ChatCompletionRequest` or ``CompletionRequest``.
        ignore_unknown: ignore unknown fields (``LIVELORA_UNKNOWN_FIELDS=ignore``) instead of refusing them.

    Raises:
        UnsupportedParameterError: a field of :data:`REFUSED`, or of :data:`NEUTRAL_ONLY` at another value.
        BadRequestError: an unknown field (code ``unknown_parameter``), unless ``ignore_unknown``.
    """
    extra = body.model_extra or {}
    for name, (served, why) in NEUTRAL_ONLY.items():
        value = getattr(body, name, None) if name in type(body).model_fields else extra.get(name)
        if value is not None and value not in served:
            raise UnsupportedParameterError(why, param=name)
    if body.logit_bias:
        raise UnsupportedParameterError("logit_bias is not supported by this server; omit it", param="logit_bias")
    unknown = []
    for name, value in extra.items():
        if name in NO_EFFECT or name in NEUTRAL_ONLY:
            continue
        if name in REFUSED:
            if value is not None:
                raise UnsupportedParameterError(f"{name} cannot be honoured: {REFUSED[name]}", param=name)
            continue
        unknown.append(name)
    if unknown and not ignore_unknown:
        raise BadRequestError(
            f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
        )
    return sorted(unknown)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as variables for the template. Raises: BadRequestError naming a reserved key."""
    kwargs = dict(kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise BadRequestError(
            f"chat_template_kwargs may not set {clash[0]!r} (use the request field of that name)",
            param="chat_template_kwargs",
        )
    return kwargs
