"""What the admin console's endpoint and version pages show (:mod:`livelora.gateway.api.console`), read through
the same services as ``/admin`` (:class:`~livelora.gateway.services.tenants.admin.GatewayAdmin`, scoped to the caller's
tenant), the live statistics and the learning status. Pure reads: every change goes through ``GatewayAdmin``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from livelora.adapters.endpoints import HistoryEntry
from livelora.clients.errors import LiveloraError, NotFoundError
from livelora.core.api_keys import DEFAULT_TENANT, Principal
from livelora.core.rails import wilson_interval
from livelora.gateway.services.tenants.admin import GatewayAdmin

log = logging.getLogger(__name__)

#: History actions that change what an endpoint serves (the marks of the liked-share chart).
SERVING_CHANGES = ("create", "promote", "rollback", "auto_rollback", "canary")


def bucket_shares(ratings: list[tuple[float, str, bool]], buckets: int, end: float) -> list[dict[str, Any]]:
    """Liked share per time bucket: ``ratings`` ``(Unix s, version, up)`` split into ``buckets`` equal spans from
    the first rating to ``end``; each ``{"start", "end", "ratings", "share"}`` (``share`` None when empty)."""
    if not ratings:
        return []
    start = ratings[0][0]
    width = max((end - start) / buckets, 1e-9)
    out = [{"start": start + i * width, "end": start + (i + 1) * width, "ratings": 0, "up": 0} for i in range(buckets)]
    for t, _, up in ratings:
        b = out[min(buckets - 1, int((t - start) / width))]
        b["ratings"] += 1
        b["up"] += int(up)
    return [{**b, "share": b["up"] / b["ratings"] if b["ratings"] else None} for b in out]


def across(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sums of per-version statistics ``rows`` (``{"requests", "ratings", "thumbs_up", "thumbs_up_rate",
    "ci95"}``, the 95 % Wilson interval of the pooled ratings)."""
    n, up = sum(r["ratings"] for r in rows), sum(r["thumbs_up"] for r in rows)
    ci = wilson_interval(up, n)
    return {
        "requests": sum(r["requests"] for r in rows),
        "ratings": n,
        "thumbs_up": up,
        "thumbs_up_rate": up / n if n else None,
        "ci95": list(ci) if ci else None,
    }


@dataclass
class ConsoleContext:
    """What one console request reads with.

    Attributes:
        admin: the ``/admin`` service of the caller.
        principal: the caller.
        learning: the learning status service (``None`` without the live loop).
        canary_share: ``LIVELORA_CANARY_SHARE`` (share of requests a new version's canary gets).
        texts: token texts of the served model (decodes rated completions); ``None``: not started.
        sessions: the training-session service; ``None``: not started.
        metering: the usage service; ``None``: not started.
        open_mode: the gateway runs without keys.
        public_url: base of the signed download URLs.
    """

    admin: GatewayAdmin
    principal: Principal
    learning: Any = None
    canary_share: float = 0.0
    texts: Any = None
    sessions: Any = None
    metering: Any = None
    open_mode: bool = False
    public_url: str = ""

    @property
    def stats(self):
        """The live statistics (``None`` without Redis / the live loop)."""
        reg = self.admin.registry
        return reg.stats if reg is not None else None


