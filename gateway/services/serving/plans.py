"""What a chat or legacy completion request asks of the engine: its checks, prompts, token budget and jobs.

:func:`plan_chat` and :func:`plan_completion` turn a request into a :class:`Plan` (one engine job per choice),
raising a 400 naming ``param`` for what cannot be honoured; :meth:`~.serving.Serving.serve` runs them once the
``model`` is resolved, so an unknown model is reported before bad parameters. Which fields are honoured, accepted
without effect or refused: :mod:`.request_fields`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, UnsupportedParameterError
from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest
from livelora.gateway.chat_template import render_request
from livelora.gateway.engines.base import SamplingParams
from livelora.gateway.services.serving.generation import Job
from livelora.gateway.services.serving.request_fields import check_fields, check_template_kwargs
from livelora.gateway.services.serving.token_texts import TokenTexts

log = logging.getLogger(__name__)

#: The requests that sample: the sampling fields they share are all this module reads besides their own.
SamplingRequest = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class Plan:
    """A request's engine jobs.

    Attributes:
        jobs: one per choice, ``per_prompt`` consecutive jobs per prompt.
        per_prompt: choices per prompt (``n``).
        score_prompts: score each prompt's logprobs with this many alternatives before generating (an echoed
            prompt with ``logprobs``); ``None``: no scoring.
        generate: ``False`` for an echo with ``max_tokens: 0`` (the prompt and its logprobs only, as vLLM).
    """

    jobs: list[Job]
    per_prompt: int = 1
    score_prompts: int | None = None
    generate: bool = True


def check_common(body: SamplingRequest, ignore_unknown: bool = False) -> list[str]:
    """Reject fields that cannot be honoured (:func:`~.request_fields.check_fields`); return the unknown fields
    ignored (``ignore_unknown``).

    Raises:
        UnsupportedParameterError, BadRequestError: see :func:`~.request_fields.check_fields`.
    """
    ignored = check_fields(body, ignore_unknown=ignore_unknown)
    if ignored:
        log.info("ignoring unknown fields %s", ", ".join(ignored))
    return ignored


def budget(prompt_len: int, requested: int | None, param: str, max_len: int, prompt_param: str) -> int:
    """The completion-token budget (tokens).

    Args:
        prompt_len: prompt tokens.
        requested: the request's ``max_tokens`` / ``max_completion_tokens``, or ``None``
            (then everything left in the context window).
        param: name of the field ``requested`` came from.
        max_len: context window (prompt + completion tokens).
        prompt_param: field holding the prompt (``messages`` / ``prompt``).

    Raises:
        BadRequestError: ``requested < 1`` (code ``integer_below_min_value``).
        ContextLengthExceededError: the prompt leaves no room, or prompt + requested > ``max_len``
            (contract A03/A04/A11, with the real numbers).
    """
    if requested is not None and requested < 1:
        raise BadRequestError(
            f"{param} must be at least 1, got {requested}", param=param, code="integer_below_min_value"
        )
    completion = requested if requested is not None else max(max_len - prompt_len, 0)
    if prompt_len >= max_len or prompt_len + completion > max_len:
        fault = prompt_param if prompt_len >= max_len or requested is None else param
        asked = f"{completion} in the completion" if requested is not None else "at least 1 in the completion"
        total = prompt_len + max(completion, 1)
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_len} tokens. However, you requested {total} tokens "
            f"({prompt_len} in the {prompt_param}, {asked}). Please reduce the length of the "
            f"{prompt_param} or of {param}.",
            param=fault,
        )
    return completion


def sampling_params(
    body: SamplingRequest, max_tokens: int, choice: int, *, logprobs: bool = False, top_logprobs: int = 0
) -> SamplingParams:
    """Engine parameters for choice ``choice``; its seed is ``seed + choice`` (``None`` if unseeded)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # only the most likely token survives: greedy
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=body.top_k or 0,
        seed=None if body.seed is None else body.seed + choice,
        stop=body.stop_tuple(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_tokens=body.min_tokens or 0,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        min_p=body.min_p or 0.0,
    )


# ------------------------------------------------------------------------------------------------ chat
def check_chat(body: ChatCompletionRequest, ignore_unknown: bool = False) -> list[str]:
    """Reject chat parameters that cannot be honoured (400 naming ``param``); return the unknown fields ignored.

    Raises:
        BadRequestError: both max-token fields, ``top_logprobs`` without ``logprobs``, an unknown field,
            ``continue_final_message`` without a final assistant message or with ``add_generation_prompt``.
        UnsupportedParameterError: ``tools``/``functions``, ``tool_choice`` other than ``none``,
            ``response_format`` other than ``text``, what :mod:`.request_fields` refuses.
    """
    ignored = check_common(body, ignore_unknown)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise BadRequestError(
            "set only one of max_tokens and max_completion_tokens (max_tokens is deprecated)",
            param="max_tokens",
            code="invalid_parameter_combination",
        )
    if body.tools:
        raise UnsupportedParameterError(
            "tools are not supported: the served model's chat template has no tool-calling format", param="tools"
        )
    if body.functions:
        raise UnsupportedParameterError(
            "functions are not supported: the served model's chat template has no tool-calling format",
            param="functions",
        )
    if body.tool_choice not in (None, "none"):
        raise UnsupportedParameterError(
            "tool_choice is only allowed as 'none' (tools are not supported)", param="tool_choice"
        )
    if body.response_format is not None and body.response_format.type != "text":
        raise UnsupportedParameterError(
            f"response_format {body.response_format.type!r} is not supported: "
            "output cannot be constrained to JSON; use type 'text'",
            param="response_format",
        )
    if body.top_logprobs and not body.logprobs:
        raise BadRequestError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_parameter_combination"
        )
    if body.continue_final_message:
        if body.messages[-1].role != "assistant":
            raise BadRequestError(
                "continue_final_message needs a final assistant message to continue", param="continue_final_message"
            )
        if body.add_generation_prompt:
            raise BadRequestError(
                "continue_final_message and add_generation_prompt cannot both be true (send add_generation_prompt: "
                "false)",
                param="continue_final_message",
                code="invalid_parameter_combination",
            )
    check_template_kwargs(body.chat_template_kwargs)
    return ignored


