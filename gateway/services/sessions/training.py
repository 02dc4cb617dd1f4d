"""Training ops of Tinker sessions, gateway side: validated here, queued for the op executor.

``forward``, ``forward_backward``, ``optim_step``, ``save_weights``, ``save_weights_for_sampler``,
``save_weights_external``, ``load_weights`` and ``create_model`` are validated and queued on ``ops:{model_id}``
(:mod:`livelora.core.session_protocol`: ids, ordering). A retry with a ``(model_id, seq_id)`` already
seen gets the first request's id back and is not queued again; a different body under the same seq gets a
future already failed with a ``seq_conflict`` error (op routes never answer 409: the SDK would retry it). An
op that fails validation after its ``seq_id`` is known resolves its future with ``{"error", "category":
"user"}`` and consumes the seq (a ``failed`` marker is queued), so the model's later ops run. An op refused
with an HTTP error (a seq more than ``session_max_seq_ahead`` ahead: 400; a quota: 429; a per-op limit: 413;
a body that could not be decoded) queues nothing and leaves its seq free (:meth:`TrainingOps.refuse`): a retry
under it runs, and a later seq consumes it with the refusal's error. The op executor
(:mod:`livelora.trainer.executor`, started beside the gateway by the process wiring, or a ``livelora trainer``)
runs them and writes their results to the futures.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from livelora.clients.errors import (
    BadRequestError,
    ConflictError,
    LiveloraError,
    NotFoundError,
    PayloadTooLargeError,
)
from livelora.clients.types.tinker import (
    CreateModelRequest,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsRequest,
    ModelData,
    SupportedModel,
    UntypedAPIFuture,
)
from livelora.core.api_keys import Principal
from livelora.core.bus import redis_unavailable
from livelora.core.owners import OwnerStore
from livelora.core.session_protocol import (
    Op,
    dropped_error,
    future_failed,
    lineage_for,
    model_id_for,
    new_request_id,
    now_iso,
    resolve_checkpoint,
    session_of,
)
from livelora.gateway.services.sessions.context import SessionContext
from livelora.gateway.services.sessions.futures import Futures
from livelora.gateway.services.sessions.op_checks import OpChecks
from livelora.gateway.services.sessions.seq_order import SeqOrder
from livelora.gateway.services.tenants.model_ceilings import check_new_model

# KEYS: seq claim, future, models set, ops stream; ARGV: claim, future record, model id, op JSON, TTL (s).
# Claims the seq and queues its op in one step (a gateway killed between the two would leave a seq claimed with
# nothing queued, and the model's later ops waiting); returns nil, or the earlier claim when the seq was taken.
_CLAIM_AND_QUEUE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[5]) then
  return redis.call('GET', KEYS[1]) or ''
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[5])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('XADD', KEYS[4], '*', 'op', ARGV[4])
return nil
"""


