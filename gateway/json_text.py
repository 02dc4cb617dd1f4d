"""The one parser of JSON request bodies (:func:`json_body`, called by the auth middleware for every route and by
the Tinker body codec): one JSON value, nested at most :data:`MAX_JSON_DEPTH` deep, no object repeating a key, and
text that is Unicode UTF-8 can encode (:func:`check_text`).

Python's ``json`` turns ``"\\ud800"`` (and the raw bytes ``ED A0 80``) into a lone surrogate, a ``str`` that
cannot be written back as UTF-8 (to Redis, a file, a log or a response) and fails later, far from the request.
Rules and the error: ``docs/errors.md`` ("Text in JSON bodies").
"""

from __future__ import annotations

import json
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


#: Deepest nesting of objects/arrays a request body may have (Tinker bodies nest about 8 deep).
MAX_JSON_DEPTH = 64


def json_body(body: bytes, content_type: str | None) -> object:
    """The decoded body of a request declared as JSON (``None`` for another or no content-type, which its route
    answers; ``{}`` for an empty body), so that no route meets malformed, too deeply nested or ambiguous JSON.

    Raises:
        BadRequestError: not valid JSON, nested deeper than :data:`MAX_JSON_DEPTH`, or an object that repeats a
            key (a reader keeping the first and one keeping the last would see two requests) (400,
            ``invalid_json``); bytes that are not UTF-8, or a string holding a lone surrogate (400,
            ``invalid_text``: :func:`livelora.gateway.json_text.check_text`).
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if not (media == "application/json" or media.endswith("+json")):
        return None
    if not body.strip():
        return {}
    check_json_depth(body, MAX_JSON_DEPTH)
    try:
        data = json.loads(body, object_pairs_hook=_no_repeated_keys)
    except RecursionError:
        raise _too_deep() from None
    except BadRequestError:  # a repeated key
        raise
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"request body is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} ({exc.reason})",
            code="invalid_text",
        ) from None
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    check_text(body, data)
    return data


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise BadRequestError(
            f"request body repeats the key {key!r} in one object; each key may appear once",
            param=key,
            code="invalid_json",
        )
    return out


def check_json_depth(body: bytes, limit: int) -> None:
    """Refuse a body whose JSON nests objects/arrays deeper than ``limit`` (counted on the raw bytes, outside
    strings, before any parser recurses into it; a body that is not JSON is left to its route).

    Raises:
        BadRequestError: nested deeper than ``limit`` (400, code ``invalid_json``).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # cannot nest deeper (the common case: no scan)
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)  # C-speed: strings, then non-brackets
    depth = 0
    for byte in brackets:
        depth += 1 if byte in (0x5B, 0x7B) else -1
        if depth > limit:
            raise _too_deep(limit)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _too_deep(limit: int = MAX_JSON_DEPTH) -> BadRequestError:
    return BadRequestError(
        f"request body nests JSON objects/arrays deeper than the limit of {limit}", code="invalid_json"
    )
