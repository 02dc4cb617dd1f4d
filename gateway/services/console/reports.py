"""What the admin console's charts, feedback and sessions pages show, scoped to the caller's tenant (the
operator also sees every tenant's usage and this process's HTTP metrics, as ``/admin/usage`` and ``/metrics``
give it). Pure reads over the live statistics, the signals stream and the dataset of record, the store, the
training-session service and the usage metering.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from livelora.clients.errors import LiveloraError
from livelora.clients.types.tinker_rest import SessionSearchRequest
from livelora.core.api_keys import DEFAULT_TENANT
from livelora.core.governance import rater_of, signals_dir
from livelora.gateway.services.console.views import ConsoleContext, ConsoleViews, bucket_shares

log = logging.getLogger(__name__)

#: Signals shown on the feedback page; day files of the dataset of record read at most to find them.
LATEST_SIGNALS, MAX_DAY_FILES = 50, 7
#: Hours of usage and of version updates charted.
CHART_HOURS = 48


def latency_by_route(histogram: Any) -> list[dict[str, Any]]:
    """``[{"route", "requests", "mean_s", "p50_s", "p95_s"}]`` and the same times in words (``mean``, ``p50``,
    ``p95``) from a Prometheus histogram labelled by method, route and status (this process's samples; a quantile
    is the upper bound of the bucket that holds it)."""
    routes: dict[str, dict[str, Any]] = {}
    for family in histogram.collect():
        for s in family.samples:
            route = f"{s.labels.get('method')} {s.labels.get('route')}"
            r = routes.setdefault(route, {"count": 0.0, "sum": 0.0, "buckets": {}})
            if s.name.endswith("_count"):
                r["count"] += s.value
            elif s.name.endswith("_sum"):
                r["sum"] += s.value
            elif s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                r["buckets"][le] = r["buckets"].get(le, 0.0) + s.value

    def quantile(buckets: dict[float, float], count: float, q: float) -> float | None:
        return next((le for le, n in sorted(buckets.items()) if n >= q * count), None) if count else None

    def bound(buckets: dict[float, float], le: float | None) -> str:
        """``≤ 25 ms`` (the bound of the bucket that holds the quantile), ``> 10 s`` past the last finite bound."""
        if le is None:
            return "-"
        finite = max((b for b in buckets if b != float("inf")), default=0.0)
        return f"≤ {seconds_for_people(le)}" if le != float("inf") else f"> {seconds_for_people(finite)}"

    return sorted(
        (
            {
                "route": route,
                "requests": int(r["count"]),
                "mean_s": r["sum"] / r["count"] if r["count"] else None,
                "p50_s": (p50 := quantile(r["buckets"], r["count"], 0.5)),
                "p95_s": (p95 := quantile(r["buckets"], r["count"], 0.95)),
                "mean": seconds_for_people(r["sum"] / r["count"]) if r["count"] else "-",
                "p50": bound(r["buckets"], p50),
                "p95": bound(r["buckets"], p95),
            }
            for route, r in routes.items()
        ),
        key=lambda r: -r["requests"],
    )


def seconds_for_people(s: float) -> str:
    """``0.0052`` → ``5.2 ms``, ``0.0123`` → ``12 ms``, ``2.345`` → ``2.3 s``, ``120`` → ``120 s``."""
    if round(s, 3) < 1:
        return f"{s * 1000:.1f} ms" if s < 0.00995 else f"{s * 1000:.0f} ms"
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


class ConsoleReports:
    """Charts, feedback, and sessions with usage: each a dict for its template."""

    def __init__(self, ctx: ConsoleContext):
        self.ctx, self.admin, self.views = ctx, ctx.admin, ConsoleViews(ctx)

    @property
    def operator(self) -> bool:
        return self.ctx.open_mode or "operator" in self.ctx.principal.roles

    # ------------------------------------------------------------------ charts
    async def charts(self) -> dict[str, Any]:
        """Liked share over time per endpoint (with the moments its version changed), training loss per step per
        lineage, requests per endpoint and version, tokens and new versions per hour, and (operator) this
        process's HTTP requests and latency by route."""
        now, stats = time.time(), self.ctx.stats
        liked, requests = [], []
        for info in self.admin.list_endpoints():
            name = info["name"]
            ratings = await stats.ratings_over_time(name) if stats is not None else []
            if ratings:
                marks = self.views.serving_marks(name, info, self.admin.history(name))
                liked.append({"endpoint": name, "buckets": bucket_shares(ratings, 24, now), "marks": marks})
            for s in await stats.endpoint(name) if stats is not None else []:
                requests.append({"endpoint": name, **s})
        versions = self.admin.list_adapters()
        loss: dict[str, list[tuple[int, float]]] = {}
        for v in versions:
            if "loss:sum" in v["metrics"]:
                loss.setdefault(v["lineage"], []).append((v["step"], v["metrics"]["loss:sum"]))
        hour0 = int(now // 3600 - CHART_HOURS + 1) * 3600
        updates = [0] * CHART_HOURS
        for v in versions:
            if v["created"] >= hour0:
                updates[min(CHART_HOURS - 1, int((v["created"] - hour0) // 3600))] += 1
        latency = None
        if self.operator:
            from livelora.core import metrics

            latency = latency_by_route(metrics.REQUEST_LATENCY)
        return {
            "liked": liked,
            "loss": loss,
            "requests": requests,
            "tokens": await self._tokens_per_hour(hour0),
            "updates": {"hour0": hour0, "counts": updates},
            "latency": latency,
        }

    async def _tokens_per_hour(self, hour0: float) -> dict[str, list[tuple[str, int]]]:
        """kind → ``[(UTC hour YYYYMMDDHH, tokens)]`` of the caller's tenant (operator: every tenant) since
        ``hour0``."""
        m = self.ctx.metering
        if m is None:
            return {}
        try:
            report = await m.usage(
                self.ctx.principal, start=str(hour0), group_by="hour,kind", open_mode=self.ctx.open_mode
            )
        except LiveloraError as exc:
            log.warning("usage unavailable for the console: %s", exc)
            return {}
        out: dict[str, list[tuple[str, int]]] = {}
        for row in sorted(report["data"], key=lambda r: r["hour"]):
            out.setdefault(row["kind"], []).append((row["hour"], row["tokens"]))
        return out

    # ------------------------------------------------------------------ feedback
    async def feedback(self, limit: int = LATEST_SIGNALS) -> dict[str, Any]:
        """The latest signals on the caller's endpoints (stream and dataset of record, newest first) with their
        completion text and rater weight, the quarantined events, and the rater agreement rows."""
        raters = await self.admin.raters()
        weight = {(r["lineage"], r["rater"]): r["weight"] for r in raters}
        events = self._recorded(limit)
        events.update(await self._streamed(limit))
        rows = []
        for ev in sorted(events.values(), key=lambda e: e.get("created", 0), reverse=True)[:limit]:
            lineage = self.admin.store.endpoints.get(ev["endpoint"]).lineage
            rows.append({**ev, "rater": rater_of(ev), "weight": weight.get((lineage, rater_of(ev))), **self._text(ev)})
        return {"signals": rows, "quarantine": self.admin.quarantine(), "raters": raters}

    def _mine(self, ev: Any) -> bool:
        return (
            isinstance(ev, dict)
            and self.admin.store._owns_endpoint(ev.get("endpoint", ""))
            and (ev.get("caller") or DEFAULT_TENANT) == self.admin.store.tenant
        )

    def _recorded(self, limit: int) -> dict[str, dict[str, Any]]:
        """The newest ``limit`` of the caller's events in the dataset of record (the trainers' copy), by id."""
        out: dict[str, dict[str, Any]] = {}
        files = sorted(signals_dir(self.admin.store.home).glob("[0-9]*.jsonl"), reverse=True)[:MAX_DAY_FILES]
        for path in files:
            for line in reversed(Path(path).read_text().splitlines()):
                try:
                    ev = json.loads(line).get("event")
                except ValueError:
                    continue
                if self._mine(ev):
                    out[ev["id"]] = ev
                    if len(out) >= limit:
                        return out
        return out

    async def _streamed(self, limit: int) -> dict[str, dict[str, Any]]:
        """The caller's events still on the signals stream (accepted, not yet trained), newest first, by id."""
        reg = self.admin.registry
        if reg is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        try:
            entries = await reg.client.xrevrange(reg.keys.signals, count=20 * limit)
        except Exception as exc:
            log.warning("signals stream unreadable for the console: %s", exc)
            return out
        for _, fields in entries:
            try:
                ev = json.loads(fields.get("event") or "{}")
            except ValueError:
                continue
            if self._mine(ev) and len(out) < limit:
                out[ev["id"]] = ev
        return out

    def _text(self, ev: dict[str, Any]) -> dict[str, Any]:
        """What a signal rated, as text: a rating's completion, a preference's two replies, a demonstration's
        reply (decoded from the exact token ids the event carries)."""
        decode = self.ctx.texts.decode if self.ctx.texts is not None else (lambda ids: f"<{len(ids)} tokens>")
        kind = ev.get("type")
        if kind == "rating":
            return {"text": decode(ev.get("completion_token_ids") or [])}
        if kind == "preference":
            chosen = ev.get("chosen") or decode(ev.get("chosen_token_ids") or [])
            rejected = ev.get("rejected") or decode(ev.get("rejected_token_ids") or [])
            return {"text": f"chosen: {chosen}", "text2": f"rejected: {rejected}"}
        messages = ev.get("messages") or [{}]
        return {"text": messages[-1].get("content", "")}

    # ------------------------------------------------------------------ sessions and usage
    async def sessions(self) -> dict[str, Any]:
        """The tenant's training sessions (newest first, each ``alive`` or not) with their runs, each run's
        checkpoints with a signed archive URL, and usage against the quotas (the operator: every tenant's usage)."""
        svc, out = self.ctx.sessions, {"sessions": [], "runs": [], "usage": [], "quotas": []}
        if svc is not None:
            found = await svc.search_sessions(SessionSearchRequest(limit=50), self.ctx.principal)
            for s in found.sessions:  # alive: its record still exists (it holds a max_sessions slot)
                alive = bool(await svc.redis.exists(svc.keys.session(s.session_id)))
                out["sessions"].append({**s.model_dump(mode="json"), "alive": alive})
            runs = await svc.checkpoints.list_training_runs(self.ctx.principal, limit=50)
            for run in runs.training_runs:
                ckpts = []
                for c in svc.checkpoints.list_checkpoints(run.training_run_id).checkpoints:
                    url = None
                    if c.checkpoint_type != "external":
                        url = svc.checkpoints.archive_url(run.training_run_id, c.checkpoint_id, self.ctx.public_url).url
                    ckpts.append({**c.model_dump(mode="json"), "archive_url": url})
                out["runs"].append({**run.model_dump(mode="json"), "checkpoints": ckpts})
        m = self.ctx.metering
        if m is not None:
            month = time.time() - 30 * 86400
            group = "tenant,kind" if self.operator else "kind"
            try:
                report = await m.usage(
                    self.ctx.principal, start=str(month), group_by=group, open_mode=self.ctx.open_mode
                )
                out["usage"] = report["data"]
                tenants = sorted({r.get("tenant", self.ctx.principal.tenant) for r in report["data"]})
                tenants = tenants if self.operator and tenants else [self.ctx.principal.tenant]
                out["quotas"] = [await m.quotas.report(t) for t in tenants]
            except LiveloraError as exc:
                log.warning("usage unavailable for the console: %s", exc)
        return out
