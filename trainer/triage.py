"""One bad signal never takes good ones with it: split a batch into the events to dead-letter and the rest.

The worker (:mod:`livelora.trainer.worker`) first dead-letters the events the backend's ``screen(batch)`` names
(each checked alone: :meth:`livelora.trainer.online.OnlineTrainer.screen`) and trains the rest (:func:`without`);
when the step still refuses the data with an error naming a datum (``param`` ``data[i]...``), :func:`culprit`
maps it to its event, which alone is dead-lettered, and the rest is tried again; only an error that names no
datum dead-letters the whole batch. :func:`trainable` keeps a lone KTO rating queued (KTO needs a second datum's
completion). :class:`DeadLetters` writes the dead-lettered events and acknowledges them. The three moves:
``docs/internals/live-training.md``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from livelora.core import metrics
from livelora.trainer.dataset import append_lines, dataset_dir
from livelora.trainer.scheduler import Batch, BatchScheduler, kto_class_weights

if TYPE_CHECKING:
    from livelora.trainer.claims import SignalClaims

log = logging.getLogger(__name__)

_DATUM = re.compile(r"^data\[(\d+)\]")


def without(batch: Batch, drop: Mapping[int, object] | set[int]) -> Batch | None:
    """``batch`` without the events at the indexes in ``drop``; KTO class weights are recomputed for the
    events left. ``None`` when nothing is left."""
    keep = [i for i in range(len(batch.events)) if i not in drop]
    if not keep:
        return None
    rest = Batch(
        batch.lineage,
        batch.kind,
        [batch.events[i] for i in keep],
        [batch.stream_ids[i] for i in keep],
        min_size=batch.min_size,
        waited=batch.waited,
    )
    if rest.kind == "kto":
        n_d = sum(1 for e in rest.events if e.rating)
        rest.desirable_weight, rest.undesirable_weight = kto_class_weights(n_d, len(rest.events) - n_d)
    return rest


def trainable(batch: Batch) -> bool:
    """Whether ``batch`` is big enough for its loss (KTO needs 2 ratings; SFT and DPO 1 event)."""
    return len(batch.events) >= (2 if batch.kind == "kto" else 1)


def culprit(batch: Batch, param: str | None) -> int | None:
    """The index in ``batch.events`` of the event whose datum an error's ``param`` names (``data[5].x`` →
    datum 5 → event 5, or event 2 of a DPO batch whose events have two datums), else ``None``."""
    match = _DATUM.match(param or "")
    if match is None:
        return None
    index = int(match.group(1)) // (2 if batch.kind == "dpo" else 1)
    return index if index < len(batch.events) else None


def rejected_lines(batch: Batch, reasons: Mapping[int, str]) -> list[str]:
    """``rejected.jsonl`` lines (``{"stream_id", "event_id", "kind", "reason"}``) for the events at the indexes
    of ``reasons``."""
    for i in reasons:
        metrics.SIGNALS.labels("dead_lettered", batch.events[i].type).inc()
    return [
        json.dumps(
            {
                "stream_id": batch.stream_ids[i],
                "event_id": batch.events[i].id,
                "kind": batch.kind,
                "reason": reason[:1000],
            }
        )
        for i, reason in sorted(reasons.items())
    ]


class DeadLetters:
    """Events that cannot be trained: their lines go to ``rejected.jsonl`` (dataset directory of ``home``), then
    their entries are acknowledged (``claims``); a remainder that cannot train now goes back to ``scheduler``."""

    def __init__(self, home: Path, claims: SignalClaims, scheduler: BatchScheduler, clock: Callable[[], float]):
        self.home, self.claims, self.scheduler, self.clock = home, claims, scheduler, clock

    def reject(self, batch: Batch, reasons: dict[int, str]) -> Batch | None:
        """Dead-letter the events at the indexes of ``reasons`` alone; return the rest of the batch, or ``None``
        when nothing is left to train now (a lone KTO rating goes back to the queue to wait for more)."""
        if not reasons:
            return batch
        log.error(
            "dead-lettering %d of %d %s event(s) for %s: %s",
            len(reasons),
            len(batch.events),
            batch.kind,
            batch.lineage,
            "; ".join(reasons.values())[:500],
        )
        append_lines(dataset_dir(self.home) / "rejected.jsonl", rejected_lines(batch, reasons))
        self.claims.ack([batch.stream_ids[i] for i in reasons])
        rest = without(batch, reasons)
        if rest is not None and not trainable(rest):
            self.scheduler.requeue(rest, self.clock())
            return None
        return rest

    def all(self, batch: Batch, reason: str) -> None:
        """Dead-letter every event of ``batch`` for ``reason``."""
        lines = rejected_lines(batch, dict.fromkeys(range(len(batch.events)), reason))
        append_lines(dataset_dir(self.home) / "rejected.jsonl", lines)
        self.claims.ack(batch.stream_ids)