class TrainingOps:
    """Queue training ops in seq order (dedupe, refusals, the new-model path); model records and server
    capabilities. What a body must pass before it is queued is :attr:`checks` (:class:`OpChecks`).

    Args:
        ctx: the session services' shared context (Redis, engine, store, base model).
        futures: where op results are awaited.
    """

    def __init__(self, ctx: SessionContext, futures: Futures):
        self.ctx = ctx
        self.futures = futures
        self.redis = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.engine = ctx.engine
        self.home = ctx.home
        self.base_model = ctx.base_model
        self.max_seq_len = ctx.max_seq_len
        self.order = SeqOrder(ctx.redis, ctx.keys, ctx.settings)
        self.checks = OpChecks(ctx)
        self._claim_and_queue = ctx.redis.register_script(_CLAIM_AND_QUEUE)

    async def create_model(self, req: CreateModelRequest, principal: Principal) -> UntypedAPIFuture:
        """Queue a new LoRA training model ``{session_id}:train:{model_seq_id}`` (op seq 0).

        Raises:
            NotFoundError: unknown session or base model. ConflictError: that model id exists.
        """
        await self.ctx.require_session(req.session_id)
        self.ctx.check_base(req.base_model)
        model_id = model_id_for(req.session_id, req.model_seq_id)
        return await self._enqueue_new_model(
            model_id, "create_model", req.model_dump(mode="json"), req.lora_config.model_dump(), principal.tenant
        )

    async def _enqueue_new_model(
        self, model_id: str, kind: str, body: dict[str, Any], lora: dict[str, Any] | None, tenant: str
    ) -> UntypedAPIFuture:
        record = {
            "model_id": model_id,
            "session_id": session_of(model_id),
            "base_model": self.base_model,
            "lora": lora,
            "state": "creating",
            "tenant": tenant,
        }
        with redis_unavailable():
            if not await self.redis.exists(self.keys.model(model_id)):  # a new model: its tenant's ceilings first
                await check_new_model(self.ctx, model_id, lora, tenant)
            if not await self.redis.set(self.keys.model(model_id), json.dumps(record), nx=True):
                if await self.redis.get(self.keys.seq(model_id, 0)) is not None:  # a retry: the first one's future
                    return await self._enqueue(model_id, 0, kind, body)
                return await self._model_exists(model_id)
            owners = OwnerStore(self.home)
            if not (owners.claim("model", model_id, tenant) and owners.claim("lineage", lineage_for(model_id), tenant)):
                return await self._model_exists(model_id)
            return await self._enqueue(model_id, 0, kind, body)

    async def _model_exists(self, model_id: str) -> UntypedAPIFuture:
        """The failed future of a create for a ``model_id`` another request (or tenant) made: 409 ``model_exists``."""
        error = ConflictError(
            f"model {model_id} already exists; use a new model_seq_id", param="model_seq_id", code="model_exists"
        )
        return await self._failed_future(model_id, 0, error)

    async def _failed_future(self, model_id: str, seq_id: int, error: LiveloraError) -> UntypedAPIFuture:
        """A future already resolved with ``error``; nothing is queued (the seq belongs to another request)."""
        request_id = new_request_id(f"{model_id}:{seq_id}")
        await self.futures.create(request_id)
        await self.futures.resolve(request_id, future_failed(error))
        return UntypedAPIFuture(request_id=request_id, model_id=model_id)

    async def _enqueue(
        self,
        model_id: str,
        seq_id: int,
        kind: str,
        body: dict[str, Any],
        error: LiveloraError | None = None,
        failed: str | None = None,
    ) -> UntypedAPIFuture:
        """Dedupe on (model_id, seq_id); claim the seq, create the future and XADD the op (or a ``failed`` marker
        + the error, or the ready future record ``failed``) in one Redis script."""
        digest = hashlib.sha256(json.dumps([kind, body], sort_keys=True).encode()).hexdigest()
        request_id = new_request_id(f"{model_id}:{seq_id}")
        claim = json.dumps({"request_id": request_id, "digest": digest})
        resolved = error is not None or failed is not None
        if resolved:
            record, kind, body = failed or future_failed(error), "failed", {}
        else:
            record = json.dumps({"state": "pending"})
        op = Op(kind, seq_id, request_id, body).to_json()
        keys = [
            self.keys.seq(model_id, seq_id),
            self.keys.future(request_id),
            self.keys.models,
            self.keys.ops(model_id),
        ]
        first = await self._claim_and_queue(keys=keys, args=[claim, record, model_id, op, self.settings.future_ttl_s])
        if first is not None:  # the seq was claimed before: the same op again, or another one under its seq
            first = json.loads(first or "{}")
            if first.get("digest") not in (None, digest):
                return await self._failed_future(
                    model_id,
                    seq_id,
                    ConflictError(
                        f"seq_id {seq_id} of model {model_id} was already used by a different request (seq ids are "
                        "one per op, in call order)",
                        param="seq_id",
                        code="seq_conflict",
                    ),
                )
            return UntypedAPIFuture(request_id=first["request_id"], model_id=model_id)
        if resolved:
            await self.futures.resolve(request_id, record)  # wakes waiters (the script wrote the record)
        return UntypedAPIFuture(request_id=request_id, model_id=model_id)

    async def _model_record(self, model_id: str) -> dict[str, Any] | None:
        with redis_unavailable():
            raw = await self.redis.get(self.keys.model(model_id))
        return json.loads(raw) if raw else None

    async def refuse(self, model_id: str | None, seq_id: int | None, error: LiveloraError) -> None:
        """Record op ``seq_id`` of ``model_id`` as refused with an HTTP error (:meth:`SeqOrder.refuse`)."""
        record = await self._model_record(model_id) if model_id else None
        if record is not None:
            await self.order.refuse(model_id, seq_id, error, record)

    async def submit_op(self, kind: str, raw: dict[str, Any], parse, principal: Principal) -> UntypedAPIFuture:
        """Validate and queue one training op given its decoded body (a JSON object, or the dump of the typed
        protobuf request; ``parse(raw)`` builds the typed request the op runs, raising on bad fields).

        The model id and seq id are read first, leniently, so that a body that fails validation still resolves
        its future with the error and consumes its seq id. Refused with an HTTP error (nothing queued, the seq
        left free: :meth:`refuse`): an unknown field (400, as the protobuf decoder), a seq beyond the bound ahead
        (400), over a quota (429), over a per-op limit (413). A seq behind the model's next op that no request
        claimed gets a failed future at once.

        Raises:
            BadRequestError: no ``model_id`` / ``seq_id`` (nothing can be queued without them); an unknown field;
                seq too far ahead.
            QuotaExceededError, PayloadTooLargeError: see above.
        """
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        req, parse_error = await self._parse(kind, raw, parse, model_id, seq_id)
        _require_ids(model_id, seq_id)
        if (failed := await self._unplaceable(model_id, seq_id)) is not None:
            return failed
        try:
            await self.checks.check_quotas(kind, model_id, raw, principal)
        except LiveloraError as exc:  # 429 before any seq is used
            await self.refuse(model_id, seq_id, exc)
            raise
        with redis_unavailable():
            await self.redis.set(self.keys.model_last_request(model_id), now_iso(), ex=self.settings.future_ttl_s)
        body, error = await self._validated(kind, req, parse_error, model_id, seq_id)
        with redis_unavailable():
            for seq, failed_seq in await self.order.take_refused(model_id, seq_id):
                await self._enqueue(model_id, seq, "failed", {}, failed=failed_seq)
            return await self._enqueue(model_id, seq_id, kind, body, error)

    async def _parse(self, kind: str, raw: dict[str, Any], parse, model_id: Any, seq_id: Any) -> tuple[Any, Any]:
        """``(parse(raw), None)``, or ``(None, the ValueError)`` to resolve the op's future with. Raises:
        BadRequestError on an unknown field, as the protobuf decoder refuses one: 400, nothing queued (the seq
        is refused when the ids could be read)."""
        try:
            return parse(raw), None
        except ValueError as exc:  # pydantic.ValidationError
            if (unknown := _unknown_field(exc)) is None:
                return None, exc
            err = BadRequestError(
                f"invalid {kind} request: unknown field {unknown!r} (the request takes only the fields of its "
                "schema, as its protobuf form)",
                param=unknown,
                code="unknown_parameter",
            )
            if isinstance(model_id, str) and isinstance(seq_id, int):
                await self.refuse(model_id, seq_id, err)
            raise err from None

    async def _unplaceable(self, model_id: str, seq_id: int) -> UntypedAPIFuture | None:
        """A future failed at once when the op cannot take its place: the model does not exist, or ``seq_id`` is
        behind the model's next op and no request claimed it; ``None`` otherwise. Raises: BadRequestError (the
        seq beyond the bound ahead), UnavailableError (Redis)."""
        record = await self._model_record(model_id)
        if record is None:
            return await self._failed_future(
                model_id,
                seq_id,
                NotFoundError(
                    f"model {model_id!r} does not exist (never created, or its session ended)", param="model_id"
                ),
            )
        with redis_unavailable():
            next_seq = await self.order.next_seq(model_id, record)
            self.order.check_ahead(model_id, seq_id, next_seq)
            if (
                next_seq is not None
                and seq_id < next_seq
                and not await self.redis.exists(self.keys.seq(model_id, seq_id))
            ):
                return await self._failed_future(model_id, seq_id, dropped_error(model_id, seq_id, next_seq))
        return None

    async def _validated(
        self, kind: str, req: Any, parse_error: Exception | None, model_id: str, seq_id: int
    ) -> tuple[dict[str, Any], LiveloraError | None]:
        """``(the op's queued body, None)``, or ``({}, the error its future resolves with)`` for a request that
        failed parsing or the op checks. Raises: PayloadTooLargeError (413 now; the seq is refused, left free)."""
        try:
            if parse_error is not None:
                raise parse_error
            self.checks.check_limits(kind, req)
            return self.checks.validate(kind, req), None
        except PayloadTooLargeError as exc:
            await self.refuse(model_id, seq_id, exc)
            raise
        except LiveloraError as exc:
            return {}, exc
        except ValueError as exc:  # pydantic.ValidationError
            return {}, BadRequestError(f"invalid {kind} request: {_pydantic_message(exc)}")

    async def create_via_load(self, req: LoadWeightsRequest, principal: Principal) -> UntypedAPIFuture:
        """Create-via-load (``session_id`` + ``model_seq_id``; implicit seq 0): a model shaped like the
        checkpoint, its weights (and optimizer state when ``optimizer``) loaded.

        Raises:
            NotFoundError: unknown session, checkpoint or base model. BadRequestError: a sampler checkpoint.
        """
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequestError(
                "load_weights needs session_id and model_seq_id (create a model from a "
                "checkpoint) or model_id and seq_id (load into an existing model)",
                param="session_id",
            )
        await self.ctx.require_session(req.session_id)
        self.ctx.check_base(req.base_model)
        index, _, _ = resolve_checkpoint(self.home, req.path, want="weights")
        lora = index.read().get("lora")
        model_id = model_id_for(req.session_id, req.model_seq_id)
        return await self._enqueue_new_model(
            model_id, "create_via_load", req.model_dump(mode="json"), lora, principal.tenant
        )

    async def get_info(self, model_id: str, same_machine: bool = False) -> GetInfoResponse:
        """``model_data.tokenizer_id`` is the hub id, or for a caller on this machine (``same_machine``) the local
        folder of the tokenizer files (:meth:`SessionContext.local_tokenizer_dir
        <livelora.gateway.services.sessions.context.SessionContext.local_tokenizer_dir>`), which the official
        SDK's ``get_tokenizer()`` loads without asking the hub.

        Raises: NotFoundError for an unknown model."""
        record = await self._model_record(model_id)
        if record is None:
            raise NotFoundError(f"model {model_id!r} does not exist", param="model_id")
        lora = record.get("lora") or {}
        return GetInfoResponse(
            model_id=model_id,
            model_name=record["base_model"],
            is_lora=True,
            lora_rank=lora.get("rank"),
            lora_alpha=lora.get("alpha"),
            model_data=ModelData(
                arch=record.get("arch"),
                model_name=record["base_model"],
                tokenizer_id=(same_machine and await self.ctx.local_tokenizer_dir()) or self.ctx.tokenizer_id(),
            ),
        )

    async def tokenizer_files(self) -> tuple[str, bytes]:
        """``(revision, JSON body)`` of the base model's tokenizer files
        (:meth:`~livelora.gateway.services.sessions.context.SessionContext.tokenizer_files`)."""
        return await self.ctx.tokenizer_files()

    def capabilities(self) -> GetServerCapabilitiesResponse:
        return GetServerCapabilitiesResponse(
            supported_models=[
                SupportedModel(
                    model_name=self.base_model,
                    max_context_length=int(self.max_seq_len or self.engine.max_model_len),
                    tokenizer_id=self.ctx.tokenizer_id(),
                )
            ]
        )


def _require_ids(model_id: Any, seq_id: Any) -> None:
    """Raises BadRequestError unless ``model_id`` is a non-empty string and ``seq_id`` an integer >= 1."""
    if not isinstance(model_id, str) or not model_id:
        raise BadRequestError("model_id is required", param="model_id")
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
        raise BadRequestError(
            "seq_id is required: an integer >= 1, one per op of the model, in call order", param="seq_id"
        )


def _unknown_field(exc: Exception) -> str | None:
    """The dotted path of the first field a pydantic error names as not allowed (``extra_forbidden``)."""
    errors = getattr(exc, "errors", None)
    for e in errors() if callable(errors) else ():
        if e.get("type") == "extra_forbidden":
            return ".".join(str(p) for p in e.get("loc", ()))
    return None


def _pydantic_message(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors()[:3]:
            loc = ".".join(str(p) for p in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return "; ".join(parts)
    return str(exc)
