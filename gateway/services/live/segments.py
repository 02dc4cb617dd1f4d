"""Which segment of an endpoint a request belongs to, and the version that serves it: :class:`SegmentRouter`.

A request naming an endpoint that has segments (``adapters/segments.py``) is matched by its ``user`` field, then
its API key id, then its ``X-Livelora-Segment`` header, against the members of the endpoint's segments, and only
when the caller's tenant administers the endpoint (others are never served a segment). A match is served by the
segment's current version under the segment's binding name (so its completions, ratings, statistics and usage are
the segment's); until the segment has a version loaded, the endpoint's shared version serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from livelora.core.api_keys import Principal

#: The request header that selects a segment by value.
SEGMENT_HEADER = "X-Livelora-Segment"


@dataclass(frozen=True)
class _Members:
    binding: str
    users: frozenset[str]
    keys: frozenset[str]
    headers: frozenset[str]


class SegmentRouter:
    """Routes requests of an endpoint to its segments, from the registry's bindings (re-indexed when they are
    re-read).

    Args:
        registry: the :class:`~.registry.AdapterRegistry` (``bindings``, ``current``, ``stats``).
    """

    def __init__(self, registry: Any):
        self.registry = registry
        self._indexed: Any = None
        self._index: dict[str, list[_Members]] = {}

    def index(self) -> dict[str, list[_Members]]:
        """Endpoint → its segments' members (rebuilt when the registry's bindings object changes)."""
        bindings = self.registry.bindings
        if self._indexed is not bindings:
            index: dict[str, list[_Members]] = {}
            for name, b in bindings.items():
                seg = b.segment
                if seg is not None:
                    members = _Members(name, frozenset(seg.users), frozenset(seg.keys), frozenset(seg.headers))
                    index.setdefault(seg.endpoint, []).append(members)
            self._index, self._indexed = index, bindings
        return self._index

    def match(self, endpoint: str, principal: Principal | None, user: str | None) -> str | None:
        """The segment binding name a request of ``principal`` with ``user`` belongs to (``None``: none)."""
        rows = self.index().get(endpoint)
        if not rows or principal is None or not self.registry.versions_visible(endpoint, principal):
            return None
        for pick in (
            lambda m: user is not None and user in m.users,
            lambda m: principal.key_id is not None and principal.key_id in m.keys,
            lambda m: principal.segment is not None and principal.segment in m.headers,
        ):
            for m in rows:
                if pick(m):
                    return m.binding
        return None

    def route(
        self, endpoint: str, adapter: str | None, principal: Principal | None, user: str | None
    ) -> tuple[str, str | None]:
        """``(endpoint, adapter)`` for the request: its segment's binding and current version, or what it was
        given (no segment; the shared version while the segment has none loaded)."""
        segment = self.match(endpoint, principal, user)
        if segment is None:
            return endpoint, adapter
        reg = self.registry
        current = reg.current.get(segment)
        if reg.stats is not None:
            current = reg.stats.route(segment, current)
        return segment, current if current is not None else adapter
