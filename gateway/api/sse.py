"""Server-sent events in the exact framing OpenAI clients parse (contract §1.3, A06).

Every event is ``data: <json>\\n\\n`` with LF separators, the JSON is ASCII-safe
(``json.dumps`` default ``ensure_ascii=True``, so U+2028/U+2029/U+0085 are
escaped), the stream ends with ``data: [DONE]``, and keep-alive pings are SSE
comments (``: ping - <time>``), which openai-python ignores. The media type is
``text/event-stream; charset=utf-8``. sse-starlette watches the receive
channel, so a client disconnect cancels the event generator within one receive.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sse_starlette.sse import EventSourceResponse

DONE = "[DONE]"
PING_INTERVAL_S = 15


def sse_data(payload: Mapping[str, Any]) -> str:
    """One event's data: compact, ASCII-safe JSON."""
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":"))


def sse_response(events: AsyncIterator[str], headers: Mapping[str, str] | None = None) -> EventSourceResponse:
    """Stream ``events`` (each already a data string, the last ``[DONE]``) as SSE."""
    return EventSourceResponse(events, sep="\n", ping=PING_INTERVAL_S, headers=dict(headers or {}),
                               media_type="text/event-stream")