def plan_chat(
    body: ChatCompletionRequest, tokenizer, max_len: int, prompt: list[int] | None = None, cap: int | None = None
) -> Plan:
    """The request's ``n`` engine jobs: one rendered prompt, one seed per choice (``seed + i``); ``max_len`` is
    the context window (tokens). ``prompt``: the messages already rendered
    (:func:`~livelora.gateway.services.serving.prompt_limits.chat_prompt`); ``cap``: the largest default budget per
    choice when no max-token field is set (the tenant's ``max_n_tokens``).

    The caller has run :func:`check_chat` (before the cheap prompt limits).

    Raises:
        ContextLengthExceededError: the prompt and the token budget do not fit the context window.
    """
    prompt = render_request(tokenizer, body) if prompt is None else prompt
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = budget(len(prompt), requested, param, max_len, "messages")
    if requested is None and cap is not None:
        max_tokens = min(max_tokens, cap)
    # logprobs are always computed: the completion log keeps them (responses only carry them on request)
    jobs = [
        Job(prompt, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=body.top_logprobs or 0))
        for i in range(body.n)
    ]
    return Plan(jobs, per_prompt=body.n)


# ------------------------------------------------------------------------------------------------ completions
def check_completion(body: CompletionRequest, ignore_unknown: bool = False) -> list[str]:
    """Reject parameters of the legacy route that cannot be honoured (400 naming ``param``); return the unknown
    fields ignored."""
    ignored = check_common(body, ignore_unknown)
    if body.suffix:
        raise UnsupportedParameterError("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise UnsupportedParameterError(
            "best_of other than n is not supported (choices are not re-ranked)", param="best_of"
        )
    return ignored


def prompt_token_ids(body: CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token-id lists, each shape ``(T,)`` with ``T >= 1``. A text prompt is encoded
    as the model's raw input (control-token text parsed, the tokenizer's BOS added if it adds one), as vLLM does.

    Raises:
        BadRequestError: an empty prompt or a token id outside the vocabulary (param ``prompt``).
    """
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise BadRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    vocab = len(tokenizer)
    prompts = []
    for i, item in enumerate(raw):
        ids = list(tokenizer.encode(item)) if isinstance(item, str) else list(item)
        if not ids:
            raise BadRequestError(f"prompt {i} is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(
                f"prompt {i} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="prompt"
            )
        prompts.append(ids)
    return prompts


def prompt_texts(body: CompletionRequest, prompts: list[list[int]], texts: TokenTexts) -> list[str]:
    """The text of each prompt of :func:`prompt_token_ids`: as sent for a text prompt, decoded from the
    token ids (:meth:`TokenTexts.decode`) for a token-id prompt. ``len(result) == len(prompts)``."""
    raw = body.prompt
    items = [raw] if isinstance(raw, str) or all(isinstance(x, int) for x in raw) else list(raw)
    return [item if isinstance(item, str) else texts.decode(ids) for item, ids in zip(items, prompts)]


def plan_completion(
    body: CompletionRequest,
    tokenizer,
    max_len: int,
    texts: TokenTexts,
    prompts: list[list[int]] | None = None,
    cap: int | None = None,
) -> Plan:
    """The request's engine jobs: ``n`` per prompt, choice ``k = prompt_index * n + i`` seeded ``seed + i``; each
    job keeps its prompt's text for the completion log. An echoed prompt with ``logprobs`` is scored first.
    ``prompts``: already tokenized; ``cap``: the largest default budget per choice when ``max_tokens`` is unset.
    ``echo`` with ``max_tokens: 0`` generates nothing (:attr:`Plan.generate`). The caller has run
    :func:`check_completion`.

    Raises:
        BadRequestError, UnsupportedParameterError: see :func:`check_completion`, :func:`prompt_token_ids`.
        ContextLengthExceededError: a prompt and the token budget do not fit the context window.
    """
    prompts = prompt_token_ids(body, tokenizer) if prompts is None else prompts
    generate = not (body.echo and body.max_tokens == 0)
    jobs = []
    for ids, text in zip(prompts, prompt_texts(body, prompts, texts)):
        if not generate:  # echo only: the jobs name the prompts, nothing runs
            jobs += [Job(ids, sampling_params(body, 0, i), text) for i in range(body.n)]
            continue
        max_tokens = budget(len(ids), body.max_tokens, "max_tokens", max_len, "prompt")
        if body.max_tokens is None and cap is not None:
            max_tokens = min(max_tokens, cap)
        # logprobs are always computed: the completion log keeps them (responses only carry them on request)
        jobs += [
            Job(ids, sampling_params(body, max_tokens, i, logprobs=True, top_logprobs=body.logprobs or 0), text)
            for i in range(body.n)
        ]
    score = (body.logprobs or 0) if body.echo and body.logprobs is not None else None
    return Plan(jobs, per_prompt=body.n, score_prompts=score, generate=generate)
