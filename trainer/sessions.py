"""Training sessions, trainer side: the op executor, plus the Redis keys, ids and checkpoint index it shares
with the gateway (:mod:`livelora.gateway.sessions`).

Flow of one training op (design.md "Training sessions"; tinker_protocol.md §2.5)::

    gateway: validate → SET seq:{model}:{seq} NX (dedupe) → SET future:{rid} pending → XADD ops:{model}
    trainer: XREAD ops:* → buffer by seq_id → run strictly in seq order → SET future:{rid} → PUBLISH futures

Redis keys (all under the configured prefix):

=============================  ==============  ====================================================
key                            type            holds
=============================  ==============  ====================================================
``session:{sid}``              string, TTL     session record; TTL refreshed by heartbeats
``model:{model_id}``           string (JSON)   model record: session, base model, LoRA shape, state
``trainer:models``             set             model ids the trainer reads ``ops:`` streams of
``ops:{model_id}``             stream          the model's ops, field ``op`` = JSON :class:`Op`
``seq:{model_id}:{seq_id}``    string, TTL     ``{request_id, digest}`` of the first op with that seq
``future:{request_id}``        string, TTL     ``{"state": "pending"|"done"|"failed", ...}``
``sampler:{sampling_id}``      string, TTL     sampling session: base model, adapter name and path
``futures``                    pub/sub         request ids whose future just resolved
``sessions``                   pub/sub         ids of sessions that finished
=============================  ==============  ====================================================

Semantics the executor guarantees:

* a model's ops run strictly in ``seq_id`` order (create/create-via-load is seq 0, then 1, 2, ...);
  ops that arrive early wait in a buffer; an op whose seq already ran or is buffered is dropped (retries
  are deduplicated on ``(model_id, seq_id)``);
* every op ends with its future resolved: the result, or ``{"error", "category"}``; a failed op still
  consumes its seq_id, so later ops run;
* when a session's key expires (no heartbeat for ``session_ttl_s``) or the session finishes, its models
  are freed and their buffered ops fail; buffered ops waiting for a seq_id that never arrives fail after
  ``gap_timeout_s``. Nothing stays pending forever.

Checkpoints (tinker paths ``tinker://<model_id>/<weights|sampler_weights>/<name>``) are adapter-store
versions of the lineage :func:`lineage_for` the model; the name → version map lives in
``LIVELORA_HOME/sessions/<lineage>.json`` (:class:`CheckpointIndex`), written atomically under a lock.
Ephemeral sampler saves are versions too; they are deleted when their model is freed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import Field

from livelora.adapters.atomic import atomic_write_json, file_lock
from livelora.adapters.settings import BaseSettings
from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import (BadRequestError, ConflictError, InternalError, LiveloraError, NotFoundError,
                                     UnsupportedParameterError, error_to_dict)
from livelora.clients.types.tinker import (AdamParams, CreateModelRequest, ForwardBackwardInput, LoadWeightsRequest,
                                           SaveWeightsForSamplerRequest, SaveWeightsRequest)

log = logging.getLogger(__name__)

TINKER_SCHEME = "tinker://"
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SessionSettings(BaseSettings):
    """Timing of training sessions (environment ``LIVELORA_SESSION_TTL_S``, ``LIVELORA_FUTURE_TTL_S``, ...)."""

    session_ttl_s: float = Field(60.0, gt=0, description="A session expires this long after its last heartbeat "
                                                        "(the SDKs beat every 10 s).")
    future_ttl_s: int = Field(24 * 3600, ge=60, description="Futures and dedupe records live this long (s).")
    long_poll_s: float = Field(30.0, gt=0, lt=45, description="retrieve_future waits at most this long before "
                                                              "answering 408 try_again (the SDK times out at 45 s).")
    gap_timeout_s: float = Field(600.0, gt=0, description="Buffered ops fail when the seq_id before them has not "
                                                          "arrived for this long (s).")
    trainer_in_process: bool = Field(True, description="Run the op executor in a thread of the gateway process.")


# ============================================================================================ keys and ids
@dataclass(frozen=True)
class SessionKeys:
    """Redis key names under one prefix (see the module docstring)."""

    prefix: str = "livelora:"

    def session(self, sid: str) -> str:
        return f"{self.prefix}session:{sid}"

    def model(self, model_id: str) -> str:
        return f"{self.prefix}model:{model_id}"

    @property
    def models(self) -> str:
        return f"{self.prefix}trainer:models"

    def ops(self, model_id: str) -> str:
        return f"{self.prefix}ops:{model_id}"

    def seq(self, model_id: str, seq_id: int) -> str:
        return f"{self.prefix}seq:{model_id}:{seq_id}"

    def future(self, request_id: str) -> str:
        return f"{self.prefix}future:{request_id}"

    def sampler(self, sampling_session_id: str) -> str:
        return f"{self.prefix}sampler:{sampling_session_id}"

    @property
    def futures_channel(self) -> str:
        return f"{self.prefix}futures"

    @property
    def sessions_channel(self) -> str:
        return f"{self.prefix}sessions"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """``{session_id}:train:{model_seq_id}`` (the id the tinker SDK computes for create-via-load)."""
    return f"{session_id}:train:{model_seq_id}"


def session_of(model_id: str) -> str:
    """The session id part of a model id (everything before ``:train:``)."""
    return model_id.split(":train:", 1)[0]


def lineage_for(model_id: str) -> str:
    """The adapter-store lineage of a model: its id lower-cased, characters outside ``[a-z0-9._-]`` → ``-``,
    plus an 8-hex digest of the id when that was lossy or long (so two ids never share a lineage)."""
    base = re.sub(r"[^a-z0-9._-]", "-", model_id.lower()).lstrip("._-") or "m"
    if base == model_id.replace(":", "-") and len(base) <= 64:
        return base
    return f"{base[:55]}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{TINKER_SCHEME}{model_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """Split ``tinker://<model_id>/<kind>/<name>`` into ``(model_id, kind, name)``.

    Raises:
        BadRequestError: not a tinker path, or a kind other than ``weights`` / ``sampler_weights``.
    """
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise BadRequestError(f"invalid checkpoint path {path!r}: expected tinker://<model_id>/weights/<name> or "
                              "tinker://<model_id>/sampler_weights/<name>", param="path")
    parts = path[len(TINKER_SCHEME):].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in CHECKPOINT_KINDS:
        raise BadRequestError(f"invalid checkpoint path {path!r}: expected tinker://<model_id>/weights/<name> or "
                              "tinker://<model_id>/sampler_weights/<name>", param="path")
    return parts[0], parts[1], parts[2]


def check_checkpoint_name(name: str | None) -> str:
    """A checkpoint name: 1-128 of ``[A-Za-z0-9._-]``, starting with a letter or digit.

    Raises:
        BadRequestError: anything else (also ``None``).
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise BadRequestError(f"invalid checkpoint name {name!r}: use 1-128 characters of A-Z, a-z, 0-9, '.', "
                              "'_', '-', starting with a letter or digit", param="path")
    return name


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


