"""The Tinker training-session API under ``/api/v1`` (JSON encoding of tinker SDK ≤0.24; protocol §2.4).

Handlers only decode a JSON body into a :mod:`livelora.clients.types.tinker` model, call one method of a
session service (:mod:`livelora.gateway.services.sessions`: sessions, training ops, checkpoints, sampling) and
encode its answer (:func:`encode`); the operations themselves know nothing about the wire. A protobuf codec (SDK ≥0.25) will add decoders and
encoders here without touching the service.

Errors: synchronous failures raise :mod:`livelora.clients.errors` classes and go through the gateway's one
error handler; failures of queued ops are the future's ``{"error", "category"}`` (HTTP 200), as the
protocol requires. ``retrieve_future`` answers 408 ``{"type": "try_again", ...}`` when the op is still
running after the long-poll, and 410 for an unknown or expired request id.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker import (CreateModelRequest, CreateSamplingSessionRequest, CreateSessionRequest,
                                           ForwardBackwardRequest, ForwardRequest, FutureRetrieveRequest,
                                           GetInfoRequest, LoadWeightsRequest, OptimStepRequest, SampleRequest,
                                           SaveWeightsForSamplerRequest, SaveWeightsRequest, SessionFinishRequest,
                                           SessionHeartbeatRequest, SessionHeartbeatResponse, TryAgainResponse,
                                           WeightsInfoRequest)
from livelora.gateway.api.errors import content_type_error
from livelora.gateway.api.deps import CheckpointsDep, SamplingDep, SessionsDep, TrainingOpsDep
from livelora.gateway.services.sessions import NotReady

router = APIRouter(prefix="/api/v1", tags=["training sessions"])
M = TypeVar("M", bound=BaseModel)

#: Flags for the tinker SDK's ``client/config``: create-from-checkpoint in one ``load_weights`` request,
#: plain httpx transport, JSON bodies (no protobuf yet).
CLIENT_CONFIG = {"create_model_via_load_weights": True, "use_pyqwest_transport": False,
                 "proto_write_fwdbwd": False, "parallel_fwdbwd_chunks": True}


# ------------------------------------------------------------------------------------------------ JSON codec
async def body_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is ``{}``).

    Raises:
        BadRequestError: declared as another content-type than JSON, not JSON, or not an object.
    """
    raw = await request.body()
    if not raw.strip():
        return {}
    if (wrong_type := content_type_error(request)) is not None:
        raise wrong_type
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object", code="invalid_json")
    return data


