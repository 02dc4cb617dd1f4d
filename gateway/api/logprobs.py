"""Logprobs in the chat and the legacy completions layouts, with each token's text and exact bytes
(:class:`~livelora.gateway.services.serving.token_texts.TokenTexts`).

Every generated token has an entry, and so has the end-of-sequence or stop token that ends a reply (as vLLM
does): its text is ``""`` (it is not part of the reply's text) and its logprob is the model's. ``text_offset``
counts characters of the returned text: a token that ends inside a UTF-8 character adds only the characters it
completes (:class:`TextOffsets`). Which token is where: ``docs/clients.md``.
"""

from __future__ import annotations

import codecs

from livelora.clients.types.openai import ChatCompletionTokenLogprob, CompletionLogprobs, TopLogprob
from livelora.gateway.engines.base import TokenLogprob
from livelora.gateway.services.serving.token_texts import TokenTexts

__all__ = ["TextOffsets", "TokenTexts", "chat_logprobs", "completion_logprobs"]


class TextOffsets:
    """Character offsets of consecutive tokens in a text made of their bytes (UTF-8, invalid bytes → U+FFFD).

    A token's offset is the number of characters completed by the bytes before it, so a character split over
    several tokens is counted once, where it ends.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, raw: list[int]) -> int:
        """The offset of a token with bytes ``raw``; then move past it."""
        offset = self.chars
        self.chars += len(self._decoder.decode(bytes(raw)))
        return offset


def _top(texts: TokenTexts, item: TokenLogprob, top_n: int) -> list[TopLogprob]:
    out = []
    for tid, lp in item.top[:top_n]:
        t, b = texts.get(tid)
        out.append(TopLogprob(token=t, logprob=lp, bytes=b))
    return out


def chat_logprobs(
    texts: TokenTexts, items: list[TokenLogprob], top_n: int, stop: TokenLogprob | None = None
) -> list[ChatCompletionTokenLogprob]:
    """Chat layout: one ``{token, logprob, bytes, top_logprobs: [...]}`` per generated token, then ``stop`` (the
    token that ended the reply: ``token: ""``, ``bytes: []``) if given."""
    out = []
    for item in items:
        token, raw = texts.get(item.token_id)
        out.append(
            ChatCompletionTokenLogprob(
                token=token, logprob=item.logprob, bytes=raw, top_logprobs=_top(texts, item, top_n)
            )
        )
    if stop is not None:
        out.append(
            ChatCompletionTokenLogprob(token="", logprob=stop.logprob, bytes=[], top_logprobs=_top(texts, stop, top_n))
        )
    return out


def completion_logprobs(
    texts: TokenTexts,
    items: list[TokenLogprob | None],
    token_ids: list[int],
    top_n: int,
    offsets: TextOffsets,
    stop: TokenLogprob | None = None,
) -> CompletionLogprobs:
    """Legacy layout: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    Args:
        items: one entry per id of ``token_ids``; ``None`` for a position without a logprob
            (the first echoed prompt token).
        offsets: the choice's offsets so far (advanced past these tokens).
        stop: the token that ended the reply, appended with text ``""`` at the end offset.
    """
    out = CompletionLogprobs()
    entries: list[tuple[str, list[int], TokenLogprob | None]] = [
        (*texts.get(tid), item) for tid, item in zip(token_ids, items, strict=True)
    ]
    if stop is not None:
        entries.append(("", [], stop))
    for token, raw, item in entries:
        out.tokens.append(token)
        out.text_offset.append(offsets.advance(raw))
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
