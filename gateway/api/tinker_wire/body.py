"""The one decoder of a training-session request body: the auth middleware calls :func:`decode_body` once per
request, runs the owner check on what it returns (:func:`owner_fields`) and hands that same object to the route,
which executes it; nothing reads the raw bytes a second time.

Rules, for every ``/api/v1`` body: ``Content-Encoding`` is undone first (at most ``max_bytes``, nothing may
follow the compressed stream); a JSON body is one object with no repeated key
(:func:`livelora.gateway.json_text.json_body`); a protobuf body (``forward_backward`` only) is one
``ForwardBackwardRequest`` in strict form
(:func:`~livelora.gateway.api.tinker_wire.requests.decode_forward_backward`). Anything else is a 400.
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker_ext import ForwardBackwardRequestV2
from livelora.gateway.api.tinker_wire.requests import (
    DEFAULT_MAX_BODY_BYTES,
    WireDecodeError,
    body_kind,
    decode_content,
    decode_forward_backward,
)
from livelora.gateway.json_text import json_body

#: the only route that takes a protobuf body
PROTO_ROUTE = "/api/v1/forward_backward"

#: a decoded body: a JSON object, a typed protobuf ``forward_backward``, or the error of a protobuf body that
#: failed after its ``model_id``/``seq_id`` were read (the owner check runs on those; the route answers it)
Decoded = dict[str, Any] | ForwardBackwardRequestV2 | WireDecodeError


def decode_body(
    path: str, raw: bytes, content_type: str | None, content_encoding: str | None, *, max_bytes: int | None = None
) -> Decoded:
    """Decode the body of ``POST``/``PUT`` ``path`` (an ``/api/v1`` route) once.

    Args:
        raw: the body as received; ``content_type`` / ``content_encoding``: its headers.
        max_bytes: limit on the decompressed body (bytes; default the codec's).

    Raises:
        BadRequestError: another content type (protobuf anywhere but ``forward_backward``), an unknown
            encoding, JSON that is not one object or repeats a key; a protobuf body whose ``model_id`` could not
            be read (a :class:`WireDecodeError` without ids).
        PayloadTooLargeError: the decompressed body exceeds ``max_bytes``.
    """
    if not raw.strip():
        return {}
    kind = body_kind(content_type) if content_type and path == PROTO_ROUTE else _json_only(path, content_type)
    body = decode_content(raw, content_encoding, max_bytes=max_bytes or DEFAULT_MAX_BODY_BYTES)
    if kind == "json":
        data = json_body(body, content_type or "application/json")
        if not isinstance(data, dict):
            raise BadRequestError("request body must be a JSON object", code="invalid_json")
        return data
    try:
        return decode_forward_backward(body)
    except WireDecodeError as exc:
        if exc.model_id is None:
            raise
        return exc


def _json_only(path: str, content_type: str | None) -> str:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return "json"
    what = f"unsupported content-type {content_type!r}" if content_type else "no content-type header"
    raise BadRequestError(
        f"{what}: {path} takes a JSON body; send it with the header 'content-type: application/json'",
        code="unsupported_content_type",
    )


def owner_fields(decoded: Decoded) -> dict[str, Any]:
    """What the owner check reads of a decoded body (:func:`livelora.core.object_ids.refs_of_request`): the JSON
    object itself, or the ids of the protobuf request (or of its error) that the route will act on."""
    if isinstance(decoded, dict):
        return decoded
    return {"model_id": decoded.model_id}
