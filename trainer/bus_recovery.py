"""Re-queues accepted signals that Redis lost, from the gateways' accepted-signal log (:mod:`livelora.core.accept_log`).

Two checks, under ``data/accepted/.recover.lock``, on this worker's Redis prefix's records only:

* **State lost** (the ``bus:epoch`` key is gone or changed: a restart without persistence, a flush): every worker
  drops its queue; the first re-queues every logged event neither trained (``trained.jsonl``, the trained set),
  dead-lettered (``rejected.jsonl``), replaced by a re-rate, a forgotten user's, nor in the stream; then sets a
  new epoch.
* **Entries lost** (every ``reconcile_s``; a failover to a replica that missed writes): re-queues logged events
  neither in the dataset of record, a forgotten user's, nor in the stream (never read by a trainer and gone).

Then past days' log files whose events are all settled (recorded or forgotten, and out of the stream) are
deleted. Why this design: ``docs/scaling-out.md``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis

from livelora.core.accept_log import accept_dir, read_accepted
from livelora.core.atomic import file_lock
from livelora.core.bus import ensure_group, redis_unavailable
from livelora.core.redis_keys import KeyLayout
from livelora.trainer.dataset import DatasetOfRecord, dataset_dir, trained_log

log = logging.getLogger(__name__)


def _ids_in(path: Path, field: str) -> set[str]:
    out: set[str] = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.add(json.loads(line)[field])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


class BusRecovery:
    """The two checks of the module docstring for one trainer worker.

    Args:
        client: blocking Redis client (``decode_responses=True``).
        keys: key layout.
        home: ``LIVELORA_HOME``.
        reconcile_s: seconds between "entries lost" checks (and log pruning).
        clock: Unix seconds.
        forgotten: whether an event (attributes ``user``, ``caller``, ``endpoint``) is a forgotten user's: settled
            without a record, so its log file is pruned too (:meth:`FeedbackGovernor.forgotten`); ``None``: none is.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: KeyLayout,
        home: Path,
        reconcile_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        forgotten: Callable[[Any], bool] | None = None,
    ):
        self.client, self.keys, self.home = client, keys, Path(home)
        self.forgotten = forgotten
        self.reconcile_s, self.clock = reconcile_s, clock
        self.epoch: str | None = None  # the Redis state this worker's queue belongs to
        self.recovered = 0  # events this process re-queued
        self.last: dict[str, Any] | None = None  # {"count", "at", "why"} of the last re-queue by this process
        self._next_reconcile = 0.0
        self._dataset = DatasetOfRecord(self.home)
        self._trained = trained_log(self.home)

    def check(self, drop_queue: Callable[[], None]) -> int:
        """At each poll: after a loss of state call ``drop_queue`` (the worker's queued entries are gone) and
        :meth:`recover`, else :meth:`reconcile` when due. Returns how many events were re-queued."""
        if not self.lost():
            return self.reconcile()
        if self.epoch is not None:
            log.warning(
                "Redis lost its state (the %s key is gone): the queued signals are re-queued from the log",
                self.keys.bus_epoch,
            )
        drop_queue()
        return self.recover()

    def lost(self) -> bool:
        """Has Redis lost its state since this worker last looked (the epoch key is absent or another)?"""
        with redis_unavailable():
            return self.client.get(self.keys.bus_epoch) != self.epoch or self.epoch is None

    def recover(self) -> int:
        """After :meth:`lost`: re-queue what was accepted and is not trained or queued, unless another worker
        did already (then adopt its epoch). Returns how many events this call re-queued."""
        with file_lock(accept_dir(self.home) / ".recover.lock"), redis_unavailable():
            current = self.client.get(self.keys.bus_epoch)
            if current is not None:
                self.epoch = current
                return 0
            ensure_group(self.client, self.keys)
            n = self._requeue(self._settled, "Redis lost its state")
            epoch = uuid.uuid4().hex
            if not self.client.set(self.keys.bus_epoch, epoch, nx=True):
                epoch = self.client.get(self.keys.bus_epoch)
            self.epoch = epoch
            return n

    def reconcile(self) -> int:
        """Every ``reconcile_s``: re-queue logged events never read by a trainer and no longer in the stream, then
        prune settled log files. Returns how many events were re-queued."""
        now = self.clock()
        if now < self._next_reconcile:
            return 0
        self._next_reconcile = now + self.reconcile_s
        with file_lock(accept_dir(self.home) / ".recover.lock"), redis_unavailable():
            if self.client.get(self.keys.bus_epoch) != self.epoch:
                return 0  # state lost meanwhile: recover() first
            n = self._requeue(self._dataset.log.refresh, "entries missing from the signals stream")
            self._prune()
        return n

    # ------------------------------------------------------------------ internals

    def _in_stream(self) -> set[str]:
        ids: set[str] = set()
        last = "-"
        while True:
            rows = self.client.xrange(self.keys.signals, min=last, max="+", count=1000)
            for _, fields in rows:
                try:
                    ids.add(json.loads(fields["event"])["id"])
                except (KeyError, TypeError, json.JSONDecodeError):
                    continue
            if len(rows) < 1000:
                return ids
            last = "(" + rows[-1][0]

    def _settled(self) -> set[str]:
        return self._trained.refresh() | _ids_in(dataset_dir(self.home) / "rejected.jsonl", "event_id")

    def _requeue(self, done_ids: Callable[[], set[str]], why: str) -> int:
        """XADD (in acceptance order) every logged event not in ``done_ids()``, not replaced, not in the stream.
        Read in this order: the log (a logged event was added to the stream before), the stream, then what is
        done (an entry leaves the stream only after its event is recorded)."""
        files = read_accepted(self.home, self.keys.prefix)
        in_stream = self._in_stream()
        done = done_ids()
        recs: dict[str, dict[str, Any]] = {}
        replaced: set[str] = set()
        for rec in (r for rs in files.values() for r in rs):
            recs.setdefault(rec["event"]["id"], rec)
            if rec.get("replaces"):
                replaced.add(rec["replaces"])
        todo = sorted(
            (
                r
                for eid, r in recs.items()
                if eid not in done and eid not in replaced and eid not in in_stream and not self._forgotten(r)
            ),
            key=lambda r: r.get("accepted", 0),
        )
        if todo:
            pipe = self.client.pipeline(transaction=True)
            for r in todo:
                pipe.xadd(self.keys.signals, {"event": json.dumps(r["event"]), "replaces": r.get("replaces") or ""})
            pipe.execute()
            self.recovered += len(todo)
            self.last = {"count": len(todo), "at": self.clock(), "why": why}
            log.warning("recovered %d accepted signal(s) from the accepted-signal log (%s)", len(todo), why)
        return len(todo)

    def _prune(self) -> None:
        """Delete past days' log files whose every event is in the dataset of record and out of the stream."""
        today = datetime.fromtimestamp(self.clock(), UTC).strftime("%Y-%m-%d")
        files = read_accepted(self.home)  # a file is pruned only when all of it is this prefix's and settled
        old = {name: recs for name, recs in files.items() if name[:10] < today}
        if not old:
            return
        in_stream = self._in_stream()
        recorded = self._dataset.log.refresh()  # after the stream: an entry leaves it once recorded
        for name, recs in old.items():
            if all(r.get("prefix") == self.keys.prefix and self._settled_rec(r, recorded, in_stream) for r in recs):
                (accept_dir(self.home) / name).unlink(missing_ok=True)
                log.info("accepted-signal log %s pruned: every event in it is settled", name)

    def _settled_rec(self, rec: dict[str, Any], recorded: set[str], in_stream: set[str]) -> bool:
        eid = rec["event"]["id"]
        if eid in in_stream:
            return False
        return eid in recorded or self._forgotten(rec)

    def _forgotten(self, rec: dict[str, Any]) -> bool:
        """A forgotten user's event: dropped unrecorded by the trainer (or deleted from the dataset of record), so
        settled without a record and never re-queued."""
        try:
            return self.forgotten is not None and self.forgotten(SimpleNamespace(**rec["event"]))
        except Exception:  # e.g. an endpoint since deleted: not forgotten
            return False
