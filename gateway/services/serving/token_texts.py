"""Token text and bytes: what logprobs and echoed prompts show of each token.

A byte-level BPE token (GPT-2 / SmolLM2 / Llama-3 style) may hold part of a UTF-8 character, so its text is the
lossy decode of its exact bytes, which are also returned (as OpenAI does) so clients can rebuild the text exactly.
Bytes come from the tokenizer's byte-to-unicode table (``transformers.convert_slow_tokenizer.bytes_to_unicode``);
tokenizers without one (SentencePiece) fall back to decoding the single id.
"""

from __future__ import annotations

from functools import lru_cache


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

    def decode(self, ids: list[int]) -> str:
        """Exact text of ``ids`` from their bytes (a partial trailing character becomes U+FFFD)."""
        return b"".join(bytes(self.get(t)[1]) for t in ids).decode("utf-8", errors="replace")
