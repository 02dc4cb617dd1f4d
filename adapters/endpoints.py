"""Endpoint bindings: which adapter lineage (and version) each served model name uses.

:class:`EndpointStore` reads and changes ``LIVELORA_HOME/endpoints.json`` (atomic writes under a file lock): a
binding is ``follow`` (serve the lineage's newest version that passes the gateway's checks) or ``pinned`` (serve
one version until promoted or rolled back), has an owning tenant (``null``: public) and a rollback stack.
Every change is appended to ``history.jsonl`` (:class:`EndpointHistory`) under the same lock. A name not in the
file is an implicit ``follow`` endpoint of the lineage of the same name. The file is the source of truth; Redis
notices only make gateways move sooner. The format: ``docs/internals/store-layout.md``.
"""

from __future__ import annotations

import builtins
import json
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from livelora.adapters.store import AdapterStore, validate_lineage
from livelora.clients.errors import BadRequestError, ConflictError, NotFoundError
from livelora.core.api_keys import DEFAULT_TENANT, validate_endpoint_name
from livelora.core.atomic import append_line, atomic_write_json, file_lock
from livelora.core.rails import GateThresholds, gate_allows

ENDPOINTS_FILE = "endpoints.json"
HISTORY_FILE = "history.jsonl"
#: Versions kept in an endpoint's rollback stack.
MAX_PREVIOUS = 50


class SegmentOf(BaseModel):
    """What makes a binding a segment of another endpoint: its parent, its name and its members (how requests
    are matched to it: ``docs/endpoints-and-keys.md``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(description="The parent endpoint (the shared lineage's).")
    name: str
    users: list[str] = Field(default_factory=list, description="OpenAI `user` values of the caller's tenant.")
    keys: list[str] = Field(default_factory=list, description="API key ids of the caller's tenant.")
    headers: list[str] = Field(default_factory=list, description="X-Livelora-Segment header values.")
    origin: str = Field(default="base", description="The shared version the segment's lineage started from.")


class EndpointBinding(BaseModel):
    """One endpoint's binding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lineage: str
    mode: Literal["follow", "pinned"] = "follow"
    version: int | None = Field(
        default=None, ge=1, description="Pinned version (mode 'pinned'; null = the base model)."
    )
    tenant: str | None = Field(default=None, description="Owner tenant; null = public (the base model's name).")
    previous: list[int | None] = Field(
        default_factory=list, description="Versions served before each promotion, newest last."
    )
    created: float | None = Field(default=None, description="Unix time the endpoint was created.")
    gate: GateThresholds | None = Field(
        default=None, description="Evaluation-gate thresholds (null: the defaults of GateThresholds)."
    )
    blocked: list[int] = Field(
        default_factory=list,
        description="Versions a follow endpoint skips: rolled back automatically (live statistics).",
    )
    learning_paused: bool = Field(
        default=False, description="No training step for its lineage while set: signals stay queued (admin pause)."
    )
    segment: SegmentOf | None = Field(default=None, description="Set on a segment's own binding (segments.py).")

    @property
    def thresholds(self) -> GateThresholds:
        """The gate thresholds that apply (the endpoint's own, else the defaults)."""
        return self.gate or GateThresholds()

    def visible_to(self, tenant: str) -> bool:
        """Whether ``tenant`` may use (sample, list) this endpoint: its owner, or anyone if public."""
        return self.tenant is None or self.tenant == tenant

    def administered_by(self, tenant: str) -> bool:
        """Whether ``tenant``'s admins may change it: its owner; public endpoints belong to ``default``."""
        return (self.tenant or DEFAULT_TENANT) == tenant


