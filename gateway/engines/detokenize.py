"""Incremental detokenization and stop-string matching for streamed generation.

One of each per sequence: :class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas
that never end in half a UTF-8 character (it decodes a short window of recent tokens with and without the newest
ones and emits the difference, the method of Hugging Face text-generation-inference and vLLM); every delta plus
:meth:`IncrementalDetokenizer.flush` equals one full ``tokenizer.decode``. :class:`StopStringMatcher` finds
stop strings across deltas and holds back any suffix that could still grow into one, so no part of a matched
stop string is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token-by-token text decoding that only emits complete characters.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is the only method used).
        skip_special_tokens: drop special tokens (``<|im_end|>`` ...) from the
            text, as OpenAI-compatible servers do.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this index have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly ``""``)."""
        self.token_ids.append(int(token_id))
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return delta
        return ""

    def flush(self) -> str:
        """Return the text still held back when the sequence ends.

        A character left incomplete by the last token (the sequence was cut by
        ``max_tokens`` inside a multi-byte character) is dropped rather than
        emitted as U+FFFD, so the streamed text equals
        ``tokenizer.decode(all_ids).rstrip("\ufffd")``.
        """
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        return delta.rstrip(REPLACEMENT_CHAR)


class StopStringMatcher:
    """Cut streamed text at the first stop string, never leaking any part of it.

    Feed text deltas with :meth:`feed`; it returns the text that is safe to emit
    now and the matched stop string (or ``None``). Text whose suffix is a prefix
    of some stop string is held back until it is disambiguated; call
    :meth:`flush` when the sequence ends for another reason to release it.

    Args:
        stops: the stop strings (empty strings are ignored).
        include: a matched stop string is emitted (it ends the text) instead of cut off.
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._text = ""
        self._sent = 0  # characters of _text already emitted
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add a text delta; return ``(text to emit, matched stop string or None)``."""
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return delta, None
        old_len = len(self._text)
        self._text += delta
        best: tuple[int, str] | None = None
        for s in self.stops:
            p = self._text.find(s, max(0, old_len - len(s) + 1))
            if p >= 0 and (best is None or p < best[0]):
                best = (p, s)
        if best is not None:
            p, s = best
            end = p + len(s) if self.include else p
            out = self._text[self._sent : end] if end > self._sent else ""
            self._sent = max(self._sent, end)
            self.matched = s
            return out, s
        hold = 0
        tail_room = min(self._max_len - 1, len(self._text) - self._sent)
        for k in range(tail_room, 0, -1):
            suffix = self._text[-k:]
            if any(s.startswith(suffix) for s in self.stops):
                hold = k
                break
        end = len(self._text) - hold
        out = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out, None

    def flush(self) -> str:
        """Release the held-back text (the sequence ended without a match)."""
        if self.matched is not None:
            return ""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out
