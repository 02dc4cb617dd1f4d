"""The op executor: runs training-session ops from Redis on :class:`~livelora.trainer.model.TrainingModel` s.

:class:`OpExecutor` reads the ops the gateway queued (:mod:`livelora.core.session_protocol`; keys
:class:`~livelora.core.redis_keys.KeyLayout`'s) and runs each model's ops strictly in ``seq_id`` order while it
holds the model's lease, resolving every op's future (a failed op still consumes its seq id). Its components: the
models it owns (:class:`~livelora.trainer.model_slots.ModelSlots`: leases, fenced writes, take-over from a
recovery snapshot) and what each op does (:class:`~livelora.trainer.session_ops.SessionOps`). Any number of
executors may share one Redis prefix and one store; where they run: :mod:`livelora.cli.processes`. The
guarantees (ordering, deduplication, trimming, expiry, take-over): ``docs/internals/training-sessions.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore
from livelora.clients.errors import LiveloraError
from livelora.core import metrics
from livelora.core.cpu_share import TrainingFlag, training_step
from livelora.core.metering import Meter, Usage
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import (
    Op,
    StaleOwnerError,
    dropped_error,
    future_done,
    future_failed,
    gap_error,
    gap_expired,
)
from livelora.core.settings import SessionSection
from livelora.trainer.distributed import GroupFailedError
from livelora.trainer.model_slots import ModelSlot, ModelSlots, Stale
from livelora.trainer.ownership import Leases
from livelora.trainer.session_ops import SessionOps

#: op kinds that run a forward or backward pass on the CPU (they hold the machine's training flag)
_STEP_KINDS = frozenset({"forward", "forward_backward", "optim_step", "create_model", "load_weights"})

log = logging.getLogger(__name__)


#: ops after which the model's state is snapshotted (they change weights, optimizer state or step)
STATE_OPS = ("create_model", "create_via_load", "optim_step", "load_weights")


def _observe_queue(kind: str, entry_id: str) -> None:
    """``livelora_session_op_queue_seconds``: now minus the op's stream entry time (the ms part of its id, Redis's
    clock when the gateway queued it)."""
    try:
        queued_ms = int(entry_id.split("-", 1)[0])
    except ValueError:
        return
    metrics.SESSION_OP_QUEUE.labels(kind).observe(max(time.time() - queued_ms / 1000.0, 0.0))


class OpExecutor:
    """Runs training ops from Redis streams, in order, on the models it owns (:class:`ModelSlots`), with the ops
    themselves in :class:`SessionOps`.

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
        placement: which models it takes (:class:`~livelora.trainer.placement.Placement`; None: every one).
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
        placement: Any = None,
    ):
        self.redis = redis_client
        self.keys = keys
        self.home = Path(home)
        self.store = AdapterStore(self.home)
        self.busy = TrainingFlag(self.home)  # the engine on this machine leaves a core to a step
        self.settings = settings or SessionSection()
        self.ops = SessionOps(
            redis_client,
            keys,
            self.home,
            self.store,
            self.settings,
            base_model,
            device=device,
            max_seq_len=max_seq_len,
            base_model_aliases=base_model_aliases,
            served_name=served_name,
            versions=versions,
        )
        self.owned = ModelSlots(
            redis_client, keys, self.home, self.store, self.settings, owner, self.ops.restore, placement
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_housekeeping = 0.0
        self.ops_run = 0
        self.meter = meter if meter is not None else Meter(keys)

    @property
    def owner(self) -> str:
        return self.owned.leases.owner

    @property
    def leases(self) -> Leases:
        return self.owned.leases

    @property
    def slots(self) -> dict[str, ModelSlot]:
        """The models owned, by model id."""
        return self.owned.slots

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
        held = sorted(self.leases.held)
        self.leases.stop(release=True)
        if held:
            log.info("op executor %s stopped: gave back the leases of %s", self.owner, ", ".join(held))

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(block_ms=200)
            except GroupFailedError as exc:  # the op that met it is not committed: a peer runs it again
                log.error("op executor %s stops: %s", self.owner, exc)
                self._stop.set()
            except Exception:  # keep serving other models; Redis hiccups included
                log.exception("op executor poll failed")
                time.sleep(0.5)

    # -------------------------------------------------------------------------------- one iteration
    def poll(self, block_ms: int = 200) -> int:
        """Take free models, read new ops, run every op that is next in its model's order, do housekeeping.
        Returns the ops run."""
        self.leases.start()  # idempotent: leases are renewed by a thread even when poll() is driven by hand
        self.owned.drop_lost()
        self.owned.claim()
        streams = {self.keys.ops(m): s.last_stream_id for m, s in self.slots.items()}
        if streams:
            for stream, entries in self.redis.xread(streams, count=256, block=block_ms) or []:
                slot = self.slots.get(stream[len(self.keys.ops("")) :])
                try:
                    for entry_id, fields in entries if slot is not None else ():
                        slot.last_stream_id = entry_id
                        self._accept(slot, entry_id, Op.from_json(fields["op"]))
                except Stale as exc:
                    self.owned.drop(slot.model_id, str(exc))
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

    def _accept(self, slot: ModelSlot, entry_id: str, op: Op) -> None:
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
                error = dropped_error(slot.model_id, op.seq_id, slot.next_seq, queued)
                self.owned.commit(slot, op.request_id, future_failed(error), None)  # fails it, counts no seq
            self.owned.trim(slot, [entry_id])
            return
        slot.buffer[op.seq_id] = (entry_id, op)
        slot.arrived[op.seq_id] = time.monotonic()

    def _execute(self, slot: ModelSlot, entry_id: str, op: Op) -> None:
        _observe_queue(op.kind, entry_id)
        slot.next_seq = op.seq_id + 1
        slot.last_progress = time.monotonic()
        self.ops_run += 1
        try:
            if op.kind == "failed":  # the gateway rejected it and already resolved the future
                self.owned.commit(slot, op.request_id, None, op.seq_id)
                self.owned.trim(slot, [entry_id])
                return
            changed = False
            try:
                step = op.kind in _STEP_KINDS  # a trainer process: duty and threads (cpu_share), flag held
                with (
                    training_step() if step else contextlib.nullcontext(),
                    self.busy.held() if step else contextlib.nullcontext(),
                ):
                    result = self.ops.run(slot, op)
                record = future_done(result)
                changed = op.kind in STATE_OPS and slot.model is not None
            except (StaleOwnerError, GroupFailedError):
                raise
            except Exception as exc:
                if not isinstance(exc, LiveloraError):
                    log.exception("op %s seq %d of %s failed", op.kind, op.seq_id, slot.model_id)
                record = future_failed(exc)
                changed = getattr(exc, "code", None) == "trainer_lost"
            if changed:
                self.owned.snapshot(slot, op, record)
                trim, slot.kept = [*slot.kept, entry_id], []
            elif op.kind == "forward_backward" and json.loads(record)["state"] == "done":
                slot.kept.append(entry_id)
                trim = []
            else:
                trim = [entry_id]
            self.owned.commit(slot, op.request_id, record, op.seq_id)
            self.owned.trim(slot, trim)
            done = json.loads(record)["state"] == "done"
            metrics.SESSION_OPS.labels(op.kind, "done" if done else "failed").inc()
            if op.kind in ("forward", "forward_backward") and done:
                self._meter(slot, op)
        except (Stale, StaleOwnerError) as exc:
            self.owned.drop(slot.model_id, f"stale owner: {exc}")

    def _meter(self, slot: ModelSlot, op: Op) -> None:
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
                        self.owned.commit(slot, op.request_id, future_failed(error), seq)
                        self.owned.trim(slot, [entry_id])
                    if last is not None:
                        slot.next_seq = last + 1
                        slot.last_progress = time.monotonic()
            except Stale as exc:
                self.owned.drop(slot.model_id, str(exc))

    def free(self, model_id: str, reason: str) -> None:
        """Give up a model we own (:meth:`ModelSlots.free`)."""
        self.owned.free(model_id, reason)
