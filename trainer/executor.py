"""The op executor: runs training-session ops from Redis on :class:`~livelora.trainer.model.TrainingModel` s.

The protocol it speaks (ids, ops, futures, checkpoint index) is :mod:`livelora.core.session_protocol`; the
Redis keys are :class:`~livelora.core.redis_keys.KeyLayout`'s. The gateway validates and queues ops; an
executor runs them. ``livelora trainer`` and ``livelora serve`` run one in a thread; ``livelora gateway`` only
when ``LIVELORA_EXECUTOR_IN_PROCESS`` is true (:mod:`livelora.cli.processes`). Any number of executors may
share one Redis prefix and one store.

Semantics the executor guarantees:

* **one owner per model**: an executor runs a model's ops only while it holds the model's lease
  (:mod:`livelora.trainer.ownership`); every write it makes (futures, op counts, stream trims, checkpoint
  index, recovery snapshot) is fenced by the lease's token, so a stale owner's write is refused;
* a model's ops run strictly in ``seq_id`` order (create/create-via-load is seq 0, then 1, 2, ...);
  ops that arrive early wait in a buffer; an op whose seq already ran or is buffered is dropped (retries
  are deduplicated on ``(model_id, seq_id)``);
* every op ends with its future resolved: the result, or ``{"error", "category"}``; a failed op still
  consumes its seq_id, so later ops run;
* ops stay in the model's stream until their effect is saved: an op without lasting in-memory effect
  (``forward``, the saves, a failed op) is trimmed once its result is committed; a ``forward_backward`` is
  trimmed with the next recovery snapshot;
* when a session's key expires (no heartbeat for ``session_ttl_s``) or the session finishes, its models
  are freed and their buffered ops fail; a buffered op waiting for a seq_id that never arrives fails
  ``gap_timeout_s`` after it arrived (:func:`~livelora.core.session_protocol.gap_expired`), and an op dropped as
  a duplicate whose future is still pending fails too. Nothing stays pending forever.

**Take-over** (the owner died; its lease expired after at most ``lease_ttl_s``): the next executor restores
the model from its recovery snapshot (:mod:`livelora.trainer.recovery`, written after every ``create``,
``optim_step`` and ``load_weights``: weights, AdamW state, step) and then, in seq order:

* an op the dead owner had committed (``opruns``) is not run again;
* an op it had not committed runs now; that includes the op it was running when it died (a
  ``forward_backward`` recomputes its gradients; a ``save_weights`` that had reached the index is recognised
  by its request id and not saved twice);
* an ``optim_step`` whose gradients came, even in part, from ``forward_backward`` ops committed by the dead
  owner fails with ``InternalError`` (code ``trainer_lost``) naming those seqs: an optimizer step is never
  applied on lost gradients. The accumulated gradients are dropped, so the client repeats its
  ``forward_backward`` ops and steps again;
* a snapshot whose op's future was not yet written (the owner died in between) resolves that future from
  the snapshot.

Ephemeral sampler saves are adapter versions too; when a model is freed every version of its lineage that
no named checkpoint references is deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore
from livelora.clients.errors import LiveloraError, NotFoundError
from livelora.core import metrics
from livelora.core.core_share import TrainingFlag, training_step
from livelora.core.metering import Meter, Usage
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import (
    CheckpointIndex,
    Op,
    StaleOwnerError,
    dropped_error,
    future_done,
    future_failed,
    gap_error,
    gap_expired,
    session_of,
)
from livelora.core.settings import SessionSection
from livelora.trainer.ownership import Leases
from livelora.trainer.session_ops import SessionOps

#: op kinds that run a forward or backward pass on the CPU (they hold the machine's training flag)
_STEP_KINDS = frozenset({"forward", "forward_backward", "optim_step", "create_model", "load_weights"})

log = logging.getLogger(__name__)


#: ops after which the model's state is snapshotted (they change weights, optimizer state or step)
STATE_OPS = ("create_model", "create_via_load", "optim_step", "load_weights")


@dataclass
class _ModelSlot:
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


def _observe_queue(kind: str, entry_id: str) -> None:
    """``livelora_session_op_queue_seconds``: now minus the op's stream entry time (the ms part of its id, Redis's
    clock when the gateway queued it)."""
    try:
        queued_ms = int(entry_id.split("-", 1)[0])
    except ValueError:
        return
    metrics.SESSION_OP_QUEUE.labels(kind).observe(max(time.time() - queued_ms / 1000.0, 0.0))


class _Stale(Exception):
    """Our lease was taken over while we worked on the model."""


class OpExecutor(SessionOps):
    """Runs training ops from Redis streams on the :class:`~livelora.trainer.model.TrainingModel` s it owns.

    Args:
        redis_client: a synchronous ``redis.Redis`` (``decode_responses=True``).
        keys: the key layout.
        home: ``LIVELORA_HOME`` (adapter store and checkpoint indexes).
        base_model: the base-model name served (the only one that can be trained).
        settings: timings (``lease_ttl_s``, ``gap_timeout_s``, ...).
        device: torch device of the training models.
        max_seq_len: longest ``model_input`` accepted (tokens).
        base_model_aliases: other accepted base-model names; ``served_name``: the name reported in records.
        owner: this executor's id in leases (default ``{host}-{pid}-{4 hex}``).
        meter: counts the tokens of ``forward`` (kind ``forward``) and ``forward_backward`` (kind ``trained``)
            ops that succeed, per session (default: a :class:`~livelora.core.metering.Meter` on ``keys``).
        versions: the tenants' ``max_adapter_versions`` (:class:`~livelora.adapters.kept_versions.AdapterVersions`),
            checked again before a named checkpoint is written (``None``: only the gateway's check).
    """

    def __init__(
        self,
        redis_client,
        keys: KeyLayout,
        home: Path | str,
        base_model: str,
        settings: SessionSection | None = None,
        *,
        device: str = "cpu",
        max_seq_len: int | None = None,
        base_model_aliases: tuple[str, ...] = (),
        served_name: str | None = None,
        owner: str | None = None,
        meter: Meter | None = None,
        versions: Any = None,
    ):
        from livelora.core.base_models import HUB_IDS, resolve_base_model

        self.redis = redis_client
        self.keys = keys
        self.home = Path(home)
        self.store = AdapterStore(self.home)
        self.busy = TrainingFlag(self.home)  # the engine on this machine leaves a core to a step
        self.settings = settings or SessionSection()
        self.base_model = served_name or self.settings.served_model_name or base_model
        self.base_names = {
            base_model,
            self.base_model,
            *base_model_aliases,
            *([HUB_IDS[base_model]] if base_model in HUB_IDS else []),
        }  # the canonical hub id
        self.base_ref = resolve_base_model(base_model, self.home)
        self.device = device
        self.max_seq_len = max_seq_len
        self.slots: dict[str, _ModelSlot] = {}
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()
        self.leases = Leases(redis_client, keys, self.settings.lease_ttl_s, owner, on_lost=self._mark_lost)
        self._retry_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_housekeeping = 0.0
        self.ops_run = 0
        self.meter = meter if meter is not None else Meter(keys)
        self.versions = versions  # max_adapter_versions (adapters/quotas.AdapterVersions); None: not checked

    @property
    def owner(self) -> str:
        return self.leases.owner

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run :meth:`run_forever` in a daemon thread (and renew leases in another)."""
        if self._thread is None:
            self.leases.start()
            self._thread = threading.Thread(target=self.run_forever, name="livelora-op-executor", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current op and give the leases back (peers take the models over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None
        self.leases.stop(release=True)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(block_ms=200)
            except Exception:  # keep serving other models; Redis hiccups included
                log.exception("op executor poll failed")
                time.sleep(0.5)

    def _mark_lost(self, model_id: str) -> None:
        with self._lost_lock:
            self._lost.add(model_id)

    def _drop(self, model_id: str, why: str) -> None:
        """Forget a model whose lease we lost: no write, no clean-up (the new owner has it)."""
        slot = self.slots.pop(model_id, None)
        self.leases.forget(model_id)
        if slot is not None:
            slot.model = None
            log.warning("dropped training model %s (token %d): %s", model_id, slot.token, why)

    # -------------------------------------------------------------------------------- one iteration
    def poll(self, block_ms: int = 200) -> int:
        """Take free models, read new ops, run every op that is next in its model's order, do housekeeping.
        Returns the ops run."""
        self.leases.start()  # idempotent: leases are renewed by a thread even when poll() is driven by hand
        with self._lost_lock:
            lost, self._lost = self._lost, set()
        for model_id in lost:
            self._drop(model_id, "lease lost")
        self._claim_models()
        streams = {self.keys.ops(m): s.last_stream_id for m, s in self.slots.items()}
        if streams:
            for stream, entries in self.redis.xread(streams, count=256, block=block_ms) or []:
                slot = self.slots.get(stream[len(self.keys.ops("")) :])
                try:
                    for entry_id, fields in entries if slot is not None else ():
                        slot.last_stream_id = entry_id
                        self._accept(slot, entry_id, Op.from_json(fields["op"]))
                except _Stale as exc:
                    self._drop(slot.model_id, str(exc))
        elif block_ms:
            self._stop.wait(block_ms / 1000)
        ran = 0
        for slot in list(self.slots.values()):
            while slot.next_seq in slot.buffer and self.slots.get(slot.model_id) is slot:
                self._execute(slot, *slot.buffer.pop(slot.next_seq))
                ran += 1
        if time.monotonic() - self._last_housekeeping > 1.0:
            self.housekeeping()
        return ran

    def _claim_models(self) -> None:
        now = time.monotonic()
        for model_id in self.redis.smembers(self.keys.models):
            if model_id in self.slots or self._retry_at.get(model_id, 0.0) > now:
                continue
            token = self.leases.acquire(model_id)
            if token is None:
                self._retry_at[model_id] = now + 0.5
                continue
            self._retry_at.pop(model_id, None)
            try:
                self._take(model_id, token)
            except _Stale as exc:
                self._drop(model_id, str(exc))
            except Exception:
                log.exception("taking over training model %s failed; giving it back", model_id)
                self.slots.pop(model_id, None)
                self.leases.release(model_id)
                self._retry_at[model_id] = now + 5.0

    def _take(self, model_id: str, token: int) -> None:
        """Become the model's owner: restore it from its recovery snapshot when a previous owner left one."""
        from livelora.trainer.recovery import read_snapshot, restore_model

        index = CheckpointIndex(self.home, model_id)
        recorded = index.fence()
        if recorded >= token:  # Redis lost the fence counter (restarted without persistence): go above the index
            self.leases.release(model_id)
            token = self.leases.acquire(model_id, above=recorded)
            if token is None:
                raise _Stale("another executor took the model while its fence was raised")
        slot = _ModelSlot(model_id, session_of(model_id), token=token)
        self.slots[model_id] = slot
        if not self.redis.exists(self.keys.session(slot.session_id)):
            self.free(model_id, f"session {slot.session_id} ended")
            return
        runs = self.redis.hgetall(self.keys.op_runs(model_id))
        slot.prev_applied = int(runs.get("applied", -1))
        state = read_snapshot(index)
        if state is not None:
            slot.model = restore_model(state, self.base_ref, device=self.device, max_seq_len=self.max_seq_len)
            slot.saved_seq = int(state["seq"])
            if str(slot.saved_seq) not in runs:  # the old owner died between its snapshot and the future
                self._commit(slot, state["request_id"], state["result"], slot.saved_seq)
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

    def _accept(self, slot: _ModelSlot, entry_id: str, op: Op) -> None:
        queued = op.seq_id in slot.buffer
        if op.seq_id < slot.next_seq or queued:
            if op.kind == "forward_backward" and slot.saved_seq < op.seq_id <= slot.prev_applied:
                # committed by a dead owner after its last snapshot: its gradients died with it
                if op.seq_id not in slot.lost_grads:
                    slot.lost_grads.append(op.seq_id)
                slot.kept.append(entry_id)
                return
            log.info("dropping duplicate op %s seq %d of %s", op.kind, op.seq_id, slot.model_id)
            if json.loads(self.redis.get(self.keys.future(op.request_id)) or "{}").get("state") == "pending":
                self._resolve_only(slot, op.request_id, dropped_error(slot.model_id, op.seq_id, slot.next_seq, queued))
            self._trim(slot, [entry_id])
            return
        slot.buffer[op.seq_id] = (entry_id, op)
        slot.arrived[op.seq_id] = time.monotonic()

    def _execute(self, slot: _ModelSlot, entry_id: str, op: Op) -> None:
        _observe_queue(op.kind, entry_id)
        slot.next_seq = op.seq_id + 1
        slot.last_progress = time.monotonic()
        self.ops_run += 1
        try:
            if op.kind == "failed":  # the gateway rejected it and already resolved the future
                self._commit(slot, op.request_id, None, op.seq_id)
                self._trim(slot, [entry_id])
                return
            changed = False
            try:
                step = op.kind in _STEP_KINDS  # a trainer process: duty and threads (core_share), flag held
                with (
                    training_step() if step else contextlib.nullcontext(),
                    self.busy.held() if step else contextlib.nullcontext(),
                ):
                    result = self._run(slot, op)
                record = future_done(result)
                changed = op.kind in STATE_OPS and slot.model is not None
            except StaleOwnerError:
                raise
            except Exception as exc:
                if not isinstance(exc, LiveloraError):
                    log.exception("op %s seq %d of %s failed", op.kind, op.seq_id, slot.model_id)
                record = future_failed(exc)
                changed = getattr(exc, "code", None) == "trainer_lost"
            if changed:
                self._snapshot(slot, op, record)
                trim, slot.kept = [*slot.kept, entry_id], []
            elif op.kind == "forward_backward" and json.loads(record)["state"] == "done":
                slot.kept.append(entry_id)
                trim = []
            else:
                trim = [entry_id]
            self._commit(slot, op.request_id, record, op.seq_id)
            self._trim(slot, trim)
            done = json.loads(record)["state"] == "done"
            metrics.SESSION_OPS.labels(op.kind, "done" if done else "failed").inc()
            if op.kind in ("forward", "forward_backward") and done:
                self._meter(slot, op)
        except (_Stale, StaleOwnerError) as exc:
            self._drop(slot.model_id, f"stale owner: {exc}")

    def _meter(self, slot: _ModelSlot, op: Op) -> None:
        """Count a committed forward (``forward``) or forward_backward (``trained``) op's tokens for its session's
        tenant and key (``tenant``/``key_id`` of the session record the gateway wrote; ``default`` when absent)."""
        try:
            if slot.payer is None:
                raw = self.redis.get(self.keys.session(slot.session_id))
                record = json.loads(raw) if raw else {}
                slot.payer = (record.get("tenant") or "default", record.get("key_id"))
            kind = "forward" if op.kind == "forward" else "trained"
            self.meter.record_sync(
                self.redis, Usage(slot.payer[0], slot.payer[1], slot.session_id, {kind: slot.op_tokens})
            )
        except Exception as exc:
            log.warning("could not meter %s seq %d of %s: %s", op.kind, op.seq_id, slot.model_id, exc)

    def _snapshot(self, slot: _ModelSlot, op: Op, record: str) -> None:
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

    def _commit(self, slot: _ModelSlot, request_id: str, record: str | None, seq: int | None) -> None:
        """Write the op's future (``record``; None = the gateway already did) and count its seq, fenced."""
        if not self.leases.resolve(
            slot.model_id, request_id, record, seq, self.settings.future_ttl_s, self.keys.futures_channel
        ):
            raise _Stale(f"lease of {slot.model_id} lost before op {seq} was committed")

    def _resolve_only(self, slot: _ModelSlot, request_id: str, error: LiveloraError) -> None:
        """Fail the future of an op that will not run, without counting a seq (fenced)."""
        if not self.leases.resolve(
            slot.model_id, request_id, future_failed(error), None, self.settings.future_ttl_s, self.keys.futures_channel
        ):
            raise _Stale(f"lease of {slot.model_id} lost")

    def _trim(self, slot: _ModelSlot, entry_ids: list[str]) -> None:
        if entry_ids and not self.leases.trim(slot.model_id, entry_ids):
            raise _Stale(f"lease of {slot.model_id} lost")

    # -------------------------------------------------------------------------------- housekeeping
    def housekeeping(self) -> None:
        """Free models of ended sessions; fail ops stuck behind a seq_id that never came."""
        self._last_housekeeping = time.monotonic()
        for slot in list(self.slots.values()):
            try:
                if not self.redis.exists(self.keys.session(slot.session_id)):
                    self.free(
                        slot.model_id,
                        f"session {slot.session_id} ended (finished, or no heartbeat for "
                        f"{self.settings.session_ttl_s:g} s)",
                    )
                elif slot.buffer:
                    slot.arrived = {s: t for s, t in slot.arrived.items() if s in slot.buffer}
                    last = gap_expired(slot.next_seq, slot.arrived, time.monotonic(), self.settings.gap_timeout_s)
                    missing = slot.next_seq
                    for seq in sorted(s for s in slot.buffer if last is not None and s <= last):
                        entry_id, op = slot.buffer.pop(seq)
                        error = gap_error(slot.model_id, missing, self.settings.gap_timeout_s)
                        self._commit(slot, op.request_id, future_failed(error), seq)
                        self._trim(slot, [entry_id])
                    if last is not None:
                        slot.next_seq = last + 1
                        slot.last_progress = time.monotonic()
            except _Stale as exc:
                self._drop(slot.model_id, str(exc))

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
                self._commit(
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
                    self._resolve_only(slot, op.request_id, error)
        except _Stale as exc:
            self._drop(model_id, str(exc))
            return
        pipe = self.redis.pipeline()
        pipe.srem(self.keys.models, model_id)
        pipe.delete(self.keys.ops(model_id), self.keys.model(model_id))
        pipe.execute()
        index = CheckpointIndex(self.home, model_id)
        try:
            keep = {int(e["version"]) for e in index.read().get("checkpoints", {}).values()}
            drop_snapshots(index, fence=slot.token)
        except NotFoundError:
            keep = set()
        except StaleOwnerError as exc:
            self._drop(model_id, str(exc))
            return
        for manifest in self.store.list(index.lineage):
            if manifest.version not in keep:
                self._delete_version(index.lineage, manifest.version)
        slot.model = None
        self.leases.release(model_id)
        log.info("freed training model %s: %s", model_id, reason)
