"""Training sessions, gateway side: every ``/api/v1`` operation, independent of the wire encoding.

The routes in :mod:`livelora.gateway.api.tinker` decode a body into a :mod:`livelora.clients.types.tinker`
model, call one method of :class:`SessionService` and encode what it returns; a later protobuf codec
only adds a decoder/encoder pair.

* **Training ops** (``forward``, ``forward_backward``, ``optim_step``, ``save_weights``,
  ``save_weights_for_sampler``, ``load_weights``, ``create_model``) are validated here and queued for the
  op executor on ``ops:{model_id}`` (:mod:`livelora.adapters.session_protocol`: ids, ordering). A retry with
  a ``(model_id, seq_id)`` already seen gets the first request's id back and is not queued again (a
  different body under the same seq is a 409). An op that fails validation after its ``seq_id`` is known
  resolves its future with ``{"error", "category": "user"}`` and still consumes the seq (a ``failed``
  marker is queued), so the model's later ops run.
* **Sampling** never touches the trainer: it runs on the gateway's engine with the sampling session's
  adapter version, loaded into the engine under its version name (``<lineage>@<n>``, never reused). That
  name is also a served ``model`` for ``/v1/chat/completions``, because the OpenAI routes resolve any
  loaded adapter by name. Results are written to the same Redis futures.
* **Sampled logprobs** are those of the raw model distribution of the sampling weights (log_softmax of the
  logits before temperature / top-k / top-p; :mod:`livelora.gateway.engines.base`). At temperature 1 with
  no top-k/top-p they are the sampling distribution's and agree with ``compute_logprobs``; otherwise they
  are not the tempered probabilities. The stop token (EOS or a stop token id) is part of ``tokens`` and
  its logprob is scored with the same weights.
* ``retrieve_future`` waits up to ``long_poll_s`` for the result, then answers 408 ``try_again``; an
  unknown or expired request id is 410.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from livelora.adapters.bus import redis_unavailable
from livelora.adapters.losses import validate_batch
from livelora.adapters.redis_keys import KeyLayout
from livelora.adapters.session_protocol import (CHECKPOINT_KINDS, CheckpointIndex, Op, future_failed, lineage_for,
                                                model_id_for, new_request_id, parse_tinker_path, resolve_checkpoint,
                                                session_of, tinker_path)
from livelora.adapters.settings import SessionSection
from livelora.adapters.store import AdapterStore
from livelora.clients.errors import (BadRequestError, ConflictError, LiveloraError, ModelNotFoundError, NotFoundError,
                                     UnsupportedParameterError)
from livelora.clients.types.tinker import (Checkpoint, CheckpointsListResponse, CreateModelRequest,
                                           CreateSamplingSessionRequest, CreateSamplingSessionResponse,
                                           CreateSessionRequest, CreateSessionResponse, Cursor, ForwardBackwardInput,
                                           GetInfoResponse, GetSamplerResponse, GetServerCapabilitiesResponse,
                                           LoadWeightsRequest, ModelData, SampledSequence, SampleRequest,
                                           SampleResponse, SaveWeightsForSamplerRequest, SupportedModel, TrainingRun,
                                           UntypedAPIFuture, WeightsInfoResponse)
from livelora.gateway.engines.base import Engine
from livelora.gateway.engines.base import SamplingParams as EngineParams

log = logging.getLogger(__name__)


class GoneError(NotFoundError):
    """An unknown, expired or finished session or future (HTTP 410: the tinker SDK stops or resubmits)."""

    status = 410
    default_code = "gone"


class NotReady:
    """Returned by :meth:`SessionService.retrieve_future` when the op is still running (route answers 408)."""

    def __init__(self, request_id: str):
        self.request_id = request_id


class SessionService:
    """The ``/api/v1`` operations (see the module docstring).

    Args:
        redis_client: ``redis.asyncio.Redis`` with ``decode_responses=True``.
        keys: key layout (prefix).
        engine: the serving engine (sampling, adapters, vocabulary size).
        home: ``LIVELORA_HOME``.
        base_model: the served base-model name; ``base_aliases`` are other accepted names.
        settings: session timings.
        admission: the gateway's :class:`~livelora.gateway.api.serving.Admission` (bounds sampled sequences).
    """

    def __init__(self, redis_client: aredis.Redis, keys: KeyLayout, engine: Engine, home: Path | str,
                 base_model: str, settings: SessionSection, *, base_aliases: tuple[str, ...] = (),
                 admission: Any = None, max_seq_len: int | None = None):
        self.redis = redis_client
        self.keys = keys
        self.engine = engine
        self.home = Path(home)
        self.store = AdapterStore(self.home)
        self.base_model = base_model
        self.base_names = {base_model, *base_aliases}
        self.settings = settings
        self.admission = admission
        self.max_seq_len = max_seq_len
        self._waiters: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loads: dict[str, asyncio.Lock] = {}
        #: engine adapter name → session that loaded it (unloaded when the session ends)
        self.adapters: dict[str, str] = {}
        self._listener: asyncio.Task | None = None
        self._janitor: asyncio.Task | None = None

    # ================================================================================ lifecycle
    async def start(self) -> None:
        """Subscribe to future notifications and start the janitor (unloads ended sessions' adapters)."""
        self._listener = asyncio.create_task(self._listen())
        self._janitor = asyncio.create_task(self._janitor_loop())

    async def close(self) -> None:
        for task in [self._listener, self._janitor, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._listener, self._janitor, *self._tasks]:
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task
        await self.redis.aclose()

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(self.keys.futures_channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        event = self._waiters.get(msg["data"])
                        if event is not None:
                            event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarted: resubscribe (waiters also re-check periodically)
                log.warning("futures listener: %s", exc)
                await asyncio.sleep(1.0)

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(2.0, self.settings.session_ttl_s / 2))
            try:
                await self.unload_ended_sessions()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("session janitor: %s", exc)

    async def unload_ended_sessions(self) -> None:
        """Unload engine adapters whose session key is gone (finished or expired); retried while in use."""
        for name, sid in list(self.adapters.items()):
            if await self.redis.exists(self.keys.session(sid)):
                continue
            try:
                if name in self.engine.loaded_adapters():
                    await self.engine.unload_adapter(name)
                self.adapters.pop(name, None)
            except ConflictError:
                pass  # still sampling; next round

    # ================================================================================ sessions
    async def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        sid = uuid.uuid4().hex
        record = {"created": time.time(), "tags": req.tags, "user_metadata": req.user_metadata,
                  "sdk_version": req.sdk_version}
        with redis_unavailable():
            await self.redis.set(self.keys.session(sid), json.dumps(record), px=self._ttl_ms())
        return CreateSessionResponse(session_id=sid)

    def _ttl_ms(self) -> int:
        return int(self.settings.session_ttl_s * 1000)

    async def heartbeat(self, session_id: str) -> None:
        """Extend the session's life by ``session_ttl_s``.

        Raises:
            GoneError: the session finished or expired.
        """
        with redis_unavailable():
            if not await self.redis.pexpire(self.keys.session(session_id), self._ttl_ms()):
                raise GoneError(f"session {session_id} has ended (finished, or no heartbeat for "
                                f"{self.settings.session_ttl_s:g} s)", param="session_id")

    async def _require_session(self, session_id: str) -> None:
        with redis_unavailable():
            if not await self.redis.exists(self.keys.session(session_id)):
                raise NotFoundError(f"session {session_id!r} does not exist or has ended; create a new session",
                                    param="session_id")

    async def finish_session(self, session_id: str) -> None:
        """End a session: its models are freed by the trainer and its sampler adapters unloaded.

        Raises:
            NotFoundError: unknown session (already finished or expired sessions are fine: no-op).
        """
        with redis_unavailable():
            await self.redis.delete(self.keys.session(session_id))
            await self.redis.publish(self.keys.sessions_channel, session_id)
        await self.unload_ended_sessions()

    # ================================================================================ futures
    async def _new_future(self, request_id: str) -> None:
        await self.redis.set(self.keys.future(request_id), json.dumps({"state": "pending"}),
                             ex=self.settings.future_ttl_s)

    async def _resolve(self, request_id: str, record: str) -> None:
        await self.redis.set(self.keys.future(request_id), record, ex=self.settings.future_ttl_s)
        await self.redis.publish(self.keys.futures_channel, request_id)
        event = self._waiters.get(request_id)
        if event is not None:
            event.set()

    async def retrieve_future(self, request_id: str, wait_s: float | None = None) -> dict[str, Any] | NotReady:
        """The op's result dict, its ``{"error", "category", ...}`` dict, or :class:`NotReady` after waiting.

        Raises:
            GoneError: unknown or expired request id.
        """
        deadline = time.monotonic() + (self.settings.long_poll_s if wait_s is None else wait_s)
        event = self._waiters.setdefault(request_id, asyncio.Event())
        try:
            while True:
                event.clear()
                with redis_unavailable():
                    raw = await self.redis.get(self.keys.future(request_id))
                if raw is None:
                    raise GoneError(f"request {request_id!r} is unknown or its result expired", param="request_id")
                record = json.loads(raw)
                if record["state"] == "done":
                    result = record["result"]
                    if result.get("type") == "save_weights_for_sampler" and result.get("sampling_session_id"):
                        await self._ensure_sampler_loaded(result["sampling_session_id"])
                    return result
                if record["state"] == "failed":
                    return {k: v for k, v in record.items() if k != "state"}
                left = deadline - time.monotonic()
                if left <= 0:
                    return NotReady(request_id)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
        finally:
            self._waiters.pop(request_id, None)

    # ================================================================================ training ops
    async def create_model(self, req: CreateModelRequest) -> UntypedAPIFuture:
        """Queue a new LoRA training model ``{session_id}:train:{model_seq_id}`` (op seq 0).

        Raises:
            NotFoundError: unknown session or base model. ConflictError: that model id exists.
        """
        await self._require_session(req.session_id)
        self._check_base(req.base_model)
        model_id = model_id_for(req.session_id, req.model_seq_id)
        return await self._enqueue_new_model(model_id, "create_model", req.model_dump(mode="json"),
                                             req.lora_config.model_dump())

    async def _enqueue_new_model(self, model_id: str, kind: str, body: dict[str, Any],
                                 lora: dict[str, Any] | None) -> UntypedAPIFuture:
        record = {"model_id": model_id, "session_id": session_of(model_id), "base_model": self.base_model,
                  "lora": lora, "state": "creating"}
        with redis_unavailable():
            if not await self.redis.set(self.keys.model(model_id), json.dumps(record), nx=True):
                raise ConflictError(f"model {model_id} already exists; use a new model_seq_id", param="model_seq_id")
            return await self._enqueue(model_id, 0, kind, body)

    def _check_base(self, name: str | None) -> None:
        if name is not None and name not in self.base_names:
            raise NotFoundError(f"base model {name!r} is not served here; this server serves {self.base_model!r}",
                                param="base_model")

    async def _enqueue(self, model_id: str, seq_id: int, kind: str, body: dict[str, Any],
                       error: LiveloraError | None = None) -> UntypedAPIFuture:
        """Dedupe on (model_id, seq_id), create the future, XADD the op (or a ``failed`` marker + the error)."""
        digest = hashlib.sha256(json.dumps([kind, body], sort_keys=True).encode()).hexdigest()
        request_id = new_request_id(f"{model_id}:{seq_id}")
        claim = json.dumps({"request_id": request_id, "digest": digest})
        if not await self.redis.set(self.keys.seq(model_id, seq_id), claim, nx=True, ex=self.settings.future_ttl_s):
            first = json.loads(await self.redis.get(self.keys.seq(model_id, seq_id)) or "{}")
            if first.get("digest") not in (None, digest):
                raise ConflictError(f"seq_id {seq_id} of model {model_id} was already used by a different request",
                                    param="seq_id")
            return UntypedAPIFuture(request_id=first["request_id"], model_id=model_id)
        await self._new_future(request_id)
        if error is not None:
            await self._resolve(request_id, future_failed(error))
            kind, body = "failed", {}
        pipe = self.redis.pipeline()
        pipe.sadd(self.keys.models, model_id)
        pipe.xadd(self.keys.ops(model_id), {"op": Op(kind, seq_id, request_id, body).to_json()})
        await pipe.execute()
        return UntypedAPIFuture(request_id=request_id, model_id=model_id)

    async def _model_record(self, model_id: str) -> dict[str, Any] | None:
        with redis_unavailable():
            raw = await self.redis.get(self.keys.model(model_id))
        return json.loads(raw) if raw else None

    async def submit_op(self, kind: str, raw: dict[str, Any], parse) -> UntypedAPIFuture:
        """Validate and queue one training op given its raw JSON body.

        ``parse(raw)`` builds the typed request (raising on bad fields). The model id and seq id are read
        first, leniently, so that a body that fails validation still resolves its future with the error
        and consumes its seq id.

        Raises:
            BadRequestError: no ``model_id`` / ``seq_id`` (nothing can be queued without them).
        """
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        if not isinstance(model_id, str) or not model_id:
            raise BadRequestError("model_id is required", param="model_id")
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
            raise BadRequestError("seq_id is required: an integer >= 1, one per op of the model, in call order",
                                  param="seq_id")
        if await self._model_record(model_id) is None:
            request_id = new_request_id(f"{model_id}:{seq_id}")
            await self._new_future(request_id)
            await self._resolve(request_id, future_failed(NotFoundError(
                f"model {model_id!r} does not exist (never created, or its session ended)", param="model_id")))
            return UntypedAPIFuture(request_id=request_id, model_id=model_id)
        error: LiveloraError | None = None
        body: dict[str, Any] = {}
        try:
            body = self._validate(kind, parse(raw))
        except LiveloraError as exc:
            error = exc
        except ValueError as exc:  # pydantic.ValidationError
            error = BadRequestError(f"invalid {kind} request: {_pydantic_message(exc)}")
        with redis_unavailable():
            return await self._enqueue(model_id, seq_id, kind, body, error)

    def _validate(self, kind: str, req: Any) -> dict[str, Any]:
        if kind in ("forward", "forward_backward"):
            fb: ForwardBackwardInput = req.forward_input if kind == "forward" else req.forward_backward_input
            validate_batch(fb.data, fb.loss_fn, fb.loss_fn_config, vocab_size=int(self.engine.vocab_size),
                           max_seq_len=int(self.max_seq_len or self.engine.max_model_len))
            return {"input": fb.model_dump(mode="json")}
        if kind in ("save_weights", "save_weights_for_sampler") and req.ttl_seconds is not None:
            raise UnsupportedParameterError("ttl_seconds is not supported: checkpoints live until deleted",
                                            param="ttl_seconds")
        if kind == "save_weights_for_sampler":
            req: SaveWeightsForSamplerRequest
            if (req.path is None) == (req.sampling_session_seq_id is None):
                raise BadRequestError("give exactly one of path (a named sampler checkpoint) and "
                                      "sampling_session_seq_id (ephemeral weights for a sampling session)",
                                      param="path")
        if kind == "load_weights":
            resolve_checkpoint(self.home, req.path, want="weights")
        return req.model_dump(mode="json", exclude_none=True)

    async def create_via_load(self, req: LoadWeightsRequest) -> UntypedAPIFuture:
        """Create-via-load (``session_id`` + ``model_seq_id``; implicit seq 0): a model shaped like the
        checkpoint, its weights (and optimizer state when ``optimizer``) loaded.

        Raises:
            NotFoundError: unknown session, checkpoint or base model. BadRequestError: a sampler checkpoint.
        """
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequestError("load_weights needs session_id and model_seq_id (create a model from a "
                                  "checkpoint) or model_id and seq_id (load into an existing model)",
                                  param="session_id")
        await self._require_session(req.session_id)
        self._check_base(req.base_model)
        index, _, _ = resolve_checkpoint(self.home, req.path, want="weights")
        lora = index.read().get("lora")
        model_id = model_id_for(req.session_id, req.model_seq_id)
        return await self._enqueue_new_model(model_id, "create_via_load", req.model_dump(mode="json"), lora)

    # ================================================================================ info and checkpoints
    async def get_info(self, model_id: str) -> GetInfoResponse:
        """Raises: NotFoundError for an unknown model."""
        record = await self._model_record(model_id)
        if record is None:
            raise NotFoundError(f"model {model_id!r} does not exist", param="model_id")
        lora = record.get("lora") or {}
        return GetInfoResponse(model_id=model_id, model_name=record["base_model"], is_lora=True,
                               lora_rank=lora.get("rank"), lora_alpha=lora.get("alpha"),
                               model_data=ModelData(arch=record.get("arch"), model_name=record["base_model"],
                                                    tokenizer_id=record.get("tokenizer_id") or self._tokenizer_id()))

    def _tokenizer_id(self) -> str:
        return str(getattr(self.engine.tokenizer, "name_or_path", "") or self.base_model)

    def capabilities(self) -> GetServerCapabilitiesResponse:
        return GetServerCapabilitiesResponse(supported_models=[SupportedModel(
            model_name=self.base_model, max_context_length=int(self.max_seq_len or self.engine.max_model_len),
            tokenizer_id=self._tokenizer_id())])

    def weights_info(self, path: str) -> WeightsInfoResponse:
        """Raises: BadRequestError (malformed path), NotFoundError (unknown checkpoint)."""
        index, _, _ = resolve_checkpoint(self.home, path)
        data = index.read()
        lora = data.get("lora") or {}
        return WeightsInfoResponse(base_model=data.get("base_model", self.base_model), lora_rank=lora.get("rank"),
                                   lora_alpha=lora.get("alpha"), train_unembed=lora.get("train_unembed"),
                                   train_mlp=lora.get("train_mlp"), train_attn=lora.get("train_attn"))

    def _checkpoint(self, model_id: str, ckpt_id: str, entry: dict[str, Any]) -> Checkpoint:
        kind, name = ckpt_id.split("/", 1)
        lineage = lineage_for(model_id)
        wfile = self.store.version_dir(lineage, int(entry["version"])) / "adapter_model.safetensors"
        return Checkpoint(checkpoint_id=ckpt_id, checkpoint_type=CHECKPOINT_KINDS[kind], time=entry["time"],
                          tinker_path=tinker_path(model_id, kind, name), adapter=entry.get("adapter"),
                          size_bytes=wfile.stat().st_size if wfile.is_file() else None)

    def list_checkpoints(self, model_id: str) -> CheckpointsListResponse:
        """Raises: NotFoundError for an unknown training run."""
        entries = CheckpointIndex(self.home, model_id).read().get("checkpoints", {})
        items = [self._checkpoint(model_id, k, v) for k, v in sorted(entries.items(), key=lambda kv: kv[1]["time"])]
        return CheckpointsListResponse(checkpoints=items, cursor=Cursor(offset=0, limit=len(items),
                                                                        total_count=len(items)))

    def training_run(self, model_id: str) -> TrainingRun:
        data = CheckpointIndex(self.home, model_id).read()
        ckpts = self.list_checkpoints(model_id).checkpoints
        last = next((c for c in reversed(ckpts) if c.checkpoint_type == "training"), None)
        last_s = next((c for c in reversed(ckpts) if c.checkpoint_type == "sampler"), None)
        return TrainingRun(training_run_id=model_id, base_model=data.get("base_model", self.base_model),
                           lora_rank=(data.get("lora") or {}).get("rank"), last_checkpoint=last,
                           last_sampler_checkpoint=last_s, user_metadata=data.get("user_metadata"))

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint (its adapter version too).

        Raises:
            BadRequestError: malformed checkpoint id. NotFoundError: unknown run or checkpoint.
        """
        kind, _, name = checkpoint_id.partition("/")
        if kind not in CHECKPOINT_KINDS or not name:
            raise BadRequestError(f"invalid checkpoint id {checkpoint_id!r}: expected weights/<name> or "
                                  "sampler_weights/<name>", param="checkpoint_id")
        index = CheckpointIndex(self.home, model_id)
        removed: dict[str, Any] = {}

        def drop(data: dict[str, Any]) -> None:
            entry = data.get("checkpoints", {}).pop(checkpoint_id, None)
            if entry is None:
                raise NotFoundError(f"checkpoint {tinker_path(model_id, kind, name)} does not exist", param="path")
            removed.update(entry)

        index.read()
        index.update(drop)
        with contextlib.suppress(NotFoundError):
            self.store.delete(index.lineage, int(removed["version"]))

    # ================================================================================ sampling
    async def create_sampling_session(self, req: CreateSamplingSessionRequest) -> CreateSamplingSessionResponse:
        """A sampling session on a sampler checkpoint (``model_path``) or on the base model.

        Raises:
            NotFoundError: unknown session, base model or checkpoint. BadRequestError: a training checkpoint
            path, or neither ``model_path`` nor ``base_model``.
        """
        await self._require_session(req.session_id)
        self._check_base(req.base_model)
        sampling_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        record = await self._sampler_record_for_path(req.model_path, req.base_model, req.session_id, sampling_id)
        with redis_unavailable():
            await self.redis.set(self.keys.sampler(sampling_id), json.dumps(record), ex=self.settings.future_ttl_s)
        await self._ensure_loaded(record)
        return CreateSamplingSessionResponse(sampling_session_id=sampling_id)

    async def _sampler_record_for_path(self, model_path: str | None, base_model: str | None, session_id: str | None,
                                       sampling_id: str) -> dict[str, Any]:
        record = {"sampler_id": sampling_id, "session_id": session_id, "base_model": self.base_model,
                  "model_path": model_path, "adapter": None, "adapter_path": None}
        if model_path is None:
            if base_model is None:
                raise BadRequestError("give model_path (a sampler checkpoint) or base_model", param="model_path")
            return record
        index, _, version = resolve_checkpoint(self.home, model_path, want="sampler_weights")
        manifest = self.store.get(index.lineage, version)
        record.update(adapter=manifest.name, adapter_path=str(self.store.version_dir(index.lineage, version)))
        return record

    async def _sampler_record(self, sampling_id: str) -> dict[str, Any]:
        with redis_unavailable():
            raw = await self.redis.get(self.keys.sampler(sampling_id))
        if raw is None:
            raise NotFoundError(f"sampling session {sampling_id!r} does not exist or has expired",
                                param="sampling_session_id")
        return json.loads(raw)

    async def get_sampler(self, sampling_id: str) -> GetSamplerResponse:
        record = await self._sampler_record(sampling_id)
        return GetSamplerResponse(sampler_id=sampling_id, base_model=record["base_model"],
                                  model_path=record.get("model_path"), adapter=record.get("adapter"))

    async def _ensure_sampler_loaded(self, sampling_id: str) -> None:
        await self._ensure_loaded(await self._sampler_record(sampling_id))

    async def _ensure_loaded(self, record: dict[str, Any]) -> None:
        """Load the record's adapter version into the engine once (concurrent callers wait for one load)."""
        name = record.get("adapter")
        if name is None or name in self.engine.loaded_adapters():
            return
        lock = self._loads.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.engine.loaded_adapters():
                path = record.get("adapter_path")
                if not path or not Path(path).is_dir():
                    raise NotFoundError(f"the weights of adapter {name} were deleted (their session ended)",
                                        param="sampling_session_id")
                await self.engine.load_adapter(name, path)
            if record.get("session_id"):
                self.adapters[name] = record["session_id"]

    def _engine_params(self, req: SampleRequest, prompt_len: int) -> EngineParams:
        sp = req.sampling_params
        eos = tuple(sorted(getattr(self.engine, "eos_token_ids", None)
                           or {int(self.engine.tokenizer.eos_token_id)}))
        stop_strings: tuple[str, ...] = ()
        stop_ids: tuple[int, ...] = eos
        if isinstance(sp.stop, str):
            stop_strings = (sp.stop,)
        elif sp.stop is not None and len(sp.stop) == 0:
            stop_ids = ()
        elif sp.stop is not None and all(isinstance(s, str) for s in sp.stop):
            stop_strings = tuple(sp.stop)
        elif sp.stop is not None:
            stop_ids = tuple(sorted({*eos, *(int(t) for t in sp.stop)}))
        limit = int(self.engine.max_model_len)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - prompt_len
        if max_tokens < 1:
            raise BadRequestError(f"the prompt ({prompt_len} tokens) leaves no room to sample in the context of "
                                  f"{limit} tokens", param="prompt")
        return EngineParams(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                            top_k=0 if sp.top_k in (-1, 0) else sp.top_k, seed=sp.seed, stop=stop_strings,
                            stop_token_ids=stop_ids, ignore_eos=True, logprobs=True)

    async def asample(self, req: SampleRequest) -> UntypedAPIFuture:
        """Start sampling; the :class:`SampleResponse` arrives through ``retrieve_future``.

        Raises:
            NotFoundError: unknown sampling session / checkpoint. BadRequestError: invalid parameters.
            RateLimitError: the gateway's sequence limit is reached (429, the SDK backs off and resubmits).
        """
        if req.sampling_session_id is not None:
            record = await self._sampler_record(req.sampling_session_id)
            scope = req.sampling_session_id
        else:
            self._check_base(req.base_model)
            record = await self._sampler_record_for_path(req.model_path, req.base_model, None, "adhoc")
            scope = "sample"
        await self._ensure_loaded(record)
        prompt = req.prompt.to_ints()
        if not prompt:
            raise BadRequestError("prompt has no tokens", param="prompt")
        params = self._engine_params(req, len(prompt))
        ticket = self.admission.acquire(req.num_samples, param="num_samples") if self.admission else None
        request_id = new_request_id(f"{scope}:{req.seq_id if req.seq_id is not None else 'x'}")
        seq_ids = [f"{request_id}:{i}" for i in range(req.num_samples)]
        try:
            await self._new_future(request_id)
        except BaseException:
            if ticket:
                ticket.release()
            raise
        task = asyncio.create_task(self._sample(request_id, req, prompt, params, record.get("adapter"), seq_ids,
                                                ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return UntypedAPIFuture(request_id=request_id, sample_sequence_ids=seq_ids)

    async def _sample(self, request_id: str, req: SampleRequest, prompt: list[int], params: EngineParams,
                      adapter: str | None, seq_ids: list[str], ticket: Any) -> None:
        try:
            want_prompt_lp = bool(req.prompt_logprobs) or req.topk_prompt_logprobs > 0
            scored = self.engine.score(prompt, adapter, req.topk_prompt_logprobs) if want_prompt_lp else None
            samples = [self._one_sample(prompt, params, adapter, i, sid, f"{request_id}:{i}")
                       for i, sid in enumerate(seq_ids)]
            results = await asyncio.gather(*(samples if scored is None else [scored, *samples]))
            seqs = results if scored is None else results[1:]
            out = SampleResponse(sequences=seqs)
            if scored is not None:
                lps = results[0]
                if req.prompt_logprobs:
                    out = out.model_copy(update={"prompt_logprobs": [None if t is None else t.logprob for t in lps]})
                if req.topk_prompt_logprobs:
                    out = out.model_copy(update={"topk_prompt_logprobs": [
                        None if t is None else [(int(a), float(b)) for a, b in t.top] for t in lps]})
            record = json.dumps({"state": "done", "result": out.model_dump(mode="json", exclude_none=True)})
        except Exception as exc:
            if not isinstance(exc, LiveloraError):
                log.exception("sampling %s failed", request_id)
            record = future_failed(exc)
        finally:
            if ticket:
                ticket.release()
        with contextlib.suppress(Exception):
            await self._resolve(request_id, record)

    async def _one_sample(self, prompt: list[int], params: EngineParams, adapter: str | None, index: int,
                          sequence_id: str, engine_request_id: str) -> SampledSequence:
        if params.seed is not None and index:
            from dataclasses import replace

            params = replace(params, seed=params.seed + index)  # distinct, reproducible samples
        tokens: list[int] = []
        logprobs: list[float] = []
        finish, stop_reason = "length", None
        async for chunk in self.engine.generate(prompt, params, adapter=adapter, request_id=engine_request_id):
            tokens += chunk.token_ids
            logprobs += [lp.logprob for lp in chunk.logprobs or []]
            if chunk.finish_reason is not None:
                finish, stop_reason = chunk.finish_reason, chunk.stop_reason
        if finish == "stop" and isinstance(stop_reason, int):  # the stop token: part of the sample, scored
            tokens.append(stop_reason)
            scored = await self.engine.score([*prompt, *tokens], adapter)
            logprobs.append(float(scored[-1].logprob))
        return SampledSequence(stop_reason="stop" if finish == "stop" else "length", tokens=tokens,
                               logprobs=logprobs, sequence_id=sequence_id)


def _pydantic_message(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors()[:3]:
            loc = ".".join(str(p) for p in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return "; ".join(parts)
    return str(exc)


def checkpoint_model_id(path: str) -> str:
    """The model id of a tinker path (for routes that need only that)."""
    return parse_tinker_path(path)[0]


__all__ = ["SessionService", "GoneError", "NotReady", "ModelNotFoundError"]


async def start_sessions(app: Any, settings: Any, engine: Engine, admission: Any = None) -> SessionService:
    """Build and start the session service for ``app`` (``app.state.sessions``); close it with ``close()``.

    The ops it queues are run by an op executor (:mod:`livelora.trainer.executor`), which the process
    wiring starts beside the gateway (:mod:`livelora.cli.processes`) or a ``livelora trainer`` runs.

    Args:
        settings: the gateway's settings (``home``, ``redis_url``, ``redis_prefix``, ``model``, ``model_id``,
            ``sessions``, ``inference.max_model_len``).
    """
    keys = KeyLayout(settings.redis_prefix)
    aliases = tuple({settings.model, settings.model_id} - {settings.model_id})
    service = SessionService(aredis.from_url(settings.redis_url, decode_responses=True), keys, engine,
                             settings.home, settings.model_id, settings.sessions, base_aliases=aliases,
                             admission=admission, max_seq_len=settings.inference.max_model_len)
    await service.start()
    app.state.sessions = service
    return service
