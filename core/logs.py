"""Traceable logs: plain text (the default) or one JSON object per line (``LIVELORA_LOG_FORMAT=json``).

Every log record emitted while a gateway request is handled carries that request's fields, taken from
:data:`log_context` (a ``ContextVar`` holding one dict per request, filled in as the request goes:
``request_id`` by the request middleware, then ``completion_id``, ``tenant``, ``endpoint``, ``version`` once the
served request began). A record may add its own through ``extra={...}`` (the trainer logs the ``version`` it
published with the ``event_ids`` and ``completion_ids`` it trained on). So one rating can be followed: the
request that served completion ``chatcmpl-…`` (its ``request_id``, ``version``), the signal request naming that
``completion_id``, and the trainer line that lists it with the new ``version``.

JSON lines hold ``time`` (ISO 8601 UTC), ``level``, ``logger``, ``message``, then the fields of
:data:`FIELDS` that are set, and ``exc`` for a traceback.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

#: The fields a record may carry (from :data:`log_context` or ``extra``).
FIELDS: tuple[str, ...] = (
    "request_id",
    "completion_id",
    "tenant",
    "endpoint",
    "version",
    "event_id",
    "event_ids",
    "completion_ids",
    "session_id",
    "model_id",
)

#: The fields of the request being handled (one dict per request; ``None`` outside requests).
log_context: ContextVar[dict[str, Any] | None] = ContextVar("livelora_log_context", default=None)


def annotate(**fields: Any) -> None:
    """Add ``fields`` (``None`` values skipped) to the current request's log context (no-op outside requests)."""
    ctx = log_context.get()
    if ctx is not None:
        ctx.update({k: v for k, v in fields.items() if v is not None})


class ContextFilter(logging.Filter):
    """Copies the request's :data:`log_context` onto every record (fields ``extra`` already set win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (log_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time``, ``level``, ``logger``, ``message``, the set :data:`FIELDS`, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(fmt: str = "text", level: int | str = logging.INFO) -> None:
    """Install one stderr handler on the root logger: :class:`JsonFormatter` for ``fmt == "json"``, else the plain
    format; both with :class:`ContextFilter`. Replaces the root's handlers (call once, at process start).

    Raises:
        ValueError: ``fmt`` is neither ``text`` nor ``json``.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN_FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else getattr(logging, level.upper(), logging.INFO))
