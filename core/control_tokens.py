"""A tokenizer's control tokens, server side: which they are (:func:`control_tokens`), finding their text in user
text (:func:`find_control_text`) and a request's stop strings sorted into text stops and control-token stops
(:func:`split_stop_strings`). Text is plain text (:func:`livelora.clients.tokens.encode_text`); the rule and its one
exception: ``docs/internals/tokens.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from livelora.clients.errors import BadRequestError


def control_tokens(tokenizer) -> dict[str, int]:
    """``{text: id}`` of every control token of ``tokenizer``: the added tokens flagged ``special`` plus the
    tokenizer's named special tokens (``eos_token``, ``bos_token``, ...).

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
    """
    out: dict[str, int] = {}
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False) and str(tok):
            out[str(tok)] = int(idx)
    for text in getattr(tokenizer, "all_special_tokens", None) or []:
        if text and text not in out:
            idx = tokenizer.convert_tokens_to_ids(text)
            if isinstance(idx, int):
                out[text] = idx
    return out


@lru_cache(maxsize=32)
def _pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def control_pattern(tokenizer) -> re.Pattern[str] | None:
    """A regex matching any control token's text, longest first (``None`` if the tokenizer has none)."""
    return _pattern(tuple(sorted(control_tokens(tokenizer))))


def find_control_text(tokenizer, text: str) -> str | None:
    """The first control-token text found in ``text``, or ``None``."""
    pattern = control_pattern(tokenizer)
    match = pattern.search(text) if pattern is not None and text else None
    return match.group(0) if match else None


def split_stop_strings(tokenizer, stops: Iterable[str], param: str = "stop") -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Sort stop strings into text stops and control-token stops.

    A stop string equal to one control token's text (``"<|im_end|>"``) stops when that token is sampled,
    like a stop token id: the token is not part of the returned text or ids, ``finish_reason`` is ``stop``.
    Any other stop string is matched in the generated text.

    Returns:
        ``(text_stops, token_ids)``, each in the order given, without duplicates.

    Raises:
        BadRequestError: a stop string holds a control token's text plus other characters (param ``param``):
            generated text never contains control tokens, so it could never match.
    """
    controls = control_tokens(tokenizer)
    texts: dict[str, None] = {}  # insertion-ordered sets
    ids: dict[int, None] = {}
    for s in stops:
        if s in controls:
            ids[controls[s]] = None
            continue
        found = find_control_text(tokenizer, s)
        if found is not None:
            raise BadRequestError(
                f"stop sequence {s!r} mixes the control token {found!r} with other text; a stop sequence is "
                f"either exactly one control token (generation ends at that token) or plain text (matched in "
                f"the generated text, which never contains control tokens)",
                param=param,
            )
        texts[s] = None
    return tuple(texts), tuple(ids)
