"""Token text and bytes for logprobs, in the chat and the legacy completions layouts.

A byte-level BPE token (GPT-2 / SmolLM2 / Llama-3 style) may hold part of a
UTF-8 character, so its ``token`` string is the lossy decode of its exact
``bytes``, which are also returned (as OpenAI does) so clients can rebuild the
text exactly. Bytes come from the tokenizer's byte-to-unicode table
(``transformers.convert_slow_tokenizer.bytes_to_unicode``); tokenizers without
one (SentencePiece) fall back to decoding the single id.
"""

from __future__ import annotations

from functools import lru_cache

from livelora.clients.types.openai import ChatCompletionTokenLogprob, CompletionLogprobs, TopLogprob
from livelora.gateway.engines.base import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Cached ``token id → (text, utf-8 bytes)`` for one tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token; text may contain U+FFFD for a partial character."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
        if raw is None:
            raw = self._tokenizer.decode([token_id]).encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = hit
        return hit


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
