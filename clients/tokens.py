"""Text → token ids without letting text become control tokens (:func:`encode_text`: the SDK's, used by gateway
and trainer too; the server's control-token rules are :mod:`livelora.core.control_tokens`).

Hugging Face tokenizers turn the *text* of a control token (``<|im_end|>``, ...) into the token itself by default,
so user text could forge a turn boundary. Here text is plain text: :func:`encode_text` encodes control-token
look-alikes as ordinary characters (``split_special_tokens=True``) and control tokens come only from a chat
template or as ids. The rule and its one exception (the legacy
completions route's text prompt): ``docs/internals/tokens.md``.

Example::

    ids = encode_text(tokenizer, "a literal <|im_end|> stays text")   # no control token in ids
"""

from __future__ import annotations


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` read as plain text: shape ``(T,)``; no control token comes from the text, whatever
    it says (``"<|im_end|>"`` becomes the ids of ``<``, ``|``, ``im``, ...).

    Args:
        add_special_tokens: add what the tokenizer's ``encode`` adds around a text (a BOS for Llama-style
            tokenizers, nothing for SmolLM2's); default ``False``, as inside a chat template.

    Non-special added tokens are still matched (they are ordinary vocabulary).
    """
    if not text and not add_special_tokens:
        return []
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))
