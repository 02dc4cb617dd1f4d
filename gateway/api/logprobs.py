"""Logprobs in the chat and the legacy completions layouts, with each token's text and exact bytes
(:class:`~livelora.gateway.services.token_texts.TokenTexts`)."""

from __future__ import annotations

from livelora.clients.types.openai import ChatCompletionTokenLogprob, CompletionLogprobs, TopLogprob
from livelora.gateway.engines.base import TokenLogprob
from livelora.gateway.services.token_texts import TokenTexts

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs"]


def chat_logprobs(texts: TokenTexts, items: list[TokenLogprob], top_n: int) -> list[ChatCompletionTokenLogprob]:
    """Chat layout: one ``{token, logprob, bytes, top_logprobs: [...]}`` per generated token."""
    out = []
    for item in items:
        token, raw = texts.get(item.token_id)
        top = []
        for tid, lp in item.top[:top_n]:
            t, b = texts.get(tid)
            top.append(TopLogprob(token=t, logprob=lp, bytes=b))
        out.append(ChatCompletionTokenLogprob(token=token, logprob=item.logprob, bytes=raw, top_logprobs=top))
    return out


def completion_logprobs(
    texts: TokenTexts, items: list[TokenLogprob | None], token_ids: list[int], top_n: int, offset: int
) -> CompletionLogprobs:
    """Legacy layout: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    Args:
        items: one entry per id of ``token_ids``; ``None`` for a position without a logprob
            (the first echoed prompt token).
        offset: character offset of the first token in the returned ``text``.
    """
    out = CompletionLogprobs()
    for tid, item in zip(token_ids, items, strict=True):
        token, _ = texts.get(tid)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if item is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(item.logprob)
        top: dict[str, float] = {}
        for alt_id, lp in item.top[:top_n]:
            top.setdefault(texts.get(alt_id)[0], lp)
        out.top_logprobs.append(top if top_n else None)
    return out
