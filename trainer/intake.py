"""What the trainer worker reads, before any step: each signal is recorded in the dataset of record before its ack,
admitted (governance, the gate's hold-out) and queued in the scheduler (:meth:`SignalIntake.ingest`); a due batch
is screened for events trained meanwhile or claimed by another worker (:meth:`SignalIntake.screen`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.types.signals import parse_stream_event
from livelora.core.bus import redis_unavailable
from livelora.core.redis_keys import KeyLayout
from livelora.trainer.claims import Entry, SignalClaims
from livelora.trainer.dataset import DatasetOfRecord, trained_log
from livelora.trainer.scheduler import Batch, BatchScheduler, arrival, kto_class_weights

log = logging.getLogger(__name__)


class SignalIntake:
    """The worker's reading side (:class:`~livelora.trainer.worker.TrainerWorker`'s arguments of the same names).

    Args:
        claims: the entries this worker holds. learning: the learning status (``queued`` after each read).
        backend: its ``hold_out(lineage, event)``, if any, keeps events for the gate's signal check.
    """

    def __init__(
        self,
        client: Any,
        keys: KeyLayout,
        home: Path,
        claims: SignalClaims,
        scheduler: BatchScheduler,
        learning: Any,
        clock: Callable[[], float],
        governor: Any = None,
        backend: Any = None,
    ):
        self.client, self.keys, self.claims, self.scheduler = client, keys, claims, scheduler
        self.learning, self.clock, self.governor, self.backend = learning, clock, governor, backend
        self.endpoints = EndpointStore(home)
        self.dataset = DatasetOfRecord(home)
        self.trained = trained_log(home)

    def trained_ids(self, event_ids: list[str]) -> set[str]:
        """Which of ``event_ids`` any worker has trained: the shared Redis set (events of the last
        :data:`~livelora.trainer.claims.TRAINED_SET_WINDOW_S`), then ``trained.jsonl`` (every event, read
        incrementally)."""
        if not event_ids:
            return set()
        with redis_unavailable():
            scores = self.client.zmscore(self.keys.signals_trained, event_ids)
        done = {e for e, f in zip(event_ids, scores) if f is not None}
        rest = [e for e in event_ids if e not in done]
        if rest:
            on_disk = self.trained.refresh()
            done.update(e for e in rest if e in on_disk)
        return done

    def ingest(self, entries: list[Entry]) -> None:
        """Record ``entries`` (the dataset of record, durable before any ack), then acknowledge the invalid, the
        trained and the left-out ones and queue the rest (held by this worker)."""
        entries = self.claims.unheld(entries)
        if not entries:
            return
        now = self.clock()
        day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
        records, parsed, bad = [], [], []
        arrived = {sid: fields.get("arrived") for sid, fields in entries}  # a handed-back event's first arrival
        for sid, fields in entries:
            try:
                ev = parse_stream_event(fields)
            except (ValueError, KeyError) as exc:
                bad.append(sid)
                records.append((sid, {"stream_id": sid, "received": now, "invalid": str(exc)[:500], "fields": fields}))
                continue
            parsed.append((sid, ev))
            if self.governor is not None and self.governor.forgotten(ev):
                continue  # a forgotten user's event is neither recorded nor trained (admit() drops it)
            records.append((ev.id, {"stream_id": sid, "received": now, "event": json.loads(ev.model_dump_json())}))
        self.dataset.append(day, records)  # durable BEFORE any ack; once per event id
        ack, touched, left_out = list(bad), {}, []
        done = self.trained_ids([ev.id for _, ev in parsed])
        hold_out = getattr(self.backend, "hold_out", None)  # kept for the gate's signal check, or governed out
        for sid, ev in parsed:
            if ev.id in done:  # trained before a crash that came before its ack, or by a peer
                ack.append(sid)
                continue
            lineage = self.endpoints.get(ev.endpoint).lineage
            why = self.governor.admit(lineage, ev, now) if self.governor is not None else None
            why = why or ("held_out" if hold_out is not None and hold_out(lineage, ev) else None)
            if why:
                ack.append(sid)
                if ev.type == "rating" and why in ("held_out", "rate_limit"):
                    left_out.append((lineage, why))
                    touched[lineage] = ev.endpoint
                continue
            self.claims.hold([sid])
            ack += self.scheduler.add(lineage, sid, ev, now, arrival(sid, now, arrived.get(sid)))  # waited since
            touched[lineage] = ev.endpoint
        if ack:
            self.claims.ack(ack)
        self.learning.queued(self.scheduler, touched, [sid for sid, _ in entries], left_out)

    def screen(self, batch: Batch) -> Batch | None:
        """Take out of a due batch the events trained meanwhile by any worker (acknowledged) and the entries
        another worker has claimed (forgotten); None when too few remain to train now (they are requeued)."""
        lost = self.claims.lost_of(batch.stream_ids)
        done = self.trained_ids([e.id for e in batch.events])
        if self.governor is not None:  # a user forgotten while their events were queued: dropped, never trained
            done |= {e.id for e in batch.events if self.governor.forgotten(e)}
        if done:
            self.claims.ack([sid for sid, e in zip(batch.stream_ids, batch.events) if e.id in done])
        if lost:
            self.claims.release(list(lost))
        keep = [(sid, e) for sid, e in zip(batch.stream_ids, batch.events) if sid not in lost and e.id not in done]
        if len(keep) == len(batch.events):
            return batch
        log.info(
            "batch for %s: %d event(s) already trained, %d claimed by another worker",
            batch.lineage,
            len(done),
            len(lost),
        )
        if not keep:
            return None
        out = Batch(batch.lineage, batch.kind, [e for _, e in keep], [sid for sid, _ in keep], min_size=batch.min_size)
        out.waited = batch.waited
        if out.kind == "kto":
            if len(keep) < 2:  # KTO never runs on one example
                self.scheduler.requeue(out, self.clock())
                return None
            n_d = sum(1 for e in out.events if e.rating)
            out.desirable_weight, out.undesirable_weight = kto_class_weights(n_d, len(out.events) - n_d)
        return out