class ConsoleViews:
    """Endpoints, one endpoint, a lineage's versions, one version: each a dict for its template."""

    def __init__(self, ctx: ConsoleContext):
        self.ctx, self.admin = ctx, ctx.admin

    def _versions_of(self, lineage: str) -> list[dict[str, Any]]:
        try:
            return self.admin.list_adapters(lineage)
        except NotFoundError:  # a lineage with no owner record yet (no version made): nothing to list
            return []

    def serving_now(self, name: str, stored: str) -> str:
        """What this gateway serves for ``name`` now (the registry's pointer; the store's target without one)."""
        reg = self.admin.registry
        if reg is not None and name in reg.current:
            return reg.current[name] or "base"
        return stored

    async def _liked(self, name: str, version: str) -> dict[str, Any] | None:
        stats = self.ctx.stats
        if stats is None:
            return None
        try:
            return await stats.version(name, version)
        except Exception as exc:  # Redis down: the page shows the rest
            log.warning("live statistics of %s unavailable: %s", name, exc)
            return None

    async def _learning(self, name: str):
        if self.ctx.learning is None:
            return None
        try:
            return await self.ctx.learning.status(name, self.ctx.principal)
        except LiveloraError:  # not served by this gateway yet, or Redis down
            return None

    def _canary(self, name: str) -> dict[str, Any] | None:
        stats = self.ctx.stats
        c = stats.canaries.get(name) if stats is not None else None
        return None if c is None else {**c, "share": self.ctx.canary_share}

    async def _per_version(self, name: str, serving: str) -> list[dict[str, Any]]:
        """Statistics of every version ``name`` served or had rated, the serving one included (zeros) even
        before its first request; ``[]`` without live statistics."""
        stats = self.ctx.stats
        if stats is None:
            return []
        try:
            rows = await stats.endpoint(name)
        except Exception as exc:  # Redis down: the page shows the rest
            log.warning("live statistics of %s unavailable: %s", name, exc)
            return []
        if serving not in {r["version"] for r in rows}:
            rows.append(await stats.version(name, serving))
        return rows

    async def endpoint_row(self, info: dict[str, Any], last: HistoryEntry | None) -> dict[str, Any]:
        """One endpoint's row: the binding, what it serves, its canary, liked share with the 95 % interval
        (across its versions, ``liked``; and of the serving one, ``liked_serving``), the learning stage of its
        next version, the last change, the versions it may be promoted to and statistics per version."""
        serving = self.serving_now(info["name"], info["serving"])
        per_version = await self._per_version(info["name"], serving)
        return {
            **info,
            "mine": (info.get("tenant") or DEFAULT_TENANT) == self.ctx.principal.tenant,  # else: the operator's view
            "serving": serving,
            "per_version": per_version,
            "liked": across(per_version) if self.ctx.stats is not None else None,
            "liked_serving": next((r for r in per_version if r["version"] == serving), None),
            "canary": self._canary(info["name"]),
            "learning": await self._learning(info["name"]),
            "last_change": last,
            "versions": [v["name"] for v in self._versions_of(info["lineage"])],
        }

    async def endpoints(self) -> list[dict[str, Any]]:
        """Every endpoint the caller's tenant administers (the operator: every tenant's), as :meth:`endpoint_row`
        rows."""
        last: dict[str, HistoryEntry] = {}
        for entry in self.admin.history():
            last[entry.endpoint] = entry
        return [await self.endpoint_row(info, last.get(info["name"])) for info in self.admin.list_endpoints()]

    async def endpoint(self, name: str) -> dict[str, Any]:
        """One endpoint: its row, its history (newest first), statistics per version and the liked-share series.

        Raises:
            NotFoundError: unknown or another tenant's endpoint.
        """
        info = self.admin.get_endpoint(name)
        history = self.admin.history(name)
        row = await self.endpoint_row(info, history[-1] if history else None)
        stats = self.ctx.stats
        ratings = await stats.ratings_over_time(name) if stats is not None else []
        return {
            "endpoint": row,
            "history": list(reversed(history)),
            "per_version": row["per_version"],
            "buckets": bucket_shares(ratings, 24, time.time()),
            "marks": self.serving_marks(name, info, history),
        }

    def serving_marks(self, name: str, info: dict[str, Any], history: list[HistoryEntry]) -> list[tuple[float, str]]:
        """``(Unix s, label)`` of each moment ``name``'s served version changed: its audited changes, and for a
        follow endpoint each version of its lineage published since it was created."""
        marks = [(e.time, f"{e.action} → {e.to}") for e in history if e.action in SERVING_CHANGES]
        if info["mode"] == "follow":
            since = info.get("created") or 0
            marks += [(v["created"], f"published {v['name']}") for v in self._versions_of(info["lineage"])]
            marks = [m for m in marks if m[0] >= since]
        return sorted(marks)

    async def lineage(self, lineage: str) -> dict[str, Any]:
        """A lineage's versions (oldest first, :func:`~.version_admin.version_rows`), the statistics of each on
        every endpoint bound to the lineage, and its training loss per step.

        Raises:
            NotFoundError: a lineage the caller's tenant does not own. BadRequestError: an invalid name.
        """
        rows = self.admin.list_adapters(lineage)
        stats = self.ctx.stats
        live: dict[str, list[dict[str, Any]]] = {}
        for ep in rows[0]["endpoints"] if rows else []:
            for s in await stats.endpoint(ep) if stats is not None else []:
                live.setdefault(s["version"], []).append({**s, "endpoint": ep})
        return {
            "lineage": lineage,
            "versions": rows,
            "live": live,
            "loss": [(r["step"], r["metrics"]["loss:sum"]) for r in rows if "loss:sum" in r["metrics"]],
        }

    async def version(self, name: str) -> dict[str, Any]:
        """One version: manifest, files and their total size, sha256 check, gate checks, and its live statistics
        on every endpoint bound to its lineage.

        Raises:
            NotFoundError: missing or another tenant's version. BadRequestError: a malformed name.
        """
        m = await self.admin.show_adapter(name)
        bound = next((r["endpoints"] for r in self._versions_of(m["lineage"]) if r["name"] == name), [])
        live = []
        for ep in bound:
            s = await self._liked(ep, name)
            if s is not None:
                live.append({**s, "endpoint": ep})
        mine = self.admin.store.owners.owns("lineage", m["lineage"], self.ctx.principal.tenant)
        return {"version": m, "size": sum(m["files"].values()), "live": live, "endpoints": bound, "mine": mine}