def parse(model: type[M], data: dict[str, Any]) -> M:
    """Validate ``data`` as ``model``; a bad or unknown field is a 400 naming it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msgs = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg')}"
                         for e in exc.errors()[:3])
        raise BadRequestError(f"invalid {model.__name__}: {msgs}", param=loc or None, code="invalid_value") from None


async def decode(request: Request, model: type[M]) -> M:
    return parse(model, await body_json(request))


def encode(obj: BaseModel | dict[str, Any], status_code: int = 200) -> Response:
    """JSON response; ``None`` fields are left out (as the tinker SDK's own bodies)."""
    data = obj.model_dump(mode="json", exclude_none=True, by_alias=True) if isinstance(obj, BaseModel) else obj
    return JSONResponse(data, status_code=status_code)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` publishing ``model`` as the route's JSON request body, so the OpenAPI document (and tools
    driven by it, such as schemathesis) knows what the route takes although the handler decodes the body itself.
    The model's ``$defs`` are inlined (the schema must stand alone inside the operation)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline({**defs[ref[len("#/$defs/"):]], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


# ------------------------------------------------------------------------------------------------ client setup
@router.post("/client/config")
async def client_config() -> Response:
    return encode(CLIENT_CONFIG)


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> Response:
    return encode({"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64})


@router.get("/healthz")
async def healthz() -> Response:
    return encode({"status": "ok"})


@router.post("/telemetry")
async def telemetry(request: Request) -> Response:
    await body_json(request)  # accepted and dropped: livelora keeps no client telemetry
    return encode({"status": "accepted"})


@router.get("/get_server_capabilities")
async def get_server_capabilities(ops: TrainingOpsDep) -> Response:
    return encode(ops.capabilities())


# ------------------------------------------------------------------------------------------------ sessions
@router.post("/create_session", openapi_extra=body_schema(CreateSessionRequest))
async def create_session(request: Request, sessions: SessionsDep) -> Response:
    return encode(await sessions.create_session(await decode(request, CreateSessionRequest)))


@router.post("/session_heartbeat", openapi_extra=body_schema(SessionHeartbeatRequest))
async def session_heartbeat(request: Request, sessions: SessionsDep) -> Response:
    await sessions.heartbeat((await decode(request, SessionHeartbeatRequest)).session_id)
    return encode(SessionHeartbeatResponse())


@router.post("/sessions/{session_id}/finish", openapi_extra=body_schema(SessionFinishRequest))
async def finish_session(session_id: str, request: Request, sessions: SessionsDep) -> Response:
    await decode(request, SessionFinishRequest)
    await sessions.finish_session(session_id)
    return encode({"session_id": session_id, "status": "finished"})


# ------------------------------------------------------------------------------------------------ training ops
@router.post("/create_model", openapi_extra=body_schema(CreateModelRequest))
async def create_model(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.create_model(await decode(request, CreateModelRequest)))


@router.post("/get_info", openapi_extra=body_schema(GetInfoRequest))
async def get_info(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.get_info((await decode(request, GetInfoRequest)).model_id))


@router.post("/forward", openapi_extra=body_schema(ForwardRequest))
async def forward(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.submit_op("forward", await body_json(request),
                                           lambda d: ForwardRequest.model_validate(d)))


@router.post("/forward_backward", openapi_extra=body_schema(ForwardBackwardRequest))
async def forward_backward(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.submit_op("forward_backward", await body_json(request),
                                           lambda d: ForwardBackwardRequest.model_validate(d)))


@router.post("/optim_step", openapi_extra=body_schema(OptimStepRequest))
async def optim_step(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.submit_op("optim_step", await body_json(request),
                                           lambda d: OptimStepRequest.model_validate(d)))


@router.post("/save_weights", openapi_extra=body_schema(SaveWeightsRequest))
async def save_weights(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.submit_op("save_weights", await body_json(request),
                                           lambda d: SaveWeightsRequest.model_validate(d)))


@router.post("/save_weights_for_sampler", openapi_extra=body_schema(SaveWeightsForSamplerRequest))
async def save_weights_for_sampler(request: Request, ops: TrainingOpsDep) -> Response:
    return encode(await ops.submit_op("save_weights_for_sampler", await body_json(request),
                                           lambda d: SaveWeightsForSamplerRequest.model_validate(d)))


@router.post("/load_weights", openapi_extra=body_schema(LoadWeightsRequest))
async def load_weights(request: Request, ops: TrainingOpsDep) -> Response:
    data = await body_json(request)
    if data.get("model_id") is not None or data.get("seq_id") is not None:  # load into an existing model
        return encode(await ops.submit_op("load_weights", data,
                                               lambda d: LoadWeightsRequest.model_validate(d)))
    return encode(await ops.create_via_load(parse(LoadWeightsRequest, data)))


@router.post("/retrieve_future", openapi_extra=body_schema(FutureRetrieveRequest))
async def retrieve_future(request: Request, sessions: SessionsDep) -> Response:
    req = await decode(request, FutureRetrieveRequest)
    result = await sessions.retrieve_future(req.request_id)
    if isinstance(result, NotReady):
        return encode(TryAgainResponse(request_id=req.request_id), status_code=408)
    return encode(result)


# ------------------------------------------------------------------------------------------------ checkpoints
@router.post("/weights_info", openapi_extra=body_schema(WeightsInfoRequest))
async def weights_info(request: Request, checkpoints: CheckpointsDep) -> Response:
    return encode(checkpoints.weights_info((await decode(request, WeightsInfoRequest)).tinker_path))


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, checkpoints: CheckpointsDep) -> Response:
    return encode(checkpoints.training_run(model_id))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, checkpoints: CheckpointsDep) -> Response:
    return encode(checkpoints.list_checkpoints(model_id))


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(model_id: str, checkpoint_id: str, checkpoints: CheckpointsDep) -> Response:
    checkpoints.delete_checkpoint(model_id, checkpoint_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------------------------------ sampling
@router.post("/create_sampling_session", openapi_extra=body_schema(CreateSamplingSessionRequest))
async def create_sampling_session(request: Request, sampling: SamplingDep) -> Response:
    return encode(await sampling.create_sampling_session(await decode(request, CreateSamplingSessionRequest)))


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, sampling: SamplingDep) -> Response:
    return encode(await sampling.get_sampler(sampler_id))


@router.post("/asample", openapi_extra=body_schema(SampleRequest))
async def asample(request: Request, sampling: SamplingDep) -> Response:
    return encode(await sampling.asample(await decode(request, SampleRequest)))