# ============================================================================================ checkpoint index
class CheckpointIndex:
    """Name → adapter version map of one training run, in ``<home>/sessions/<lineage>.json``.

    Layout: ``{"model_id", "base_model", "lora": {...}, "user_metadata", "created", "checkpoints":
    {"weights/<name>": {"version", "time", "adapter"}, ...}}``. Updates hold ``<file>.lock``.
    """

    def __init__(self, home: Path | str, model_id: str):
        self.model_id = model_id
        self.lineage = lineage_for(model_id)
        self.path = Path(home) / "sessions" / f"{self.lineage}.json"

    def read(self) -> dict[str, Any]:
        """The index (NotFoundError if the run has never been created)."""
        if not self.path.is_file():
            raise NotFoundError(f"training run {self.model_id!r} does not exist", param="model_id")
        return json.loads(self.path.read_text())

    def update(self, fn) -> dict[str, Any]:
        """Apply ``fn(index_dict)`` (which mutates it) under the lock and write it atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.path.with_suffix(".lock")):
            data = json.loads(self.path.read_text()) if self.path.is_file() else {"checkpoints": {}}
            fn(data)
            atomic_write_json(self.path, data)
        return data

    def resolve(self, kind: str, name: str) -> int:
        """Version number of checkpoint ``kind/name``.

        Raises:
            NotFoundError: unknown run or checkpoint.
        """
        entry = self.read().get("checkpoints", {}).get(f"{kind}/{name}")
        if entry is None:
            raise NotFoundError(f"checkpoint {tinker_path(self.model_id, kind, name)} does not exist", param="path")
        return int(entry["version"])


def resolve_checkpoint(home: Path | str, path: str, *, want: str | None = None) -> tuple[CheckpointIndex, str, int]:
    """``(index, kind, version)`` of a tinker path; ``want`` = required kind (``weights``/``sampler_weights``).

    Raises:
        BadRequestError: malformed path, or the wrong kind (the message says which kind is needed).
        NotFoundError: no such run or checkpoint.
    """
    model_id, kind, name = parse_tinker_path(path)
    if want is not None and kind != want:
        if want == "weights":
            raise BadRequestError(f"{path} is a sampler checkpoint (weights only, no optimizer state); training "
                                  "clients load training checkpoints saved with save_state "
                                  "(tinker://<model_id>/weights/<name>)", param="path")
        raise BadRequestError(f"{path} is a training checkpoint; sampling clients take sampler checkpoints saved "
                              "with save_weights_for_sampler (tinker://<model_id>/sampler_weights/<name>)",
                              param="path")
    index = CheckpointIndex(home, model_id)
    return index, kind, index.resolve(kind, name)


# ============================================================================================ futures
def future_done(result: dict[str, Any]) -> str:
    return json.dumps({"state": "done", "result": result})


def future_failed(err: BaseException) -> str:
    """The future record of a failed op: ``{"error", "category", "class", "code", "param"}``."""
    if not isinstance(err, LiveloraError):
        err = InternalError(f"internal error: {type(err).__name__}: {err}")
    d = error_to_dict(err)
    return json.dumps({"state": "failed", "error": d["message"], "category": d["category"], "class": d["class"],
                       "code": d["code"], "param": d["param"]})


# ============================================================================================ the executor
@dataclass
class Op:
    """One queued training op: ``kind`` (route name or ``failed``), ``seq_id``, ``request_id``, ``body`` (JSON)."""

    kind: str
    seq_id: int
    request_id: str
    body: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "seq_id": self.seq_id, "request_id": self.request_id,
                           "body": self.body})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Op:
        d = json.loads(raw)
        return cls(str(d["kind"]), int(d["seq_id"]), str(d["request_id"]), dict(d.get("body") or {}))


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

    def __init__(self, redis_client, keys: SessionKeys, home: Path | str, base_model: str,
                 settings: SessionSettings | None = None, *, device: str = "cpu", max_seq_len: int | None = None,
                 base_model_aliases: tuple[str, ...] = (), served_name: str | None = None):
        from livelora.adapters.models import resolve_base_model

        self.redis = redis_client
        self.keys = keys
        self.home = Path(home)
        self.store = AdapterStore(self.home)
        self.base_model = served_name or base_model
        self.base_names = {base_model, self.base_model, *base_model_aliases}
        self.base_ref = resolve_base_model(base_model, self.home)
        self.settings = settings or SessionSettings()
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
            created=d.get("created") or _now_iso()))
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
        entry = {"version": manifest.version, "time": _now_iso(), "adapter": manifest.name}
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


def new_request_id(scope: str) -> str:
    """A fresh request id ``{scope}:{12 hex}``."""
    return f"{scope}:{uuid.uuid4().hex[:12]}"
