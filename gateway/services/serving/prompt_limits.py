"""Cheap limits on a prompt before it is tokenized, and tokenization off the event loop.

**Which prompts are certainly too long.** A token of the vocabulary stands for at most ``L`` bytes of text,
``L`` = the longest token decoded alone, in UTF-8 bytes (81 for SmolLM2: a newline and 80 spaces; a partial
UTF-8 character decodes to U+FFFD, 3 bytes, so ``L`` only errs high). When the tokenizer keeps every byte of its
input (byte-level BPE, SentencePiece with byte fallback: checked once on a probe text, ``decode(encode(probe))
== probe``), a text of ``B`` bytes needs at least ``ceil(B / L)`` tokens, and the chat template only adds
tokens. So a prompt whose messages hold more than ``L × (context length − max_tokens)`` bytes cannot fit and
is refused (400 ``context_length_exceeded``) before any tokenization; anything smaller is tokenized (in a worker
thread) and checked exactly. A tokenizer that fails the probe (it normalizes or drops text) gets no early bound.
The request body limit (``LIVELORA_MAX_BODY_BYTES``) bounds the bytes tokenized in any case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import anyio.to_thread

from livelora.clients.errors import ContextLengthExceededError

T = TypeVar("T")

_PROBE = "a  b\n\n\t  c é ﬁ e\u0301 日本語 <|im_start|> ==== \u00a0x\r\n"
_BOUNDS: dict[int, int | None] = {}


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the worker-thread pool (tokenization and other CPU-heavy request work)."""
    return await anyio.to_thread.run_sync(fn, *args)


def max_token_bytes(tokenizer) -> int | None:
    """``L`` of the module docstring (bytes), or ``None`` when the tokenizer is not lossless on the probe.
    Computed once per tokenizer (about 0.4 s for a 49k vocabulary: call it off the event loop)."""
    key = id(tokenizer)
    if key not in _BOUNDS:
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        if tokenizer.decode(ids, clean_up_tokenization_spaces=False) != _PROBE:
            _BOUNDS[key] = None
        else:
            pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
            _BOUNDS[key] = max(len(p.encode("utf-8")) for p in pieces)
    return _BOUNDS[key]


def fewest_tokens(tokenizer, texts: Iterable[str]) -> int:
    """A lower bound on the tokens of ``texts`` (0 when the tokenizer gives none), without tokenizing."""
    bound = _BOUNDS.get(id(tokenizer))
    if not bound:
        return 0
    return sum(math.ceil(len(t.encode("utf-8")) / bound) for t in texts)


async def check_prompt_size(
    tokenizer,
    texts: Iterable[str],
    context_length: int,
    max_tokens: int | None,
    *,
    param: str = "messages",
    tokens_param: str = "max_tokens",
) -> None:
    """Refuse a prompt that cannot fit the context window, from its size alone (see the module docstring).

    Args:
        texts: the prompt's texts (message contents, or text prompts). context_length: tokens.
        max_tokens: the request's completion budget (``None``: at least 1 token).

    Raises:
        ContextLengthExceededError: at least ``context_length`` tokens are needed (400, ``param``).
    """
    if id(tokenizer) not in _BOUNDS:
        await off_loop(max_token_bytes, tokenizer)
    texts = list(texts)
    least = fewest_tokens(tokenizer, texts)
    completion = max_tokens if max_tokens is not None else 1
    if least and least + completion > context_length:
        fault = param if least >= context_length or max_tokens is None else tokens_param
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, your {param} hold "
            f"{sum(len(t.encode('utf-8')) for t in texts)} bytes, which is at least {least} tokens (a token is at "
            f"most {_BOUNDS[id(tokenizer)]} bytes), and {completion} more in the completion. Please reduce the "
            f"length of the {param}" + (f" or of {tokens_param}." if max_tokens is not None else "."),
            param=fault,
        )


async def chat_prompt(body, serving, payer: tuple[str, str | None]) -> tuple[list[int], int | None]:
    """The cheap limits of a chat request, then its prompt rendered and tokenized in a worker thread.

    Args:
        body: the :class:`~livelora.clients.types.openai.ChatCompletionRequest`.
        serving: the :class:`~livelora.gateway.services.serving.serve.Serving` service.
        payer: ``(tenant, API key id)`` of the caller.

    Returns:
        ``(prompt token ids, largest default budget per choice or None)`` (see
        :meth:`~livelora.gateway.services.serving.admission.Admission.check_request`).

    Raises:
        BadRequestError: a per-tenant ceiling (``max_n``, ``max_n_tokens``), or non-text content.
        RateLimitError: the tenant's completion log is full (``max_completion_log_bytes``).
        ContextLengthExceededError: the messages are certainly too long (:func:`check_prompt_size`).
    """
    from livelora.gateway.chat_template import message_text, render_request

    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    context = serving.context_length()  # a budget beyond the window is the context check's to refuse
    cap = serving.admission.check_request(body.n, _within(requested, context), payer, tokens_param=param)
    await check_log_room(serving, payer[0])
    if requested is None or requested < context:  # else the exact check names the numbers
        texts = (message_text(m, i) for i, m in enumerate(body.messages))
        await check_prompt_size(serving.tokenizer, texts, context, requested, tokens_param=param)
    return await off_loop(render_request, serving.tokenizer, body), cap


async def completion_prompts(
    body, serving, tokenize: Callable[..., list[list[int]]], payer: tuple[str, str | None]
) -> tuple[list, int | None]:
    """The cheap limits of a legacy completion request, then ``tokenize(body, tokenizer)`` in a worker thread.

    Returns:
        ``(token ids per prompt, largest default budget per choice or None)``.

    Raises:
        BadRequestError: a per-tenant ceiling (prompts × ``n`` against ``max_n``; ``max_n_tokens``).
        RateLimitError: the tenant's completion log is full (``max_completion_log_bytes``).
        ContextLengthExceededError: a text prompt is certainly too long (:func:`check_prompt_size`).
    """
    raw = body.prompt
    prompts = [raw] if isinstance(raw, str) or (raw and all(isinstance(x, int) for x in raw)) else list(raw or [])
    context = serving.context_length()
    cap = serving.admission.check_request(max(len(prompts), 1) * body.n, _within(body.max_tokens, context), payer)
    await check_log_room(serving, payer[0])
    if body.max_tokens is None or body.max_tokens < context:
        for text in prompts:
            if isinstance(text, str):
                await check_prompt_size(serving.tokenizer, [text], context, body.max_tokens, param="prompt")
    return await off_loop(tokenize, body, serving.tokenizer), cap


def _within(max_tokens: int | None, context: int) -> int | None:
    """``max_tokens`` as the per-tenant ceiling counts it: never more than the context window (tokens)."""
    return None if max_tokens is None else min(max_tokens, context)


async def check_log_room(serving, tenant: str) -> None:
    """Refuse (429) a request the completion log would keep when the caller's tenant has used its
    ``max_completion_log_bytes`` (:meth:`~livelora.gateway.services.live.completion_log.CompletionLog.check_room`)."""
    if serving.completions is not None:
        await serving.completions.check_room(tenant, serving.admission.limits(tenant).max_completion_log_bytes)
