"""The live loop under the tenant's ``max_adapter_versions`` and ``max_adapter_bytes``
(:mod:`livelora.core.quotas`): before a step writes a version, make room for it or hold the step back.

:meth:`VersionRoom.admit` asks :meth:`~livelora.adapters.kept_versions.AdapterVersions.make_room`, which deletes the
lineage's oldest versions that nothing uses (never a served, predecessor, pinned, rollback-stack or open-canary
version, a named session checkpoint or the newest) and writes a ``prune`` history line. When nothing can be
freed the batch goes back to the scheduler untrained; its stream entries stay pending and claimed by the worker
(none lost), the hold-back is logged and counted (``livelora_live_steps_held_back_total``), and the lineage's
batches wait ``retry_s`` seconds (:meth:`VersionRoom.waiting`) before the next try.
"""

from __future__ import annotations

import logging
from typing import Any

from livelora.core import metrics as prom
from livelora.trainer.scheduler import Batch, BatchScheduler

log = logging.getLogger(__name__)


class VersionRoom:
    """Room for the live loop's next version of a lineage.

    Args:
        versions: the store's limit (:class:`~livelora.adapters.kept_versions.AdapterVersions`).
        scheduler: where held-back batches go back to.
        retry_s: seconds before a held-back lineage is tried again.
    """

    def __init__(self, versions: Any, scheduler: BatchScheduler, retry_s: float = 30.0):
        self.versions, self.scheduler, self.retry_s = versions, scheduler, retry_s
        self._wait: dict[str, float] = {}  # lineage → clock time before which its batches stay queued

    def waiting(self, batch: Batch, now: float) -> bool:
        """Whether ``batch``'s lineage is held back at ``now`` (the batch is then put back in its queue)."""
        if self._wait.get(batch.lineage, float("-inf")) <= now:
            return False
        self.scheduler.requeue(batch, now)
        return True

    def admit(self, batch: Batch, now: float, backend: Any = None) -> bool:
        """Whether ``batch``'s version may be written now: room exists or was made (pruned versions counted in
        ``livelora_adapter_versions_pruned_total``). False: the batch was put back and the lineage waits
        ``retry_s``; also when the check itself failed (logged), so no signal is lost. ``backend.trains_from``
        (optional) names the version the backend's model holds, which is never pruned."""
        trains_from = getattr(backend, "trains_from", None)
        keep = trains_from(batch.lineage) if trains_from is not None else None
        try:
            room = self.versions.make_room(batch.lineage, batch.endpoint, keep=(keep,) if keep else ())
        except Exception:  # the store failed: hold the batch back, lose nothing
            log.exception("could not check max_adapter_versions for %s", batch.lineage)
            room = None
        if room is not None and room.ok:
            if room.pruned:
                prom.VERSIONS_PRUNED.labels(batch.endpoint).inc(len(room.pruned))
            return True
        prom.STEPS_HELD_BACK.labels(batch.endpoint).inc()
        self._wait[batch.lineage] = now + self.retry_s
        self.scheduler.requeue(batch, now)
        if room is not None:
            log.warning(
                "not training %d %s event(s) for %s: tenant %r %s, and no version of %s can be deleted (%s); "
                "the events stay queued, retry in %.0f s",
                len(batch.events),
                batch.kind,
                batch.endpoint,
                room.tenant,
                room.reason,
                batch.lineage,
                "; ".join(f"{k}: {v}" for k, v in room.protected.items()),
                self.retry_s,
                extra={"endpoint": batch.endpoint},
            )
        return False
