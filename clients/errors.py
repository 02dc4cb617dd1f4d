"""One exception tree for the whole of livelora: gateway, trainer, store and SDK.

Every error raised on purpose is a :class:`LiveloraError` that also inherits the standard-library exception it
replaces (``ValueError``, ``KeyError``, ...). Each class carries its HTTP ``status``, the OpenAI envelope
``type`` and a default ``code``; the gateway's one handler turns any of them into
``{"error": {"message", "type", "param", "code"}}`` (the Tinker routes use :attr:`LiveloraError.category`).
Errors pickle and round-trip through :meth:`LiveloraError.to_dict` / :func:`error_from_dict`, so they cross
process boundaries. The rules: ``docs/internals/wire-types.md``.
"""

from __future__ import annotations

import re
from typing import Any

#: An absolute file path under a usual file-system root (not a URL path such as ``/v1/models``: those roots are
#: not in the list), or one under the home directory (``~/``).
_FILE_PATH = re.compile(
    r"(?<![\w.:/])(?:/(?:tmp|root|home|work|usr|var|opt|etc|data|mnt|srv|proc|dev|run|"
    r"private|Users|app|cache|nix|media|scratch)(?=/|\b)|~/)[^\s'\"`,;:)\]}]*"
)


def redact_paths(text: str) -> str:
    """``text`` with absolute file paths replaced by ``<path>`` (``/tmp/x/adapters/a@1`` → ``<path>``)."""
    return _FILE_PATH.sub("<path>", text) if "/" in text else text


class LiveloraError(Exception):
    """Root of every livelora error.

    Args:
        message: human-readable explanation, shown to API users as is.
        param: the request field at fault (OpenAI ``param``), if any.
        code: machine-readable code (OpenAI ``code``); defaults to the class's.
    """

    status: int = 500
    type: str = "server_error"
    default_code: str | None = None
    #: Tinker ``RequestErrorCategory``: "user", "server" or "unknown".
    category: str = "server"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def __reduce__(self):  # picklable with keyword arguments
        return (_rebuild, (type(self).__name__, self.message, self.param, self.code))

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"message", "type", "param", "code"}`` (server file paths in the message
        replaced by ``<path>``, :func:`redact_paths`: what goes over the wire never shows the server's files)."""
        return {"message": redact_paths(self.message), "type": self.type, "param": self.param, "code": self.code}


class BadRequestError(LiveloraError, ValueError):
    """Invalid input (HTTP 400). Nothing was changed."""

    status = 400
    type = "invalid_request_error"
    category = "user"


class ContextLengthExceededError(BadRequestError):
    """Prompt plus requested completion tokens exceed the model's context (HTTP 400)."""

    default_code = "context_length_exceeded"


class UnsupportedParameterError(BadRequestError):
    """A parameter livelora cannot honour; never silently ignored (HTTP 400)."""

    default_code = "unsupported_parameter"


class AuthenticationError(LiveloraError, PermissionError):
    """Missing or bad API key (HTTP 401)."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"
    category = "user"


class PermissionDeniedError(LiveloraError, PermissionError):
    """The key is valid but lacks the role this route needs (HTTP 403)."""

    status = 403
    type = "permission_error"
    default_code = "insufficient_permissions"
    category = "user"


class NotFoundError(LiveloraError, KeyError):
    """Unknown (or not visible to this tenant) object (HTTP 404)."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"
    category = "user"


class ModelNotFoundError(NotFoundError):
    """Unknown model / endpoint / adapter name (HTTP 404, code ``model_not_found``)."""

    default_code = "model_not_found"


class ConflictError(LiveloraError):
    """The request conflicts with current state (HTTP 409)."""

    status = 409
    type = "invalid_request_error"
    default_code = "conflict"
    category = "user"


class PayloadTooLargeError(BadRequestError):
    """The request body exceeds the server's size limit (HTTP 413)."""

    status = 413
    default_code = "payload_too_large"


class RateLimitError(LiveloraError):
    """Queue full or rate limit (HTTP 429, sent with ``Retry-After``)."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"
    category = "server"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class UnavailableError(LiveloraError, ConnectionError):
    """A dependency (Redis, the engine) is unreachable (HTTP 503, ``Retry-After``)."""

    status = 503
    type = "server_error"
    default_code = "service_unavailable"
    category = "server"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class InternalError(LiveloraError, RuntimeError):
    """A fault of livelora itself (HTTP 500)."""

    status = 500
    type = "server_error"
    default_code = "internal_error"
    category = "server"


class NotBuiltError(BadRequestError):
    """A Tinker route or op livelora knows but has not built; the message says why and what to use instead.

    HTTP 400, not 501: the tinker SDK retries every 5xx for minutes (``lib/retry_handler.py``
    ``is_retryable_status_code``), and a refusal must fail at once.
    """

    default_code = "not_implemented"


_CLASSES: dict[str, type[LiveloraError]] = {}


def _register() -> None:
    stack = [LiveloraError]
    while stack:
        cls = stack.pop()
        _CLASSES[cls.__name__] = cls
        stack.extend(cls.__subclasses__())


def _rebuild(name: str, message: str, param: str | None, code: str | None) -> LiveloraError:
    if not _CLASSES:
        _register()
    cls = _CLASSES.get(name, LiveloraError)
    err = cls.__new__(cls)
    LiveloraError.__init__(err, message, param=param, code=code)
    return err


def error_to_dict(err: LiveloraError) -> dict[str, Any]:
    """Serialise an error for Redis: the OpenAI fields plus the class name."""
    return {**err.to_dict(), "class": type(err).__name__, "category": err.category}


def error_from_dict(data: dict[str, Any]) -> LiveloraError:
    """Inverse of :func:`error_to_dict`; unknown class names become :class:`LiveloraError`."""
    return _rebuild(
        str(data.get("class", "LiveloraError")), str(data.get("message", "")), data.get("param"), data.get("code")
    )


def error_for_status(status: int, message: str, *, param: str | None = None, code: str | None = None) -> LiveloraError:
    """The SDK's mapping from an HTTP status back to an exception class."""
    cls: type[LiveloraError] = {
        400: BadRequestError,
        401: AuthenticationError,
        403: PermissionDeniedError,
        404: NotFoundError,
        409: ConflictError,
        413: PayloadTooLargeError,
        429: RateLimitError,
        503: UnavailableError,
    }.get(status, InternalError if status >= 500 else BadRequestError)
    if code == "model_not_found":
        cls = ModelNotFoundError
    elif code == "context_length_exceeded":
        cls = ContextLengthExceededError
    return cls(message, param=param, code=code)
