"""Text in a JSON request body must be Unicode that UTF-8 can encode: :func:`check_text`, called by the one body
parser (:func:`livelora.gateway.middleware.auth.json_body`) for every route, Tinker routes included.

Python's ``json`` turns ``"\\ud800"`` (and the raw bytes ``ED A0 80``) into a lone surrogate, a ``str`` that
cannot be written back as UTF-8 (to Redis, a file, a log or a response) and fails later, far from the request.
Rules and the error: ``docs/errors.md`` ("Text in JSON bodies").
"""

from __future__ import annotations

import re

from livelora.clients.errors import BadRequestError

#: A ``\\u`` escape of a UTF-16 surrogate (D800-DFFF); an escaped backslash before ``u`` also matches, which only
#: costs the walk below.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(body: bytes, data: object) -> None:
    """Refuse ``data`` (the decoded ``body``) if any of its strings, keys included, holds a lone surrogate.

    A body that is strict UTF-8 without a surrogate escape cannot hold one and is not walked.

    Raises:
        BadRequestError: 400, code ``invalid_text``, ``param`` the field's path (``messages[0].content``).
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        pass  # raw surrogate bytes (json decodes them with surrogatepass), or UTF-16/32: walk
    else:
        if _SURROGATE_ESCAPE.search(body) is None:
            return
    where = _find(data, "")
    if where is not None:
        param, text = where
        at = _SURROGATE.search(text)
        raise BadRequestError(
            f"request body holds text that is not valid Unicode at {param or 'the body'}: a lone UTF-16 surrogate "
            f"(U+{ord(at.group()):04X}) at character {at.start()}, which has no UTF-8 form; send text as UTF-8 "
            "and escape characters beyond U+FFFF as a surrogate pair ('\\ud83d\\ude00')",
            param=param or None,
            code="invalid_text",
        )


def _find(node: object, path: str) -> tuple[str, str] | None:
    """``(path, text)`` of the first string (or key) with a surrogate, depth first; ``None`` if there is none."""
    if isinstance(node, str):
        return (path, node) if _SURROGATE.search(node) else None
    if isinstance(node, dict):
        for key, value in node.items():
            shown = key.encode("utf-8", "backslashreplace").decode() if _SURROGATE.search(key) else key
            here = f"{path}.{shown}" if path else shown
            if shown is not key:
                return (here, key)
            if (found := _find(value, here)) is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if (found := _find(value, f"{path}[{i}]")) is not None:
                return found
    return None
