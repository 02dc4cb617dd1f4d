"""The training models one op executor owns (:class:`ModelSlots`): claiming them under a lease (restored from their
recovery snapshot when a previous owner left one), the writes that lease fences (futures, op counts, stream trims,
snapshots), and giving them up (:meth:`ModelSlots.free`) or losing them (:meth:`ModelSlots.drop`). Running their
ops in order is :class:`~livelora.trainer.executor.OpExecutor`'s."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore
from livelora.clients.errors import NotFoundError
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import CheckpointIndex, Op, StaleOwnerError, future_failed, session_of
from livelora.core.settings import SessionSection
from livelora.trainer.checkpoint_saves import delete_version
from livelora.trainer.ownership import Leases

log = logging.getLogger(__name__)


@dataclass
class ModelSlot:
    model_id: str
    session_id: str
    token: int = 0  # fencing token of our lease
    model: Any = None  # TrainingModel once created
    next_seq: int = 0
    buffer: dict[int, tuple[str, Op]] = field(default_factory=dict)  # seq → (stream entry id, op)
    arrived: dict[int, float] = field(default_factory=dict)  # buffered seq → when it arrived (monotonic s)
    last_progress: float = field(default_factory=time.monotonic)
    last_stream_id: str = "0"
    broken: str | None = None  # why the model could not be created
    saved_seq: int = -1  # seq of the op the latest recovery snapshot follows
    prev_applied: int = -1  # highest seq a previous owner committed
    kept: list[str] = field(default_factory=list)  # entries of forward_backward ops since the snapshot
    lost_grads: list[int] = field(default_factory=list)  # forward_backward seqs whose gradients died
    op_tokens: int = 0  # model_input tokens of the forward/forward_backward op just run (metering)
    payer: tuple[str, str | None] | None = None  # (tenant, API key id) of the session, read once


class Stale(Exception):
    """Our lease was taken over while we worked on the model."""


class ModelSlots:
    """The models an executor holds a lease on, by model id (:attr:`slots`).

    Args:
        redis_client, keys, home, store, settings: the executor's.
        owner: this executor's id in leases (default ``{host}-{pid}-{4 hex}``).
        restore: builds a training model from a recovery snapshot's state
            (:meth:`~livelora.trainer.session_ops.SessionOps.restore`).
        placement: which models to take (:class:`~livelora.trainer.placement.Placement`; None: every one).
    """

    def __init__(
        self,
        redis_client,
        keys: KeyLayout,
        home: Path,
        store: AdapterStore,
        settings: SessionSection,
        owner: str | None,
        restore: Callable[[dict[str, Any]], Any],
        placement: Any = None,
    ):
        self.redis = redis_client
        self.keys = keys
        self.home = home
        self.store = store
        self.settings = settings
        self.slots: dict[str, ModelSlot] = {}
        self._restore = restore
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()
        self.leases = Leases(redis_client, keys, settings.lease_ttl_s, owner, on_lost=self._mark_lost)
        self._retry_at: dict[str, float] = {}
        self.placement = placement

    def _mark_lost(self, model_id: str) -> None:
        with self._lost_lock:
            self._lost.add(model_id)

    def drop_lost(self) -> None:
        """Forget the models whose lease renewal failed since the last call."""
        with self._lost_lock:
            lost, self._lost = self._lost, set()
        for model_id in lost:
            self.drop(model_id, "lease lost")

    def drop(self, model_id: str, why: str) -> None:
        """Forget a model whose lease we lost: no write, no clean-up (the new owner has it)."""
        slot = self.slots.pop(model_id, None)
        self.leases.forget(model_id)
        if slot is not None:
            slot.model = None
            log.warning("dropped training model %s (token %d): %s", model_id, slot.token, why)

    # -------------------------------------------------------------------------------- taking models
    def claim(self) -> None:
        """Take every registered model nobody holds that the placement accepts (a failed take or a refused model is
        looked at again after 5 s, a held one after 0.5 s)."""
        now = time.monotonic()
        for model_id in self.redis.smembers(self.keys.models):
            if model_id in self.slots or self._retry_at.get(model_id, 0.0) > now:
                continue
            if self.placement is not None and not self.placement.accepts(model_id):
                self._retry_at[model_id] = now + 5.0  # another executor's (placement.py)
                continue
            token = self.leases.acquire(model_id)
            if token is None:
                self._retry_at[model_id] = now + 0.5
                continue
            self._retry_at.pop(model_id, None)
            try:
                self._take(model_id, token)
            except Stale as exc:
                self.drop(model_id, str(exc))
            except Exception:
                log.exception("taking over training model %s failed; giving it back", model_id)
                self.slots.pop(model_id, None)
                self.leases.release(model_id)
                self._retry_at[model_id] = now + 5.0

    def _take(self, model_id: str, token: int) -> None:
        """Become the model's owner: restore it from its recovery snapshot when a previous owner left one."""
        from livelora.trainer.recovery import read_snapshot

        index = CheckpointIndex(self.home, model_id)
        recorded = index.fence()
        if recorded >= token:  # Redis lost the fence counter (restarted without persistence): go above the index
            self.leases.release(model_id)
            token = self.leases.acquire(model_id, above=recorded)
            if token is None:
                raise Stale("another executor took the model while its fence was raised")
        slot = ModelSlot(model_id, session_of(model_id), token=token)
        self.slots[model_id] = slot
        if not self.redis.exists(self.keys.session(slot.session_id)):
            self.free(model_id, f"session {slot.session_id} ended")
            return
        runs = self.redis.hgetall(self.keys.op_runs(model_id))
        slot.prev_applied = int(runs.get("applied", -1))
        state = read_snapshot(index)
        if state is not None:
            slot.model = self._restore(state)
            slot.saved_seq = int(state["seq"])
            if str(slot.saved_seq) not in runs:  # the old owner died between its snapshot and the future
                self.commit(slot, state["request_id"], state["result"], slot.saved_seq)
        elif slot.prev_applied >= 0:
            slot.broken = "its creation failed"
            slot.saved_seq = slot.prev_applied
        slot.next_seq = max(slot.saved_seq, slot.prev_applied) + 1
        if token > 1 or slot.prev_applied >= 0:
            log.info(
                "took over training model %s (token %d): restored after seq %d, %d op(s) committed before",
                model_id,
                token,
                slot.saved_seq,
                slot.prev_applied + 1,
            )

    # -------------------------------------------------------------------------------- fenced writes
    def snapshot(self, slot: ModelSlot, op: Op, record: str) -> None:
        """Write the recovery snapshot that follows ``op`` (its result ``record``)."""
        from livelora.trainer.recovery import write_snapshot

        write_snapshot(
            CheckpointIndex(self.home, slot.model_id),
            slot.model,
            seq=op.seq_id,
            fence=slot.token,
            result=record,
            request_id=op.request_id,
        )
        slot.saved_seq = op.seq_id
        slot.lost_grads.clear()

    def commit(self, slot: ModelSlot, request_id: str, record: str | None, seq: int | None) -> None:
        """Write the op's future (``record``; None = the gateway already did) and count its seq, fenced."""
        if not self.leases.resolve(
            slot.model_id, request_id, record, seq, self.settings.future_ttl_s, self.keys.futures_channel
        ):
            raise Stale(f"lease of {slot.model_id} lost before op {seq} was committed")

    def trim(self, slot: ModelSlot, entry_ids: list[str]) -> None:
        if entry_ids and not self.leases.trim(slot.model_id, entry_ids):
            raise Stale(f"lease of {slot.model_id} lost")

    # -------------------------------------------------------------------------------- giving models up
    def free(self, model_id: str, reason: str) -> None:
        """Drop a model we own: fail its buffered and unread ops, delete its stream, records, recovery snapshots and the
        versions of its lineage no named checkpoint references (ephemeral sampler saves); release the lease."""
        from livelora.trainer.recovery import drop_snapshots

        slot = self.slots.pop(model_id, None)
        if slot is None:
            return
        try:
            for seq in sorted(slot.buffer):
                _, op = slot.buffer.pop(seq)
                self.commit(
                    slot,
                    op.request_id,
                    future_failed(NotFoundError(f"model {model_id} was freed: {reason}", param="model_id")),
                    seq,
                )
            # ops not read yet (a new owner freeing a model whose session ended, an op queued as it was freed)
            for _, fields in self.redis.xrange(self.keys.ops(model_id)):
                op = Op.from_json(fields["op"])
                if json.loads(self.redis.get(self.keys.future(op.request_id)) or "{}").get("state") == "pending":
                    error = NotFoundError(f"model {model_id} was freed: {reason}", param="model_id")
                    self.commit(slot, op.request_id, future_failed(error), None)  # fails it, counts no seq
        except Stale as exc:
            self.drop(model_id, str(exc))
            return
        pipe = self.redis.pipeline()
        pipe.srem(self.keys.models, model_id)
        pipe.delete(self.keys.ops(model_id), self.keys.model(model_id))
        # the fence outlives any lease by far, then goes: a freed model id is never owned again
        pipe.expire(self.keys.model_fence(model_id), self.settings.future_ttl_s)
        pipe.execute()
        index = CheckpointIndex(self.home, model_id)
        try:
            keep = {int(e["version"]) for e in index.read().get("checkpoints", {}).values()}
            drop_snapshots(index, fence=slot.token)
        except NotFoundError:
            keep = set()
        except StaleOwnerError as exc:
            self.drop(model_id, str(exc))
            return
        for manifest in self.store.list(index.lineage):
            if manifest.version not in keep:
                delete_version(self.store, index.lineage, manifest.version)
        slot.model = None
        self.leases.release(model_id)
        log.info("freed training model %s: %s", model_id, reason)
