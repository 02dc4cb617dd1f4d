"""Segments of an endpoint: named sets of users, each learning on a lineage of its own.

A segment ``S`` of endpoint ``E`` is stored as its own binding ``E::S`` in ``endpoints.json`` (same file, lock and
atomic writes as every endpoint; :class:`~livelora.adapters.endpoints.SegmentOf` holds its members), following the
lineage ``<E's lineage>-seg-S``, which starts from the version ``E`` served when the segment was made (copied as
its version 1). Requests match a segment by their ``user`` field, their API key id or the ``X-Livelora-Segment``
header (gateway side: ``gateway/services/live/segments.py``). Use and limits: ``docs/endpoints-and-keys.md``.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from livelora.adapters.endpoints import (
    EndpointBinding,
    EndpointStore,
    HistoryEntry,
    SegmentOf,
    check_reason,
    version_label,
)
from livelora.adapters.kept_versions import AdapterVersions
from livelora.adapters.store import AdapterStore, validate_lineage
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError
from livelora.core.api_keys import DEFAULT_TENANT, KeyStore
from livelora.core.owners import OwnerStore

#: Joins an endpoint and a segment name into the segment's binding name (never in a created endpoint's name).
SEP = "::"
#: Segments one endpoint may have.
MAX_SEGMENTS = 16
#: Members (users, keys and header values together) one segment may have.
MAX_MEMBERS = 1000
#: Longest ``user`` value a segment may list (the OpenAI field's own bound in this gateway: 256).
MAX_USER_CHARS = 256
SEGMENT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
HEADER_VALUE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
KINDS = ("users", "keys", "headers")


def is_segment(name: str) -> bool:
    """Whether ``name`` is a segment's binding name (``<endpoint>::<segment>``)."""
    return SEP in name


def segment_binding_name(endpoint: str, segment: str) -> str:
    """``<endpoint>::<segment>`` (the segment name validated).

    Raises:
        BadRequestError: a segment name outside ``[a-z0-9][a-z0-9_-]{0,31}``, or a binding name over 128 chars.
    """
    if not isinstance(segment, str) or not SEGMENT_RE.fullmatch(segment):
        raise BadRequestError(
            f"invalid segment name {segment[:80]!r}: use 1-32 characters of a-z, 0-9, '_', '-', starting with a "
            "letter or digit",
            param="segment",
        )
    name = f"{endpoint}{SEP}{segment}"
    if len(name) > 128:
        raise BadRequestError(f"endpoint and segment names together exceed 126 characters: {name!r}", param="segment")
    return name


def check_members(users: list[str], keys: list[str], headers: list[str]) -> None:
    """Raises BadRequestError for a malformed member (empty or over-long user, bad header value, bad key id)."""
    for u in users:
        if not isinstance(u, str) or not u or len(u) > MAX_USER_CHARS or not u.isprintable():
            raise BadRequestError(f"each user must be 1-{MAX_USER_CHARS} printable characters", param="users")
    for k in keys:
        if not isinstance(k, str) or not HEADER_VALUE_RE.fullmatch(k):
            raise BadRequestError(f"invalid API key id {str(k)[:80]!r}", param="keys")
    for h in headers:
        if not isinstance(h, str) or not HEADER_VALUE_RE.fullmatch(h):
            raise BadRequestError(
                f"invalid header value {str(h)[:80]!r}: use 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'",
                param="headers",
            )


