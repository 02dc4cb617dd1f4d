"""The op executor: runs training-session ops from Redis on :class:`~livelora.trainer.model.TrainingModel` s.

The protocol it speaks (ids, ops, futures, checkpoint index) is :mod:`livelora.adapters.session_protocol`; the
Redis keys are :class:`~livelora.adapters.redis_keys.KeyLayout`'s. The gateway validates and queues ops; this
executor runs them. ``livelora serve`` and ``livelora gateway`` start one in a thread
(:mod:`livelora.cli.processes`).

Semantics the executor guarantees:

* a model's ops run strictly in ``seq_id`` order (create/create-via-load is seq 0, then 1, 2, ...);
  ops that arrive early wait in a buffer; an op whose seq already ran or is buffered is dropped (retries
  are deduplicated on ``(model_id, seq_id)``);
* every op ends with its future resolved: the result, or ``{"error", "category"}``; a failed op still
  consumes its seq_id, so later ops run;
* when a session's key expires (no heartbeat for ``session_ttl_s``) or the session finishes, its models
  are freed and their buffered ops fail; buffered ops waiting for a seq_id that never arrives fail after
  ``gap_timeout_s``. Nothing stays pending forever.

Ephemeral sampler saves are adapter versions too; they are deleted when their model is freed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livelora.adapters.redis_keys import KeyLayout
from livelora.adapters.session_protocol import (CheckpointIndex, Op, check_checkpoint_name, future_done, future_failed,
                                                lineage_for, now_iso, resolve_checkpoint, session_of, tinker_path)
from livelora.adapters.settings import SessionSection
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import (BadRequestError, ConflictError, LiveloraError, NotFoundError,
                                     UnsupportedParameterError)
from livelora.clients.types.tinker import (AdamParams, CreateModelRequest, ForwardBackwardInput, LoadWeightsRequest,
                                           SaveWeightsForSamplerRequest, SaveWeightsRequest)

log = logging.getLogger(__name__)


@dataclass
class _ModelSlot:
    model_id: str
    session_id: str
    model: Any = None  # TrainingModel once created
    next_seq: int = 0
    buffer: dict[int, Op] = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)
    last_stream_id: str = "0"
    ephemeral: list[int] = field(default_factory=list)
    broken: str | None = None  # why the model could not be created


class OpExecutor:
    """Runs training ops from Redis streams on :class:`~livelora.trainer.model.TrainingModel` s (one thread).

    Args:
        redis_client: a synchronous ``redis.Redis`` (``decode_responses=True``).
        keys: the key layout.
        home: ``LIVELORA_HOME`` (adapter store and checkpoint indexes).
        base_model: the base-model name served (the only one that can be trained).
        settings: timings.
        device: torch device of the training models.
        max_seq_len: longest ``model_input`` accepted (tokens).
        base_model_aliases: other accepted base-model names; ``served_name``: the name reported in records.
    """

    def __init__(self, redis_client, keys: KeyLayout, home: Path | str, base_model: str,
                 settings: SessionSection | None = None, *, device: str = "cpu", max_seq_len: int | None = None,
                 base_model_aliases: tuple[str, ...] = (), served_name: str | None = None):
        from livelora.adapters.models import resolve_base_model

        self.redis = redis_client
        self.keys = keys
        self.home = Path(home)
        self.store = AdapterStore(self.home)
        self.base_model = served_name or base_model
        self.base_names = {base_model, self.base_model, *base_model_aliases}
        self.base_ref = resolve_base_model(base_model, self.home)
        self.settings = settings or SessionSection()
        self.device = device
        self.max_seq_len = max_seq_len
        self.slots: dict[str, _ModelSlot] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_housekeeping = 0.0
        self.ops_run = 0

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run :meth:`run_forever` in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run_forever, name="livelora-op-executor", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(block_ms=200)
            except Exception:  # keep serving other models; Redis hiccups included
                log.exception("op executor poll failed")
                time.sleep(0.5)

    # -------------------------------------------------------------------------------- one iteration
    def poll(self, block_ms: int = 200) -> int:
        """Read new ops, run every op that is next in its model's order, do housekeeping. Returns ops run."""
        for model_id in self.redis.smembers(self.keys.models):
            if model_id not in self.slots:
                self.slots[model_id] = _ModelSlot(model_id, session_of(model_id))
        streams = {self.keys.ops(m): s.last_stream_id for m, s in self.slots.items()}
        if streams:
            for stream, entries in self.redis.xread(streams, count=256, block=block_ms) or []:
                model_id = stream[len(self.keys.ops("")):]
                slot = self.slots[model_id]
                for entry_id, fields in entries:
                    slot.last_stream_id = entry_id
                    self._accept(slot, Op.from_json(fields["op"]))
                self.redis.xdel(stream, *[e for e, _ in entries])
        elif block_ms:
            self._stop.wait(block_ms / 1000)
        ran = 0
        for slot in list(self.slots.values()):
            while slot.next_seq in slot.buffer and slot.model_id in self.slots:
                self._execute(slot, slot.buffer.pop(slot.next_seq))
                ran += 1
        if time.monotonic() - self._last_housekeeping > 1.0:
            self.housekeeping()
        return ran

    def _accept(self, slot: _ModelSlot, op: Op) -> None:
        if op.seq_id < slot.next_seq or op.seq_id in slot.buffer:
            log.info("dropping duplicate op %s seq %d of %s", op.kind, op.seq_id, slot.model_id)
            return
        slot.buffer[op.seq_id] = op

    def _execute(self, slot: _ModelSlot, op: Op) -> None:
        slot.next_seq = op.seq_id + 1
        slot.last_progress = time.monotonic()
        self.ops_run += 1
        if op.kind == "failed":  # the gateway rejected it and already resolved the future
            return
        try:
            result = self._run(slot, op)
            record = future_done(result)
        except Exception as exc:
            if not isinstance(exc, LiveloraError):
                log.exception("op %s seq %d of %s failed", op.kind, op.seq_id, slot.model_id)
            record = future_failed(exc)
        self._resolve(op.request_id, record)

    def _resolve(self, request_id: str, record: str) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self.keys.future(request_id), record, ex=self.settings.future_ttl_s)
        pipe.publish(self.keys.futures_channel, request_id)
        pipe.execute()

    # -------------------------------------------------------------------------------- ops
    def _run(self, slot: _ModelSlot, op: Op) -> dict[str, Any]:
        if op.kind in ("create_model", "create_via_load"):
            return self._create(slot, op)
        if slot.model is None:
            raise NotFoundError(f"model {slot.model_id} is not available: {slot.broken or 'it was never created'}",
                                param="model_id")
        model = slot.model
        if op.kind in ("forward", "forward_backward"):
            fb = ForwardBackwardInput.model_validate(op.body["input"])
            fn = model.forward if op.kind == "forward" else model.forward_backward
            return fn(fb.data, fb.loss_fn, fb.loss_fn_config).model_dump(mode="json")
        if op.kind == "optim_step":
            metrics = model.optim_step(AdamParams.model_validate(op.body.get("adam_params") or {}))
            return {"metrics": metrics, "type": "optim_step"}
        if op.kind == "save_weights":
            return self._save_state(slot, SaveWeightsRequest.model_validate(op.body))
        if op.kind == "save_weights_for_sampler":
            return self._save_for_sampler(slot, SaveWeightsForSamplerRequest.model_validate(op.body))
        if op.kind == "load_weights":
            req = LoadWeightsRequest.model_validate(op.body)
            index, _, version = resolve_checkpoint(self.home, req.path, want="weights")
            model.load_state(self.store, index.lineage, version, with_optimizer=req.optimizer)
            return {"path": req.path, "model_id": slot.model_id, "type": "load_weights"}
        raise BadRequestError(f"unknown op {op.kind!r}")

    def _check_base(self, name: str | None) -> None:
        if name is not None and name not in self.base_names:
            raise NotFoundError(f"base model {name!r} is not served here; this server trains {self.base_model!r}",
                                param="base_model")

    def _create(self, slot: _ModelSlot, op: Op) -> dict[str, Any]:
        from livelora.trainer.model import TrainingModel

        if slot.model is not None:
            raise ConflictError(f"model {slot.model_id} already exists", param="model_seq_id")
        kw = {"device": self.device, "max_seq_len": self.max_seq_len}
        try:
            if op.kind == "create_model":
                req = CreateModelRequest.model_validate(op.body)
                self._check_base(req.base_model)
                model = TrainingModel(self.base_ref, req.lora_config, **kw)
                user_metadata = req.user_metadata
            else:
                req = LoadWeightsRequest.model_validate(op.body)
                self._check_base(req.base_model)
                index, _, version = resolve_checkpoint(self.home, req.path, want="weights")
                model = TrainingModel.from_version(self.base_ref, self.store, index.lineage, version,
                                                   with_optimizer=req.optimizer, **kw)
                user_metadata = req.user_metadata
        except LiveloraError as exc:
            slot.broken = str(exc)
            raise
        slot.model = model
        lora = model.lora
        record = {"model_id": slot.model_id, "session_id": slot.session_id, "base_model": self.base_model,
                  "lora": {**lora.model_dump(), "alpha": model.alpha}, "state": "ready",
                  "arch": type(model.peft_model.base_model.model).__name__, "tokenizer_id": str(self.base_ref.path),
                  "user_metadata": user_metadata}
        self.redis.set(self.keys.model(slot.model_id), json.dumps(record))
        CheckpointIndex(self.home, slot.model_id).update(lambda d: d.update(
            model_id=slot.model_id, base_model=self.base_model, lora=record["lora"], user_metadata=user_metadata,
            created=d.get("created") or now_iso()))
        if op.kind == "create_model":
            return {"model_id": slot.model_id, "type": "create_model"}
        return {"model_id": slot.model_id, "path": LoadWeightsRequest.model_validate(op.body).path,
                "type": "load_weights"}

    def _save(self, slot: _ModelSlot, kind: str, name: str, overwrite: bool, with_optimizer: bool) -> Manifest:
        index = CheckpointIndex(self.home, slot.model_id)
        key = f"{kind}/{name}"
        old = index.read().get("checkpoints", {}).get(key)
        if old is not None and not overwrite:
            raise ConflictError(f"checkpoint {tinker_path(slot.model_id, kind, name)} exists; pass overwrite=True "
                                "or use another name", param="path")
        manifest = slot.model.save_weights(self.store, index.lineage, with_optimizer=with_optimizer)
        entry = {"version": manifest.version, "time": now_iso(), "adapter": manifest.name}
        index.update(lambda d: d.setdefault("checkpoints", {}).__setitem__(key, entry))
        if old is not None:
            self._delete_version(index.lineage, int(old["version"]))
        return manifest

    def _delete_version(self, lineage: str, version: int) -> None:
        try:
            self.store.delete(lineage, version)
        except LiveloraError as exc:
            log.warning("could not delete %s@%d: %s", lineage, version, exc)

    def _save_state(self, slot: _ModelSlot, req: SaveWeightsRequest) -> dict[str, Any]:
        if req.ttl_seconds is not None:
            raise UnsupportedParameterError("ttl_seconds is not supported: checkpoints live until deleted",
                                            param="ttl_seconds")
        name = check_checkpoint_name(req.path)
        self._save(slot, "weights", name, req.overwrite, with_optimizer=True)
        return {"path": tinker_path(slot.model_id, "weights", name), "type": "save_weights"}

    def _save_for_sampler(self, slot: _ModelSlot, req: SaveWeightsForSamplerRequest) -> dict[str, Any]:
        if req.ttl_seconds is not None:
            raise UnsupportedParameterError("ttl_seconds is not supported: checkpoints live until deleted",
                                            param="ttl_seconds")
        if req.kind == "inflight":
            raise UnsupportedParameterError("kind='inflight' is not supported; use 'snapshot'", param="kind")
        if (req.path is None) == (req.sampling_session_seq_id is None):
            raise BadRequestError("give exactly one of path (a named sampler checkpoint) and sampling_session_seq_id "
                                  "(ephemeral weights for a new sampling session)", param="path")
        if req.path is not None:
            name = check_checkpoint_name(req.path)
            manifest = self._save(slot, "sampler_weights", name, True, with_optimizer=False)
            return {"path": tinker_path(slot.model_id, "sampler_weights", name), "adapter": manifest.name,
                    "type": "save_weights_for_sampler"}
        manifest = slot.model.save_weights(self.store, lineage_for(slot.model_id))
        slot.ephemeral.append(manifest.version)
        sampling_id = f"{slot.session_id}:sample:{req.sampling_session_seq_id}"
        record = {"sampler_id": sampling_id, "session_id": slot.session_id, "base_model": self.base_model,
                  "model_path": None, "adapter": manifest.name,
                  "adapter_path": str(self.store.version_dir(manifest.lineage, manifest.version))}
        self.redis.set(self.keys.sampler(sampling_id), json.dumps(record), ex=self.settings.future_ttl_s)
        return {"sampling_session_id": sampling_id, "path": None, "adapter": manifest.name,
                "type": "save_weights_for_sampler"}

    # -------------------------------------------------------------------------------- housekeeping
    def housekeeping(self) -> None:
        """Free models of ended sessions; fail ops stuck behind a seq_id that never came."""
        self._last_housekeeping = time.monotonic()
        for slot in list(self.slots.values()):
            if not self.redis.exists(self.keys.session(slot.session_id)):
                self.free(slot.model_id, f"session {slot.session_id} ended (finished, or no heartbeat for "
                                         f"{self.settings.session_ttl_s:g} s)")
            elif slot.buffer and time.monotonic() - slot.last_progress > self.settings.gap_timeout_s:
                missing = slot.next_seq
                for seq in sorted(slot.buffer):
                    op = slot.buffer.pop(seq)
                    self._resolve(op.request_id, future_failed(BadRequestError(
                        f"seq_id {missing} of model {slot.model_id} never arrived within "
                        f"{self.settings.gap_timeout_s:g} s; ops after it cannot run in order", param="seq_id")))
                    slot.next_seq = max(slot.next_seq, seq + 1)
                slot.last_progress = time.monotonic()

    def free(self, model_id: str, reason: str) -> None:
        """Drop a model: fail its buffered ops, delete its stream, records and ephemeral sampler versions."""
        slot = self.slots.pop(model_id, None)
        if slot is None:
            return
        for seq in sorted(slot.buffer):
            op = slot.buffer.pop(seq)
            self._resolve(op.request_id, future_failed(NotFoundError(f"model {model_id} was freed: {reason}",
                                                                     param="model_id")))
        pipe = self.redis.pipeline()
        pipe.srem(self.keys.models, model_id)
        pipe.delete(self.keys.ops(model_id), self.keys.model(model_id))
        pipe.execute()
        lineage = lineage_for(model_id)
        for version in slot.ephemeral:
            self._delete_version(lineage, version)
        slot.model = None
        log.info("freed training model %s: %s", model_id, reason)
