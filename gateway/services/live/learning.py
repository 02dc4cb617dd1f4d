"""The learning status of an endpoint (``GET /v1/learning/{endpoint}``, the feedback answer's ``ratings_to_step``).

The trainer publishes where each lineage's next version stands (``trainer/learning_status.py``: stage, queued
ratings, stage times, step-time estimate); :class:`LearningService` adds the ratings accepted since the trainer's
last read (signals stream entries after its ``read_through`` id, at most :data:`MAX_UNREAD` looked at) and the
running estimate of the time to the next version (:func:`estimate`). A tenant sees its own endpoints only: any
other name is a 404 ``model_not_found``, as in every route.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from livelora.clients.errors import ModelNotFoundError
from livelora.clients.types.learning import LearningStatus, SegmentStatus
from livelora.core.api_keys import Principal
from livelora.core.bus import redis_unavailable
from livelora.core.governance import held_out
from livelora.core.rails import wilson_interval
from livelora.core.redis_keys import KeyLayout

log = logging.getLogger(__name__)

#: Unread stream entries looked at per request (the trainer reads every second unless a step runs).
MAX_UNREAD = 2000
#: KTO never trains fewer ratings (its KL reference point needs mismatched pairs).
KTO_FLOOR = 2


def step_basis(st: LearningStatus) -> str:
    """How ``st.step_seconds`` was measured, for ``eta_basis``."""
    n = len(st.step_times)
    if n:
        return f"measured: median of the last {n} step(s), each trainer's first step left out as warm-up"
    return "measured: the trainer's first step only, warm-up included; later steps are usually faster"


def trainer_steps(st: LearningStatus, trainer: dict[str, Any]) -> None:
    """Where ``st``'s lineage has no warm step timed, take the step times of the trainer's document
    (``keys.learning_trainer``: its estimate over every lineage), in place."""
    if st.step_seconds is None or (not st.step_times and trainer.get("step_times")):
        st.step_seconds, st.step_times = trainer.get("step_seconds"), trainer.get("step_times") or []


def estimate(st: LearningStatus, now: float) -> None:
    """Set ``ratings_to_step``, ``eta_s`` and ``eta_basis`` of ``st`` in place (times in Unix s).

    One step costs ``step_seconds`` (measured by the trainer, :func:`step_basis`; unknown before any step: the
    gate's base measurement, which takes every free-form reply at full length, bounds no step's time). Waiting with
    a full batch: one step; with ≥ 2 ratings: what is left of ``max_wait_s`` after the oldest, plus one step;
    training or gate: what is left of one step since training began, or, past that, None with a basis saying the
    step takes longer than usual and for how long it has run; otherwise None (more ratings are needed). A step
    deferred for serving waits at least until its ``deferred_until``; ``deferred_s`` is set to the time since
    ``deferred_since``.
    """
    st.deferred_s = max(0.0, now - st.deferred_since) if st.deferred and st.deferred_since is not None else None
    if st.batch_size is not None:
        st.ratings_to_step = max(0, st.batch_size - st.ratings_waiting)
    step, basis = st.step_seconds, step_basis(st) if st.step_seconds is not None else ""
    st.eta_s, st.eta_basis = None, None
    if st.stage in ("training", "gate"):
        started = next((m.at for m in reversed(st.stages) if m.stage == "training"), st.since)
        if step is None:
            st.eta_basis = "no step timed yet"
        elif started is not None:
            if started + step > now:
                st.eta_s, st.eta_basis = started + step - now, f"{basis}; this step has run for {now - started:.0f} s"
            else:
                st.eta_basis = (
                    f"taking longer than usual: running for {now - started:.0f} s, a step usually takes {step:.0f} s "
                    f"({basis})"
                )
    elif st.stage == "waiting" and st.batch_size is not None:
        if st.ratings_waiting >= st.batch_size:
            wait = 0.0
        elif st.ratings_waiting >= KTO_FLOOR and st.oldest_waiting_at is not None and st.max_wait_s is not None:
            wait = max(0.0, st.oldest_waiting_at + st.max_wait_s - now)
        else:
            st.eta_basis = f"{st.ratings_to_step} more rating(s) start a step"
            return
        deferral = max(0.0, st.deferred_until - now) if st.deferred and st.deferred_until is not None else 0.0
        if step is not None:
            if deferral > wait:
                basis += " plus the deferral for serving"
            elif wait:
                basis += " plus the batch's remaining wait"
            st.eta_s, st.eta_basis = max(wait, deferral) + step, basis
        elif wait:
            st.eta_basis = (
                f"{st.ratings_to_step} more rating(s) start a step, or the batch's wait ends in {wait:.0f} s; "
                "no step timed yet"
            )
        else:
            st.eta_basis = "a step starts now; no step timed yet"


def base_first(st: LearningStatus, base: dict[str, Any], now: float) -> None:
    """While the gate's base measurement runs (``base``: the trainer's ``base_measure``: ``state``, ``check``,
    ``left_s`` as of ``at``) and a step waits for ratings or for it, say so in ``st.eta_basis`` with its progress,
    and add the time it has left (its last estimate less the time since) to ``st.eta_s`` (a step taken with no
    step timed yet: ``eta_s`` is at least that time), in place."""
    if base.get("state") != "measuring" or st.stage not in ("waiting", "training"):
        return
    left = base.get("left_s")
    left = None if left is None else left - (now - base.get("at", now))
    note = "the gate's base measurement runs first (once per store)"
    note += f": {base['check']}" if base.get("check") else ""
    if left is not None and left < 1:  # its estimate has run out while it still measures: no time to add
        note, left = note + ", finishing (taking longer than its estimate)", None
    elif left is not None:
        note += f", about {left:.0f} s left"
    if st.eta_s is not None and left is not None:
        st.eta_s += left
    elif left is not None and st.stage == "training":  # a step taken, waiting for it; the step itself not timed
        st.eta_s, st.eta_basis = left, f"{note}; then the step (not timed yet)"
        return
    st.eta_basis = f"{st.eta_basis}; {note}" if st.eta_basis else note


class LearningService:
    """Reads the trainer's learning status for the caller's endpoints.

    Args:
        client: asyncio Redis client (``decode_responses=True``).
        keys: key layout.
        registry: the adapter registry (endpoint bindings and who may see them).
    """

    def __init__(self, client: Any, keys: KeyLayout, registry: Any):
        self.client, self.keys, self.registry = client, keys, registry

    def _lineage(self, endpoint: str, principal: Principal | None) -> str:
        r = self.registry
        if endpoint not in r.current or not r.visible(endpoint, principal):
            r.endpoint_for(
                endpoint, principal
            )  # unknown or another tenant's: the 404 every route answers (ModelNotFoundError)
        if endpoint not in r.current or not r.versions_visible(endpoint, principal):  # a version; the shared base
            shown = [ep for ep in r.endpoints() if r.visible(ep, principal)]  # segments' bindings never
            raise ModelNotFoundError(
                f"model {endpoint!r} does not exist; served endpoints: {', '.join(shown) or 'none'}", param="model"
            )
        return r.bindings[endpoint].lineage

    async def _unread(self, lineage: str, read_through: str | None, every: int = 0) -> tuple[int, float | None]:
        """Ratings of ``lineage`` accepted after the trainer's last read, less those the gate will hold out (one
        in ``every``): ``(count, Unix s of the oldest)``."""
        eps = {ep for ep, b in self.registry.bindings.items() if b.lineage == lineage}
        start = f"({read_through}" if read_through else "-"
        entries = await self.client.xrange(self.keys.signals, min=start, max="+", count=MAX_UNREAD)
        n, oldest = 0, None
        for sid, fields in entries:
            try:
                ev = json.loads(fields.get("event") or "{}")
            except ValueError:
                continue
            if ev.get("type") == "rating" and ev.get("endpoint") in eps and not held_out(str(ev.get("id")), every):
                n += 1
                oldest = oldest if oldest is not None else int(sid.split("-")[0]) / 1000
        return n, oldest

    async def status(self, endpoint: str, principal: Principal | None = None) -> LearningStatus:
        """The stage of ``endpoint``'s next version, as ``principal`` may see it (``None``: an accepted rating's
        own endpoint, already checked).

        Raises:
            ModelNotFoundError: unknown endpoint, or another tenant's (404).
            UnavailableError: Redis unreachable (503).
        """
        lineage = self._lineage(endpoint, principal)
        with redis_unavailable():
            raw, trainer_raw = await self.client.mget(self.keys.learning(lineage), self.keys.learning_trainer)
            trainer = json.loads(trainer_raw) if trainer_raw else {}
            every = trainer.get("holdout_every") or 0
            unread, unread_oldest = await self._unread(lineage, trainer.get("read_through"), every)
        if raw:
            st = LearningStatus.model_validate_json(raw)
            st.endpoint = endpoint
        else:
            st = LearningStatus(endpoint=endpoint, lineage=lineage, stage="waiting" if trainer else "idle")
            st.batch_size, st.max_wait_s = trainer.get("batch_size"), trainer.get("max_wait_s")
        trainer_steps(st, trainer)
        if unread:
            st.ratings_waiting += unread
            if st.oldest_waiting_at is None:
                st.oldest_waiting_at = unread_oldest
            if st.stage in ("idle", "published", "rejected") and trainer:
                st.stage, st.since, st.check, st.detail, st.version, st.reason = "waiting", None, None, None, None, None
                st.stages = []
        recovered = trainer.get("recovered") or {}
        st.recovered_signals, st.recovered_at = recovered.get("total", 0), recovered.get("at")
        binding = self.registry.bindings[endpoint]
        st.serving = self.registry.current.get(endpoint)
        published = st.last.version if st.last is not None and st.last.stage == "published" else None
        st.loading = published if binding.mode == "follow" and published and published != st.serving else None
        base = trainer.get("base_measure") or {}
        estimate(st, time.time())
        st.paused = any(b.lineage == lineage and b.learning_paused for b in self.registry.bindings.values())
        if st.paused:
            st.eta_s, st.eta_basis = None, "learning is paused (POST /admin/endpoints/{name}/resume)"
        base_first(st, base, time.time())
        st.segments = await self.segments(endpoint)
        return st

    async def segments(self, endpoint: str) -> list[SegmentStatus]:
        """The segments of ``endpoint`` (an endpoint already checked for the caller), by name: lineage, versions,
        stage, and the liked share of the ratings counted for all their versions (live statistics).

        Raises:
            UnavailableError: Redis unreachable (503).
        """
        r, out = self.registry, []
        for name, b in sorted(r.bindings.items()):
            seg = b.segment
            if seg is None or seg.endpoint != endpoint:
                continue
            with redis_unavailable():
                raw = await self.client.get(self.keys.learning(b.lineage))
                rows = await r.stats.endpoint(name) if r.stats is not None else []
            doc = json.loads(raw) if raw else {}
            n, up = sum(x["ratings"] for x in rows), sum(x["thumbs_up"] for x in rows)
            ci = wilson_interval(up, n)
            out.append(
                SegmentStatus(
                    name=seg.name,
                    binding=name,
                    lineage=b.lineage,
                    origin=seg.origin,
                    serving=r.current.get(name),
                    versions=len(r.store.version_numbers(b.lineage)),
                    stage=doc.get("stage"),
                    deferred=doc.get("deferred"),
                    members=len(seg.users) + len(seg.keys) + len(seg.headers),
                    ratings=n,
                    liked=up / n if n else None,
                    liked_ci95=list(ci) if ci else None,
                )
            )
        return out

    async def ratings_to_step(self, endpoint: str, rating_id: str | None = None) -> tuple[int | None, str | None]:
        """``(more ratings that start a step of endpoint's lineage, what happens to rating rating_id)``; ``None``
        where unknown (no trainer has reported). Never raises."""
        try:
            st = await self.status(endpoint)
            every = json.loads(await self.client.get(self.keys.learning_trainer) or "{}").get("holdout_every") or 0
        except Exception as exc:  # the rating is accepted already; these figures are a courtesy
            log.debug("learning status of %s unavailable: %s", endpoint, exc)
            return None, None
        if st.batch_size is None:
            return st.ratings_to_step, None
        if rating_id is not None and held_out(rating_id, every):
            return st.ratings_to_step, (
                f"held out: the evaluation gate keeps one rating in {every} (by its id) to judge new versions; "
                "this one is not trained on"
            )
        if st.ratings_waiting >= st.batch_size:
            note = f"queued: {st.ratings_waiting} of {st.batch_size} ratings, a full batch: a step starts now"
        elif st.max_wait_s is not None:
            note = (
                f"queued: {st.ratings_waiting} of {st.batch_size} ratings; a step starts at {st.batch_size}, or on "
                f"fewer (a partial batch) once the oldest has waited {st.max_wait_s:g} s"
            )
        else:
            note = f"queued: {st.ratings_waiting} of {st.batch_size} ratings"
        if st.paused:
            note += "; learning is paused by an admin"
        return st.ratings_to_step, note