class SegmentStore:
    """Create, list and change the segments of the endpoints in ``endpoints`` (its file, lock and history).

    Args:
        endpoints: the endpoint store (its :meth:`~EndpointStore._visible` decides who administers what).
    """

    def __init__(self, endpoints: EndpointStore):
        self.endpoints = endpoints
        self.home = Path(endpoints.home)

    def of(self, endpoint: str) -> dict[str, EndpointBinding]:
        """Segment name → binding, for the segments of ``endpoint`` (any tenant's: callers check first)."""
        return {
            b.segment.name: b for b in self.endpoints.all().values() if b.segment and b.segment.endpoint == endpoint
        }

    def parent(self, endpoint: str, tenant: str) -> EndpointBinding:
        """The binding of an endpoint ``tenant`` administers that may have segments.

        Raises:
            NotFoundError: unknown or another tenant's. BadRequestError: ``endpoint`` is itself a segment.
        """
        binding = self.endpoints._visible(endpoint, tenant)
        if binding.segment is not None:
            raise BadRequestError(f"{endpoint!r} is a segment; a segment has no segments", param="endpoint")
        return binding

    def segment(self, endpoint: str, segment: str, tenant: str) -> EndpointBinding:
        """One segment of an endpoint ``tenant`` administers. Raises: NotFoundError, BadRequestError."""
        self.parent(endpoint, tenant)
        name = segment_binding_name(endpoint, segment)
        found = self.endpoints.all().get(name)
        if found is None or found.segment is None:
            raise NotFoundError(f"endpoint {endpoint!r} has no segment {segment!r}", param="segment")
        return found

    def create(
        self,
        endpoint: str,
        segment: str,
        *,
        tenant: str,
        who: str,
        reason: str = "",
        versions: AdapterVersions | None = None,
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Make segment ``segment`` of ``endpoint``: its lineage starts from the version the endpoint serves now
        (copied as the lineage's version 1; none when it serves the base model), and it follows that lineage.
        Every check runs before anything is written; the lineage is claimed and the version copied under the
        endpoints' lock, so a refused or concurrent create leaves nothing behind.

        Raises:
            NotFoundError: unknown or another tenant's endpoint. BadRequestError: bad names or reason, a segment's
                segment, an endpoint lineage too long to have segments.
            ConflictError: the segment exists, the endpoint has :data:`MAX_SEGMENTS`, or the lineage is taken
                (another tenant's, another binding's, or it has versions already).
            RateLimitError: the copy would pass the tenant's adapter limits (``versions``; None: not checked).
        """
        check_reason(reason)
        parent = self.parent(endpoint, tenant)
        name = segment_binding_name(endpoint, segment)
        room = 64 - len(parent.lineage) - len("-seg-")
        if room < 1:
            raise BadRequestError(
                f"endpoint {endpoint!r} follows lineage {parent.lineage!r}, too long for a segment lineage "
                f"('<lineage>-seg-<segment>' is at most 64 characters)",
                param="endpoint",
            )
        if len(segment) > room:
            raise BadRequestError(f"segment name too long here: at most {room} characters", param="segment")
        lineage = f"{parent.lineage}-seg-{segment}"
        validate_lineage(lineage)
        owner = parent.tenant or DEFAULT_TENANT

        def update(old: EndpointBinding | None) -> EndpointBinding:
            if old is not None:
                raise ConflictError(f"endpoint {endpoint!r} has a segment {segment!r} already", param="segment")
            bindings = self.endpoints.all()  # one read under the lock for both checks
            if sum(1 for b in bindings.values() if b.segment and b.segment.endpoint == endpoint) >= MAX_SEGMENTS:
                raise ConflictError(f"endpoint {endpoint!r} has {MAX_SEGMENTS} segments, the most", param="segment")
            taken = ConflictError(f"lineage {lineage!r} is not available; choose another segment name", param="segment")
            store = AdapterStore(self.home)
            if any(b.lineage == lineage for b in bindings.values()) or store.version_numbers(lineage):
                raise taken
            served = self.endpoints.served_version(parent, store, endpoint)
            if served is not None and versions is not None:
                src = store.version_dir(parent.lineage, served)
                versions.check(owner, 1, sum(f.stat().st_size for f in src.iterdir() if f.is_file()))
            if not OwnerStore(self.home).claim("lineage", lineage, owner):
                raise taken
            origin = (
                version_label(parent.lineage, served) if served is None else self._fork(store, parent, served, lineage)
            )
            return EndpointBinding(
                lineage=lineage,
                tenant=parent.tenant,
                created=time.time(),
                gate=parent.gate,
                segment=SegmentOf(endpoint=endpoint, name=segment, origin=origin),
            )

        return self.endpoints._change(name, update, who=who, action="segment", reason=reason, tenant=tenant)

    @staticmethod
    def _fork(store: AdapterStore, parent: EndpointBinding, served: int, lineage: str) -> str:
        """Copy ``parent``'s version ``served`` into ``lineage`` as its version 1; the copied version's name."""
        src = store.get(parent.lineage, served)
        src_dir = store.version_dir(parent.lineage, served)

        def copy(tmp: Path) -> None:
            for p in src_dir.iterdir():
                if p.is_file() and p.name != "manifest.json":
                    shutil.copy2(p, tmp / p.name)

        store.write_version(
            lineage,
            copy,
            base_model=src.base_model,
            step=src.step,
            metrics={},
            data_counts=dict(src.data_counts),
            rank=src.rank,
            alpha=src.alpha,
        )
        return src.name

    def assign(
        self,
        endpoint: str,
        segment: str,
        members: dict[str, list[str]],
        *,
        tenant: str,
        who: str,
        remove: bool = False,
        reason: str = "",
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Add (``remove``: take out) ``members`` (``{"users"|"keys"|"headers": [...]}``) to a segment.

        Raises:
            NotFoundError: unknown endpoint or segment, a key id not of ``tenant`` or a member to remove that is
                not in the segment. BadRequestError: malformed members, none given, too many.
            ConflictError: a member already in this or another segment of the endpoint.
        """
        self.segment(endpoint, segment, tenant)
        users, keys, headers = (list(dict.fromkeys(members.get(k) or [])) for k in KINDS)
        check_members(users, keys, headers)
        if not (users or keys or headers):
            raise BadRequestError("give at least one of users, keys, headers", param="users")
        if len(users) + len(keys) + len(headers) > MAX_MEMBERS:
            raise BadRequestError(f"at most {MAX_MEMBERS} members per segment", param="users")
        if not remove:
            own = {r.id for r in KeyStore(self.home).active() if r.tenant == tenant}
            for k in keys:
                if k not in own:
                    raise NotFoundError(f"API key {k!r} does not exist", param="keys")
        given = dict(zip(KINDS, (users, keys, headers), strict=True))
        name = segment_binding_name(endpoint, segment)

        def update(old: EndpointBinding | None) -> EndpointBinding:
            if old is None or old.segment is None:
                raise NotFoundError(f"endpoint {endpoint!r} has no segment {segment!r}", param="segment")
            seg = old.segment
            new = {k: _changed(getattr(seg, k), given[k], k, remove) for k in KINDS}
            if not remove:
                self._no_duplicates(endpoint, given)
                if sum(len(v) for v in new.values()) > MAX_MEMBERS:
                    raise BadRequestError(f"at most {MAX_MEMBERS} members per segment", param="users")
            return old.model_copy(update={"segment": seg.model_copy(update=new)})

        return self.endpoints._change(name, update, who=who, action="segment", reason=reason, tenant=tenant)

    def _no_duplicates(self, endpoint: str, given: dict[str, list[str]]) -> None:
        """Raises ConflictError when a member of ``given`` is in a segment of ``endpoint`` already."""
        for other, b in self.of(endpoint).items():
            assert b.segment is not None
            for kind in KINDS:
                dup = set(given[kind]) & set(getattr(b.segment, kind))
                if dup:
                    raise ConflictError(
                        f"{kind[:-1]} {sorted(dup)[0][:80]!r} is in segment {other!r} of {endpoint!r} already; "
                        "a member belongs to one segment",
                        param=kind,
                    )

    def forget(self, user: str, tenant: str | None, *, who: str) -> list[str]:
        """Take ``user`` out of every segment of ``tenant``'s endpoints (``None``: every tenant's) after a
        delete-by-user; the segment binding names it was taken out of."""
        changed = []
        for name, b in self.endpoints.all().items():
            owner = b.tenant or DEFAULT_TENANT
            if b.segment is None or tenant not in (None, owner) or user not in b.segment.users:
                continue

            def update(old: EndpointBinding | None) -> EndpointBinding:
                assert old is not None and old.segment is not None
                users = [u for u in old.segment.users if u != user]
                return old.model_copy(update={"segment": old.segment.model_copy(update={"users": users})})

            self.endpoints._change(name, update, who=who, action="segment", reason="user forgotten", tenant=owner)
            changed.append(name)
        return changed


def _changed(have: list[str], given: list[str], kind: str, remove: bool) -> list[str]:
    """``have`` plus (or, with ``remove``, minus) ``given``. Raises NotFoundError: removing a missing member."""
    if not remove:
        return [*have, *given]
    missing = [g for g in given if g not in have]
    if missing:
        raise NotFoundError(f"{kind[:-1]} {missing[0][:80]!r} is not in the segment", param=kind)
    return [h for h in have if h not in set(given)]


def segment_info(name: str, binding: EndpointBinding) -> dict:
    """The admin API's view of one segment binding (members included)."""
    assert binding.segment is not None
    seg = binding.segment
    return {
        "name": seg.name,
        "endpoint": seg.endpoint,
        "binding": name,
        "lineage": binding.lineage,
        "origin": seg.origin,
        "created": binding.created,
        "users": list(seg.users),
        "keys": list(seg.keys),
        "headers": list(seg.headers),
        "learning_paused": binding.learning_paused,
    }
