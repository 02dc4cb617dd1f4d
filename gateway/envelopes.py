"""The body of an error answer: OpenAI's envelope, or Anthropic's on the Messages API routes.

Every error body of the gateway is built here (the app's handlers, the auth and drain middlewares, streams that
fail after their headers), so one path never answers in two shapes: ``/v1/messages`` and everything under it
gets ``{"type": "error", "error": {"type", "message"}}`` (``type`` from the status:
:func:`livelora.clients.types.anthropic.error_type`), every other path ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

from typing import Any

from livelora.clients.errors import LiveloraError
from livelora.clients.types.anthropic import ErrorDetail, ErrorResponse, error_type

#: The Messages API's routes (and anything under it) answer errors in Anthropic's envelope.
ANTHROPIC_PATH = "/v1/messages"


def is_anthropic(path: str | None) -> bool:
    """Whether ``path`` belongs to the Messages API."""
    return bool(path) and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


def anthropic_error(err: LiveloraError) -> dict[str, Any]:
    """Anthropic's envelope of ``err``; the field at fault leads the message when the message does not name it."""
    message = err.to_dict()["message"]
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return ErrorResponse(error=ErrorDetail(type=error_type(err.status), message=message)).model_dump(mode="json")


def error_body(err: LiveloraError, path: str | None) -> dict[str, Any]:
    """The JSON body answering ``err`` on ``path`` (see the module docstring)."""
    return anthropic_error(err) if is_anthropic(path) else {"error": err.to_dict()}