class HistoryEntry(BaseModel):
    """One line of ``history.jsonl``. Versions are written ``<lineage>@<n>``, ``base`` or ``follow``."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    time: float = Field(description="Unix time (seconds).")
    who: str = Field(description="Principal that made the change (tenant/key name).")
    tenant: str | None
    endpoint: str
    action: Literal[
        "create",
        "promote",
        "rollback",
        "gate",
        "configure",
        "forget",
        "quarantine",
        "auto_rollback",
        "canary",
        "prune",
        "pause",
        "resume",
        "segment",
    ]
    from_: str | None = Field(default=None, alias="from")
    to: str
    reason: str = ""
    details: dict | None = Field(
        default=None, description="Structured record of a rail's decision (gate checks, statistics, counts)."
    )


def version_label(lineage: str, version: int | None) -> str:
    """``<lineage>@<n>``, or ``base`` for ``None``."""
    return "base" if version is None else f"{lineage}@{version}"


def lineage_for_name(name: str) -> str:
    """The implicit lineage of an endpoint name: the name lower-cased, other characters than
    ``[a-z0-9._-]`` replaced by ``-`` (``SmolLM2/135M`` → ``smollm2-135m``).

    Raises:
        BadRequestError: nothing usable remains.
    """
    cleaned = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "-" for c in name.lower())
    cleaned = cleaned.strip("-._")[:64]
    return validate_lineage(cleaned)


class EndpointHistory:
    """``history.jsonl``: the audit log of endpoint changes, one :class:`HistoryEntry` a line. The caller appends
    under the endpoints' file lock, so a change and its line are written together."""

    def __init__(self, path: Path):
        self.path = path

    def entry(
        self,
        endpoint: str,
        action: str,
        *,
        who: str,
        to: str,
        from_: str | None = None,
        reason: str = "",
        details: dict | None = None,
        tenant: str | None = None,
    ) -> HistoryEntry:
        """An entry stamped with the current time (validated; not written yet: :meth:`write`)."""
        return HistoryEntry(
            time=time.time(),
            who=who,
            tenant=tenant,
            endpoint=endpoint,
            action=action,
            from_=from_,
            to=to,
            reason=reason,
            details=details,
        )

    def write(self, entry: HistoryEntry) -> HistoryEntry:
        """Append ``entry`` as one line; return it."""
        append_line(self.path, entry.model_dump_json(by_alias=True))
        return entry

    def read(self, endpoint: str | None = None, tenant: str | None = None) -> list[HistoryEntry]:
        """Entries, oldest first; filtered by endpoint and by the tenant that administers it."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                entry = HistoryEntry.model_validate_json(line)
            except ValueError:
                continue  # a torn last line after a crash
            if endpoint is not None and entry.endpoint != endpoint:
                continue
            if tenant is not None and (entry.tenant or DEFAULT_TENANT) != tenant:
                continue
            out.append(entry)
        return out


def check_reason(reason: str) -> None:
    """Raises BadRequestError: an audit ``reason`` over 1000 characters or with non-printable ones (newlines pass)."""
    if len(reason) > 1000 or not reason.replace("\n", " ").isprintable():
        raise BadRequestError("reason must be at most 1000 printable characters", param="reason")


class EndpointStore:
    """Read and change ``endpoints.json`` under ``home``; every audited change appends a line to :attr:`log`."""

    def __init__(self, home: Path | str, implicit: tuple[str, ...] | list[str] = ()):
        self.home = Path(home)
        self.path = self.home / ENDPOINTS_FILE
        #: ``history.jsonl``, written under this store's lock
        self.log = EndpointHistory(self.home / HISTORY_FILE)
        #: served base-model names whose implicit endpoints administration shows and may change (a change makes
        #: one explicit); names that are not valid endpoint names are left out
        self.implicit = tuple(n for n in implicit if _valid_implicit(n))

    def bindings(self) -> dict[str, EndpointBinding]:
        """Every explicit binding plus the implicit ones of :attr:`implicit` (lineage from the name, follow,
        public) that are not explicit."""
        explicit = self.all()
        implicit = {n: EndpointBinding(lineage=lineage_for_name(n)) for n in self.implicit if n not in explicit}
        return {**implicit, **explicit}

    def _implicit_binding(self, name: str) -> EndpointBinding | None:
        """The implicit binding of a served base-model name of :attr:`implicit` (``None`` for other names)."""
        return EndpointBinding(lineage=lineage_for_name(name)) if name in self.implicit else None

    def all(self) -> dict[str, EndpointBinding]:
        """Every explicit binding (empty when the file does not exist)."""
        if not self.path.is_file():
            return {}
        raw = json.loads(self.path.read_text())
        return {k: EndpointBinding.model_validate(v) for k, v in raw.get("endpoints", {}).items()}

    def get(self, endpoint: str) -> EndpointBinding:
        """The binding of ``endpoint``: explicit, else implicit (lineage from the name, mode follow, public)."""
        found = self.all().get(endpoint)
        return found if found is not None else EndpointBinding(lineage=lineage_for_name(endpoint))

    def _check(self, endpoint: str, binding: EndpointBinding) -> None:
        validate_endpoint_name(endpoint)
        validate_lineage(binding.lineage)
        if binding.mode == "follow" and binding.version is not None:
            raise BadRequestError("a follow endpoint has no pinned version", param="version")

    def set(self, endpoint: str, binding: EndpointBinding) -> None:
        """Create or replace an explicit binding (atomic, locked; no history line).

        Raises:
            BadRequestError: invalid endpoint or lineage name, or ``follow`` with a version.
        """
        self._check(endpoint, binding)
        with file_lock(self.path.with_suffix(".lock")):
            current = {k: v.model_dump() for k, v in self.all().items()}
            current[endpoint] = binding.model_dump()
            atomic_write_json(self.path, {"endpoints": current})

    # ------------------------------------------------------------------ audited changes

    def served_version(
        self, binding: EndpointBinding, store: AdapterStore | None = None, endpoint: str | None = None
    ) -> int | None:
        """The version an endpoint targets now: its pin, or (follow) the lineage's newest version that the
        evaluation gate did not reject for ``endpoint`` (any endpoint's default verdict when not given)."""
        if binding.mode == "pinned":
            return binding.version
        versions = (store or AdapterStore(self.home)).list(binding.lineage)
        allowed = [m for m in versions if gate_allows(m.gate, endpoint or "*") and m.version not in binding.blocked]
        return allowed[-1].version if allowed else None

    def record(
        self,
        endpoint: str,
        action: str,
        *,
        who: str,
        to: str,
        from_: str | None = None,
        reason: str = "",
        details: dict | None = None,
        tenant: str | None = None,
    ) -> HistoryEntry:
        """Append one history line for a decision that does not change the binding (a gate verdict, a
        quarantine, a deletion of a user's data, an automatic rollback's statistics)."""
        with file_lock(self.path.with_suffix(".lock")):
            return self.log.write(
                self.log.entry(
                    endpoint, action, who=who, to=to, from_=from_, reason=reason[:1000], details=details, tenant=tenant
                )
            )

    def block(
        self, endpoint: str, version: int, *, who: str, reason: str, to: str, details: dict | None = None
    ) -> HistoryEntry:
        """Add ``version`` to a follow endpoint's ``blocked`` list (an implicit endpoint becomes explicit) and
        append an ``auto_rollback`` history line (from the blocked version to ``to``) under one lock."""
        validate_endpoint_name(endpoint)
        with file_lock(self.path.with_suffix(".lock")):
            bindings = self.all()
            old = bindings.get(endpoint) or EndpointBinding(lineage=lineage_for_name(endpoint))
            new = old.model_copy(update={"blocked": sorted({*old.blocked, version})})
            current = {k: v.model_dump() for k, v in bindings.items()}
            current[endpoint] = new.model_dump()
            atomic_write_json(self.path, {"endpoints": current})
            entry = self.log.entry(
                endpoint,
                "auto_rollback",
                who=who,
                to=to,
                from_=version_label(new.lineage, version),
                reason=reason[:1000],
                details=details,
                tenant=new.tenant,
            )
            return self.log.write(entry)

    def set_gate(
        self, endpoint: str, thresholds: GateThresholds | None, *, tenant: str, who: str, reason: str = ""
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Set (``None``: reset to the defaults) an endpoint's gate thresholds; recorded as ``configure``.

        Raises:
            NotFoundError: unknown endpoint (or another tenant's).
        """
        binding = self._visible(endpoint, tenant)

        def update(old):
            return (old or binding).model_copy(update={"gate": thresholds})

        new, entry = self._change(endpoint, update, who=who, action="configure", reason=reason, tenant=tenant)
        return new, entry

    def set_learning(
        self, endpoint: str, paused: bool, *, tenant: str, who: str, reason: str = ""
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Pause (``paused``) or resume the training of an endpoint's lineage; recorded as ``pause``/``resume``.
        While any endpoint of a lineage is paused, trainers keep its signals queued and take no step.

        Raises:
            NotFoundError: unknown endpoint (or another tenant's).
        """
        binding = self._visible(endpoint, tenant)

        def update(old):
            return (old or binding).model_copy(update={"learning_paused": paused})

        action = "pause" if paused else "resume"
        return self._change(endpoint, update, who=who, action=action, reason=reason, tenant=tenant)

    def paused_lineages(self) -> builtins.set[str]:  # `set` here is the method above
        """Lineages with an endpoint whose learning is paused (:meth:`set_learning`)."""
        return {b.lineage for b in self.all().values() if b.learning_paused}

    def _change(
        self, endpoint: str, update, *, who: str, action: str, reason: str, tenant: str | None
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Apply ``update(old_or_None) -> new`` under the lock, write, append history."""
        validate_endpoint_name(endpoint)
        check_reason(reason)
        store = AdapterStore(self.home)
        with file_lock(self.path.with_suffix(".lock")):
            bindings = self.all()
            old = bindings.get(endpoint)
            new = update(old)
            self._check(endpoint, new)
            was = old if old is not None else self._implicit_binding(endpoint)  # implicit: made explicit now
            before = None if was is None else version_label(was.lineage, self.served_version(was, store, endpoint))
            if was is not None and was.mode == "follow":
                before = f"follow:{before}"
            after = (
                version_label(new.lineage, new.version)
                if new.mode == "pinned"
                else f"follow:{version_label(new.lineage, self.served_version(new, store, endpoint))}"
            )
            entry = self.log.entry(endpoint, action, who=who, to=after, from_=before, reason=reason, tenant=tenant)
            current = {k: v.model_dump() for k, v in bindings.items()}
            current[endpoint] = new.model_dump()
            atomic_write_json(self.path, {"endpoints": current})
            self.log.write(entry)
        return new, entry

    def create(
        self,
        endpoint: str,
        lineage: str,
        *,
        tenant: str,
        who: str,
        mode: str = "follow",
        version: int | None = None,
        reason: str = "",
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Create an endpoint owned by ``tenant``.

        Raises:
            BadRequestError: invalid names, or a version given with mode follow.
            ConflictError: the endpoint exists, or the lineage is bound by another tenant's endpoint.
            NotFoundError: a pinned version that does not exist.
        """
        validate_lineage(lineage)
        if mode not in ("follow", "pinned"):
            raise BadRequestError(f"mode must be 'follow' or 'pinned', not {mode!r}", param="mode")
        if version is not None:
            AdapterStore(self.home).get(lineage, version)
        others = [k for k, b in self.all().items() if b.lineage == lineage and not b.administered_by(tenant)]
        if others:
            raise ConflictError(f"lineage {lineage!r} is not available; choose another lineage name", param="lineage")

        def update(old):
            if old is not None:
                # the same answer whoever holds the name: it does not tell that another tenant's endpoint exists
                raise ConflictError(
                    f"endpoint name {endpoint!r} is not available; choose another name", param="endpoint"
                )
            return EndpointBinding(
                lineage=lineage,
                mode=mode,
                version=version if mode == "pinned" else None,
                tenant=tenant,
                created=time.time(),
            )

        return self._change(endpoint, update, who=who, action="create", reason=reason, tenant=tenant)

    def promote(
        self, endpoint: str, version: int | None, *, tenant: str, who: str, reason: str = "", follow: bool = False
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Pin ``endpoint`` to ``version`` of its lineage (``None``: the base model), or with ``follow``
        let it follow the lineage's newest version again. What it served before is pushed on its
        rollback stack.

        Raises:
            NotFoundError: unknown endpoint (or another tenant's), or no such version.
        """
        binding = self._visible(endpoint, tenant)
        if version is not None:
            AdapterStore(self.home).get(binding.lineage, version)
        store = AdapterStore(self.home)

        def update(old):
            old = old or binding
            served = self.served_version(old, store, endpoint)
            stack = [*old.previous, served][-MAX_PREVIOUS:]
            if follow:
                return old.model_copy(update={"mode": "follow", "version": None, "previous": stack})
            return old.model_copy(update={"mode": "pinned", "version": version, "previous": stack})

        return self._change(endpoint, update, who=who, action="promote", reason=reason, tenant=tenant)

    def rollback(
        self, endpoint: str, *, tenant: str, who: str, reason: str = ""
    ) -> tuple[EndpointBinding, HistoryEntry]:
        """Pin ``endpoint`` to the version it served before its last promotion (pops the rollback stack).

        Raises:
            NotFoundError: unknown endpoint, or the previous version was deleted since.
            ConflictError: nothing to roll back to.
        """
        binding = self._visible(endpoint, tenant)
        store = AdapterStore(self.home)

        def update(old):
            old = old or binding
            if not old.previous:
                raise ConflictError(f"endpoint {endpoint!r} has no earlier version to roll back to", param="endpoint")
            target = old.previous[-1]
            if target is not None:
                store.get(old.lineage, target)
            return old.model_copy(update={"mode": "pinned", "version": target, "previous": old.previous[:-1]})

        return self._change(endpoint, update, who=who, action="rollback", reason=reason, tenant=tenant)

    def _visible(self, endpoint: str, tenant: str) -> EndpointBinding:
        """The binding of an endpoint ``tenant`` administers (explicit, or the implicit public base one).

        Raises:
            NotFoundError: unknown, or administered by another tenant.
        """
        validate_endpoint_name(endpoint)
        binding = self.bindings().get(endpoint)
        if binding is None or not binding.administered_by(tenant):
            raise NotFoundError(f"endpoint {endpoint!r} does not exist", param="endpoint")
        return binding

    def history(self, endpoint: str | None = None, tenant: str | None = None) -> list[HistoryEntry]:
        """Audit entries, oldest first; filtered by endpoint and by the tenant that administers it."""
        return self.log.read(endpoint, tenant)

    def targets(self, store: AdapterStore | None = None) -> dict[str, list[str]]:
        """``<lineage>@<n>`` → endpoints whose current target it is (pins, and follow endpoints' newest)."""
        store = store or AdapterStore(self.home)
        out: dict[str, list[str]] = {}
        for name, binding in self.bindings().items():
            v = self.served_version(binding, store, name)
            if v is not None:
                out.setdefault(f"{binding.lineage}@{v}", []).append(name)
        return out


def _valid_implicit(name: str) -> bool:
    """Whether ``name`` can be an implicit endpoint (a valid endpoint name with a valid implicit lineage)."""
    try:
        validate_endpoint_name(name)
        lineage_for_name(name)
    except BadRequestError:
        return False
    return True


def record_install_owners(home: Path | str, base_lineage: str) -> None:
    """At a gateway's start: the base model's lineage belongs to ``default`` (claimed before anything else can
    claim it), then every endpoint binding's lineage not yet recorded goes to the binding's tenant (stores made
    before owner records existed; a lineage taken already keeps its owner)."""
    from livelora.core.api_keys import DEFAULT_TENANT
    from livelora.core.owners import OwnerStore

    owners = OwnerStore(home)
    owners.claim("lineage", base_lineage, DEFAULT_TENANT)
    for binding in EndpointStore(home).all().values():
        if owners.owner("lineage", binding.lineage) is None:
            owners.claim("lineage", binding.lineage, binding.tenant or DEFAULT_TENANT)
