"""The batching scheduler of the live loop: when the signals buffered for a lineage become a training step.

:class:`BatchScheduler` keeps one queue per lineage and signal kind (ratings → KTO, demonstrations → SFT,
preference pairs → DPO; only a rater's latest rating of a completion is kept) and hands out a :class:`Batch`
when a queue reaches its minimum size or its oldest event has waited ``max_wait_s``, with no rater over
``rater_max_batch_share`` of it. :func:`kto_class_weights` balances KTO's classes (Ethayarajh et al. 2024,
Eq. 8). Pure bookkeeping (no Redis, no torch). The thresholds are the trainer's
:class:`~livelora.trainer.settings.TrainingSection`; the rules and their sources:
``docs/internals/live-training.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from livelora.clients.types.signals import DemonstrationEvent, PreferenceEvent, RatingEvent
from livelora.trainer.settings import TrainingSection

Kind = Literal["kto", "sft", "dpo"]
Event = RatingEvent | PreferenceEvent | DemonstrationEvent


def kto_class_weights(n_desirable: float, n_undesirable: float) -> tuple[float, float]:
    """``(λ_D, λ_U)`` with λ_D·n_D = λ_U·n_U (ratio 1, inside paper Eq. 8's [1, 4/3]); the minority class
    gets weight 1 and the majority ``n_minority / n_majority``. With one class absent: ``(1, 1)``. The counts
    may be sums of example weights (rater agreement, :meth:`~livelora.trainer.signal_governor.FeedbackGovernor.weigh`).

    Example: 6 desirable, 2 undesirable → (1/3, 1).
    """
    if n_desirable <= 0 or n_undesirable <= 0:
        return 1.0, 1.0
    if n_desirable >= n_undesirable:
        return n_undesirable / n_desirable, 1.0
    return 1.0, n_desirable / n_undesirable


@dataclass
class Batch:
    """One training step's worth of events of one lineage and kind.

    Attributes:
        stream_ids: the stream ids of ``events`` (acknowledged once the version is written).
        desirable_weight / undesirable_weight: KTO λ_D, λ_U (1.0 for other kinds).
        example_weights: per event, the weight of its loss term in [0, 1] (its rater's agreement weight, set
            by :meth:`~livelora.trainer.signal_governor.FeedbackGovernor.weigh`); ``None``: all 1.
        rater_weights: every known rater of the lineage → its weight when the batch was weighed (the gate leaves
            raters below ½ out of its signal check); ``None``: not weighed.
        min_size: the kind's minimum batch (``kto_min_batch``, ...); ``waited``: the step started on fewer events
            because the oldest had waited ``max_wait_s`` (a partial batch).
    """

    lineage: str
    kind: Kind
    events: list[Event]
    stream_ids: list[str]
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    example_weights: list[float] | None = None
    rater_weights: dict[str, float] | None = None
    min_size: int | None = None
    waited: bool = False

    @property
    def endpoint(self) -> str:
        """The endpoint of the newest event (a lineage may serve several endpoints)."""
        return self.events[-1].endpoint


@dataclass
class _Queue:
    items: OrderedDict[str, tuple[str, Event, float]] = field(default_factory=OrderedDict)  # key → (sid, ev, arrival)
    read: dict[str, float] = field(default_factory=dict)  # stream id → when this worker queued it

    def oldest(self) -> float:
        return min(t for _, _, t in self.items.values())


class BatchScheduler:
    """Queues events per (lineage, kind) and says which batches are due.

    Args:
        config: thresholds (``kto_min_batch``, ``sft_min_batch``, ``dpo_min_batch``, ``max_batch``,
            ``max_wait_s``); default: the environment's.
    """

    def __init__(self, config: TrainingSection | None = None):
        self.config = config or TrainingSection()
        self._queues: dict[tuple[str, Kind], _Queue] = {}
        self._taken_at: dict[str, float] = {}  # lineage → when its last batch was taken (round-robin order)

    @staticmethod
    def kind_of(event: Event) -> Kind:
        """``kto`` for ratings, ``sft`` for demonstrations, ``dpo`` for preferences."""
        return {"rating": "kto", "demonstration": "sft", "preference": "dpo"}[event.type]

    def add(self, lineage: str, stream_id: str, event: Event, now: float, arrived: float | None = None) -> list[str]:
        """Queue one event read at ``now`` (seconds) that arrived at ``arrived`` (default ``now``; the worker
        passes :func:`arrival`, so an event read late, after a step, has waited since it was accepted: its
        ``max_wait_s`` counts from then). Returns the stream ids it supersedes (to acknowledge).

        A rating replaces the queued rating with the same ``rating_key`` (the newer stream id wins, so a
        redelivered older event never replaces a newer one). Re-adding a queued stream id changes nothing.
        """
        kind = self.kind_of(event)
        q = self._queues.setdefault((lineage, kind), _Queue())
        key = event.rating_key if isinstance(event, RatingEvent) else stream_id
        old = q.items.get(key)
        if old is not None:
            if old[0] == stream_id or _sid_key(old[0]) > _sid_key(stream_id):
                return [stream_id] if old[0] != stream_id else []
            del q.items[key]
            q.items[key] = (stream_id, event, now if arrived is None else arrived)
            q.read[stream_id] = now
            return [old[0]]
        q.items[key] = (stream_id, event, now if arrived is None else arrived)
        q.read[stream_id] = now
        return []

    def pending(self) -> list[str]:
        """Stream ids of every queued event."""
        return [sid for q in self._queues.values() for sid, _, _ in q.items.values()]

    def queued(self, lineage: str) -> dict[str, tuple[int, float | None]]:
        """``{kind: (events queued, receive time of the oldest or None)}`` of one lineage, for every kind."""
        out: dict[str, tuple[int, float | None]] = {}
        for kind in ("kto", "sft", "dpo"):
            q = self._queues.get((lineage, kind))
            out[kind] = (len(q.items), q.oldest()) if q is not None and q.items else (0, None)
        return out

    def __len__(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    def due(self, now: float, hold: set[str] | frozenset[str] = frozenset()) -> list[Batch]:
        """Remove and return the batches ready at ``now`` (seconds, same clock as :meth:`add`), in :meth:`ready`'s
        order; the queues of the lineages in ``hold`` (learning paused by an admin) stay as they are."""
        out = [self.take(lineage, kind, now) for lineage, kind in self.ready(now, hold)]
        return [b for b in out if b is not None]

    def ready(self, now: float, hold: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, Kind]]:
        """``(lineage, kind)`` of every queue that makes a step at ``now`` (its minimum batch, or ``max_wait_s``
        waited with at least the kind's floor; lineages in ``hold`` left out), nothing removed. Round-robin order:
        first the lineage whose last step was taken longest ago (never: first), then the one whose oldest event
        has waited longest, so a lineage with a steady flow of signals (a busy segment) cannot starve another
        (the shared lineage) when steps are deferred and only some of the ready ones run."""
        c, out = self.config, []
        for (lineage, kind), q in self._queues.items():
            n = len(q.items)
            if len(q.read) > n:  # read times of events that left the queue (trained, superseded, handed back)
                q.read = {sid: t for sid, t in q.read.items() if sid in {item[0] for item in q.items.values()}}
            if n == 0 or lineage in hold:
                continue
            threshold = {"kto": c.kto_min_batch, "sft": c.sft_min_batch, "dpo": c.dpo_min_batch}[kind]
            floor = 2 if kind == "kto" else 1
            if n >= threshold or (now - q.oldest() >= c.max_wait_s and n >= floor):
                out.append(((self._taken_at.get(lineage, float("-inf")), q.oldest()), (lineage, kind)))
        return [key for _, key in sorted(out, key=lambda x: x[0])]

    def turns(
        self,
        clock: Callable[[], float],
        hold: set[str] | frozenset[str],
        wait: Callable[[], float],
        deferred: Callable[[list[str], float], None],
    ) -> Iterator[Batch]:
        """Yield the ready batches one at a time, in :meth:`ready`'s round-robin order and each queue at most once,
        while ``wait()`` (seconds the next step should still wait: the trainer's duty budget while serving) is 0.
        Before each turn ``deferred(lineages, wait)`` says which ready lineages wait now (``[]``: none); theirs stay
        queued, where later signals join them. ``clock``: the time source of :meth:`add`."""
        tried: set[tuple[str, Kind]] = set()
        while True:
            ready = [key for key in self.ready(clock(), hold) if key not in tried]
            left = wait() if ready else 0.0
            deferred(list(dict.fromkeys(lineage for lineage, _ in ready)) if left > 0 else [], left)
            if not ready or left > 0:
                return
            tried.add(ready[0])
            batch = self.take(*ready[0], clock())
            if batch is not None:
                yield batch

    def take(self, lineage: str, kind: Kind, now: float) -> Batch | None:
        """Remove and return the batch of one ready queue (:meth:`ready`), marking the lineage's turn taken at
        ``now``; ``None`` when no batch can be made (no rater share allows 2 or more)."""
        c, q = self.config, self._queues.get((lineage, kind))
        if q is None or not q.items:
            return None
        threshold = {"kto": c.kto_min_batch, "sft": c.sft_min_batch, "dpo": c.dpo_min_batch}[kind]
        taken = self._take(q, min(len(q.items), c.max_batch), getattr(c, "rater_max_batch_share", 1.0))
        if not taken:
            return None
        self._taken_at[lineage] = now
        events = [e for _, e, _ in taken]
        batch = Batch(lineage, kind, events, [sid for sid, _, _ in taken], min_size=threshold)
        batch.waited = len(events) < threshold
        if kind == "kto":
            n_d = sum(1 for e in events if e.rating)
            batch.desirable_weight, batch.undesirable_weight = kto_class_weights(n_d, len(events) - n_d)
        return batch

    @staticmethod
    def _take(q: _Queue, size: int, share: float) -> list[tuple[str, Event, float]]:
        """Take up to ``size`` queued items, oldest first. While several raters are queued, the batch is the
        largest m ≤ ``size`` in which no rater has more than ``max(1, ⌊share·m⌋)`` items (the surplus stays
        queued, in order). Returns [] when no such batch of 2 or more exists."""
        from livelora.core.governance import rater_of

        raters = [rater_of(e) for _, e, _ in q.items.values()]
        counts: dict[str, int] = {}
        for r in raters:
            counts[r] = counts.get(r, 0) + 1
        if share >= 1.0 or len(counts) < 2:
            return [q.items.popitem(last=False)[1] for _ in range(size)]
        m = next(
            (m for m in range(size, 1, -1) if sum(min(c, max(1, int(share * m))) for c in counts.values()) >= m), 0
        )
        if m == 0:
            return []
        cap, per, keys = max(1, int(share * m)), {}, []
        for key, r in zip(list(q.items), raters):
            if per.get(r, 0) < cap and len(keys) < m:
                per[r] = per.get(r, 0) + 1
                keys.append(key)
        return [q.items.pop(k) for k in keys]

    def take_lonely(self, now: float, min_age_s: float) -> list[tuple[str, Event, float]]:
        """Remove and return ``(stream_id, event, arrival)`` of every KTO queue holding a single rating queued here
        ``min_age_s`` seconds ago or more: KTO never trains one example, and with several workers the rating that would
        pair with it may sit in another worker; the worker hands it back to the group."""
        out = []
        for (_, kind), q in self._queues.items():
            if kind == "kto" and len(q.items) == 1:
                sid = next(iter(q.items.values()))[0]
                if now - q.read.get(sid, q.oldest()) >= min_age_s:  # alone here that long (not: since it arrived)
                    out.append(q.items.popitem(last=False)[1])
        return out

    def clear(self) -> int:
        """Drop every queued event (Redis lost their entries: they come back re-queued); returns how many."""
        n = len(self)
        self._queues.clear()
        return n

    def requeue(self, batch: Batch, now: float, restart_wait: bool = False) -> None:
        """Put a batch back at the front of its queue (too few left to train now, held back, or its step failed).
        Its events keep their arrival times (:func:`arrival`: they do not wait ``max_wait_s`` again);
        ``restart_wait``: they count from ``now`` instead (a failed step's retry waits)."""
        q = self._queues.setdefault((batch.lineage, batch.kind), _Queue())
        restored: OrderedDict[str, tuple[str, Event, float]] = OrderedDict()
        for sid, ev in zip(batch.stream_ids, batch.events):
            key = ev.rating_key if isinstance(ev, RatingEvent) else sid
            restored[key] = (sid, ev, now if restart_wait else arrival(sid, now))
            q.read[sid] = now
        for key, item in q.items.items():  # newer re-rates that arrived meanwhile win
            restored.pop(key, None)
            restored[key] = item
        q.items = restored


def _sid_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def arrival(stream_id: str, now: float, arrived: str | None = None) -> float:
    """When the event of ``stream_id`` was accepted: its Redis stream id's milliseconds as Unix seconds, or the
    entry's ``arrived`` field (Unix s) where a worker handed the event back as a new entry; at most ``now`` (a
    trainer clock behind Redis's, or a test's own clock)."""
    try:
        first = float(arrived) if arrived else None
    except ValueError:
        first = None
    return min(now, first if first is not None else _sid_key(stream_id)[0] / 1000)
