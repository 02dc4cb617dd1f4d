"""The Tinker training-session API under ``/api/v1``: JSON of tinker SDK ≤0.24 and the protobuf + zstd of SDK
≥0.25 (:mod:`livelora.gateway.api.tinker_wire`).

Handlers decode a body into a :mod:`livelora.clients.types` model (the auth middleware decoded it once,
:func:`~livelora.gateway.api.deps.tinker_body`), call one method of a session service
(:mod:`livelora.gateway.services.sessions`) and encode its answer (:func:`encode`). Error rules:
``docs/internals/training-sessions.md``.
"""

from __future__ import annotations

import zlib
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ValidationError

from livelora.clients.errors import BadRequestError, NotBuiltError
from livelora.clients.types.tinker import (
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    FutureRetrieveRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SessionFinishRequest,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    TryAgainResponse,
    WeightsInfoRequest,
)
from livelora.clients.types.tinker_ext import (
    SampleRequestV2,
    SaveWeightsExternalRequest,
    TokenizerFilesResponse,
)
from livelora.clients.types.tinker_rest import (
    CancelFutureRequest,
    CheckpointTtlRequest,
    FuturesRetrieveRequest,
    FuturesRetrieveResponse,
    JoinSamplingSessionRequest,
    JoinSamplingSessionResponse,
    SelfApiKeyResponse,
    SessionSearchRequest,
)
from livelora.gateway.api import tinker_wire as wire
from livelora.gateway.api.deps import (
    CheckpointsDep,
    PrincipalDep,
    PublicUrlDep,
    SamplesDep,
    SamplingDep,
    SessionsDep,
    TrainingOpsDep,
    tinker_body,
)
from livelora.gateway.api.tinker_wire import WireDecodeError
from livelora.gateway.services.sessions import NotReady

router = APIRouter(prefix="/api/v1", tags=["training sessions"])
M = TypeVar("M", bound=BaseModel)

#: Flags for the tinker SDK's ``client/config``: create-from-checkpoint in one ``load_weights`` request,
#: plain httpx transport; SDK 0.20–0.24 keep their JSON ``forward_backward`` (``proto_write_fwdbwd`` off),
#: SDK ≥0.25 always send protobuf, zstd-compressed (``proto_compress_fwdbwd``).
CLIENT_CONFIG = {
    "create_model_via_load_weights": True,
    "use_pyqwest_transport": False,
    "proto_write_fwdbwd": False,
    "proto_compress_fwdbwd": True,
    "parallel_fwdbwd_chunks": True,
}


# ------------------------------------------------------------------------------------------------ JSON codec
async def body_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is ``{}``), as decoded once by the auth middleware.

    Raises:
        BadRequestError: a protobuf body (only ``forward_backward`` takes one).
    """
    decoded = await tinker_body(request)
    if isinstance(decoded, WireDecodeError):
        raise decoded
    if not isinstance(decoded, dict):
        raise BadRequestError(f"{request.url.path} takes a JSON body", code="unsupported_content_type")
    return decoded


def parse(model: type[M], data: dict[str, Any]) -> M:
    """Validate ``data`` as ``model``; a bad or unknown field is a 400 naming it (an unknown one first, code
    ``unknown_parameter``: a misspelt key also leaves its field missing)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: e.get("type") != "extra_forbidden")
        first = errors[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msgs = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:3])
        code = "unknown_parameter" if first.get("type") == "extra_forbidden" else "invalid_value"
        raise BadRequestError(f"invalid {model.__name__}: {msgs}", param=loc or None, code=code) from None


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
                return inline({**defs[ref[len("#/$defs/") :]], **{k: v for k, v in node.items() if k != "$ref"}})
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


@router.get(
    "/tokenizer",
    response_model=TokenizerFilesResponse,
    responses={304: {"description": "the revision named in If-None-Match is still the served one"}},
)
async def get_tokenizer(request: Request, ops: TrainingOpsDep) -> Response:
    """The served base model's tokenizer files (livelora extension; any valid key): tokenizer, chat template,
    vocabulary and ``config.json``, by base name, never weights. ``ETag`` is the files' revision; a request whose
    ``If-None-Match`` names it gets 304 and no body."""
    revision, body = await ops.tokenizer_files()
    etag = f'"{revision}"'
    if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type="application/json", headers={"ETag": etag})


# ------------------------------------------------------------------------------------------------ sessions
@router.post("/create_session", openapi_extra=body_schema(CreateSessionRequest))
async def create_session(request: Request, sessions: SessionsDep, principal: PrincipalDep) -> Response:
    return encode(await sessions.create_session(await decode(request, CreateSessionRequest), principal))


@router.post("/session_heartbeat", openapi_extra=body_schema(SessionHeartbeatRequest))
async def session_heartbeat(request: Request, sessions: SessionsDep, principal: PrincipalDep) -> Response:
    await sessions.heartbeat((await decode(request, SessionHeartbeatRequest)).session_id, principal.tenant)
    return encode(SessionHeartbeatResponse())


@router.post("/sessions/{session_id}/finish", openapi_extra=body_schema(SessionFinishRequest))
async def finish_session(session_id: str, request: Request, sessions: SessionsDep, principal: PrincipalDep) -> Response:
    req = await decode(request, SessionFinishRequest)
    await sessions.finish_session(session_id, principal, req.reason.type, req.detail)
    return encode({"session_id": session_id, "status": "finished"})


@router.get("/sessions")
async def list_sessions(sessions: SessionsDep, principal: PrincipalDep, limit: int = 20, offset: int = 0) -> Response:
    return encode(await sessions.list_sessions(principal, limit, offset))


@router.post("/sessions/search")
async def search_sessions(request: Request, sessions: SessionsDep, principal: PrincipalDep) -> Response:
    return encode(await sessions.search_sessions(await decode(request, SessionSearchRequest), principal))


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, sessions: SessionsDep) -> Response:
    return encode(await sessions.get_session(session_id))


# ------------------------------------------------------------------------------------------------ training ops
@router.post("/create_model", openapi_extra=body_schema(CreateModelRequest))
async def create_model(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    return encode(await ops.create_model(await decode(request, CreateModelRequest), principal))


@router.post("/get_info", openapi_extra=body_schema(GetInfoRequest))
async def get_info(request: Request, ops: TrainingOpsDep) -> Response:
    model_id = (await decode(request, GetInfoRequest)).model_id
    return encode(await ops.get_info(model_id, same_machine=same_machine(request)))


#: Headers a reverse proxy adds: a request carrying one came from elsewhere, whatever its socket's address.
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def same_machine(request: Request) -> bool:
    """Whether ``request`` came from this machine: a loopback socket and no proxy header."""
    import ipaddress

    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return loopback and not any(h in request.headers for h in _PROXY_HEADERS)


@router.post("/forward", openapi_extra=body_schema(ForwardRequest))
async def forward(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    return encode(
        await ops.submit_op("forward", await body_json(request), lambda d: ForwardRequest.model_validate(d), principal)
    )


@router.post("/forward_backward", openapi_extra=body_schema(ForwardBackwardRequest))
async def forward_backward(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    """JSON (SDK ≤0.24) or protobuf, optionally zstd (SDK ≥0.25; ``forward_only`` is a forward pass), decoded once
    by the auth middleware; the typed protobuf request is what the service queues."""
    decoded = await tinker_body(request)
    if isinstance(decoded, WireDecodeError):  # the op named by the ids the decoder read (owner-checked) is refused
        await ops.refuse(decoded.model_id, decoded.seq_id, decoded)
        raise decoded
    if isinstance(decoded, dict):
        return encode(
            await ops.submit_op(
                "forward_backward", decoded, lambda d: ForwardBackwardRequest.model_validate(d), principal
            )
        )
    kind = "forward" if decoded.forward_only else "forward_backward"
    return encode(
        await ops.submit_op(kind, decoded.model_dump(mode="json", exclude_none=True), lambda _: decoded, principal)
    )


@router.post("/optim_step", openapi_extra=body_schema(OptimStepRequest))
async def optim_step(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    return encode(
        await ops.submit_op(
            "optim_step", await body_json(request), lambda d: OptimStepRequest.model_validate(d), principal
        )
    )


@router.post("/save_weights", openapi_extra=body_schema(SaveWeightsRequest))
async def save_weights(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    return encode(
        await ops.submit_op(
            "save_weights", await body_json(request), lambda d: SaveWeightsRequest.model_validate(d), principal
        )
    )


@router.post("/save_weights_for_sampler", openapi_extra=body_schema(SaveWeightsForSamplerRequest))
async def save_weights_for_sampler(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    return encode(
        await ops.submit_op(
            "save_weights_for_sampler",
            await body_json(request),
            lambda d: SaveWeightsForSamplerRequest.model_validate(d),
            principal,
        )
    )


@router.post("/save_weights_external", openapi_extra=body_schema(SaveWeightsExternalRequest))
async def save_weights_external(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    """The run's current LoRA weights as a PEFT adapter directory, ``tinker://<model_id>/external_weights/<path>``
    (its files: ``…/checkpoints/external_weights/<path>/external_weights_urls``)."""
    return encode(
        await ops.submit_op(
            "save_weights_external",
            await body_json(request),
            lambda d: SaveWeightsExternalRequest.model_validate(d),
            principal,
        )
    )


@router.post("/load_weights", openapi_extra=body_schema(LoadWeightsRequest))
async def load_weights(request: Request, ops: TrainingOpsDep, principal: PrincipalDep) -> Response:
    data = await body_json(request)
    if data.get("model_id") is not None or data.get("seq_id") is not None:  # load into an existing model
        return encode(
            await ops.submit_op("load_weights", data, lambda d: LoadWeightsRequest.model_validate(d), principal)
        )
    return encode(await ops.create_via_load(parse(LoadWeightsRequest, data), principal))


@router.post("/retrieve_future", openapi_extra=body_schema(FutureRetrieveRequest))
async def retrieve_future(request: Request, sessions: SessionsDep) -> Response:
    req = await decode(request, FutureRetrieveRequest)
    result = await sessions.retrieve_future(req.request_id)
    if isinstance(result, NotReady):
        return encode(TryAgainResponse(request_id=req.request_id), status_code=408)
    if wire.wants_proto(request.headers.get("accept")) and (body := wire.encode_future_result(result)) is not None:
        return Response(body, media_type=wire.PROTO_CONTENT_TYPE)
    return encode(result)


# ------------------------------------------------------------------------------------------------ checkpoints
@router.post("/weights_info", openapi_extra=body_schema(WeightsInfoRequest))
async def weights_info(request: Request, checkpoints: CheckpointsDep) -> Response:
    return encode(checkpoints.weights_info((await decode(request, WeightsInfoRequest)).tinker_path))


@router.get("/training_runs")
async def list_training_runs(
    checkpoints: CheckpointsDep, principal: PrincipalDep, limit: int = 20, offset: int = 0
) -> Response:
    return encode(await checkpoints.list_training_runs(principal, limit, offset))


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, checkpoints: CheckpointsDep) -> Response:
    return encode(await checkpoints.training_run(model_id))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, checkpoints: CheckpointsDep) -> Response:
    return encode(checkpoints.list_checkpoints(model_id))


@router.get("/checkpoints")
async def list_user_checkpoints(
    checkpoints: CheckpointsDep, principal: PrincipalDep, limit: int = 100, offset: int = 0
) -> Response:
    return encode(checkpoints.list_user_checkpoints(principal, limit, offset))


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/archive")
async def checkpoint_archive_url(
    model_id: str, checkpoint_id: str, base_url: PublicUrlDep, checkpoints: CheckpointsDep
) -> Response:
    return encode(checkpoints.archive_url(model_id, checkpoint_id, base_url))


@router.get("/checkpoint_archives/{name}")
async def checkpoint_archive(name: str, checkpoints: CheckpointsDep) -> Response:
    """The tar behind a signed archive URL (public route: the signature in ``name`` is the credential)."""
    name, data = checkpoints.archive(name)
    return Response(
        data, media_type="application/x-tar", headers={"Content-Disposition": f'attachment; filename="{name}"'}
    )


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    model_id: str, checkpoint_id: str, base_url: PublicUrlDep, checkpoints: CheckpointsDep
) -> Response:
    """Signed URLs, one per file, of an ``external_weights/<name>`` checkpoint (SDK 0.38 ``tinker checkpoint
    download``, ``RestClient.get_external_weights_urls``)."""
    return encode(checkpoints.external_weights_urls(model_id, checkpoint_id, base_url))


@router.get("/external_weights_files/{token}/{file_name}")
async def external_weights_file(token: str, file_name: str, checkpoints: CheckpointsDep) -> Response:
    """One file behind a signed external-weights URL (public route: the signature in ``token`` is the credential;
    the SDK fetches it with plain ``urllib``)."""
    path = checkpoints.external_file(token, file_name)
    media = "application/json" if file_name.endswith(".json") else "application/octet-stream"
    return FileResponse(path, media_type=media, filename=file_name)


@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(
    model_id: str, checkpoint_id: str, request: Request, checkpoints: CheckpointsDep
) -> Response:
    if data := await body_json(request):  # no body is needed; one that is sent must be an empty JSON object
        raise BadRequestError(
            f"publish takes no fields: unknown field {next(iter(data))!r}",
            param=next(iter(data)),
            code="unknown_parameter",
        )
    checkpoints.set_public(model_id, checkpoint_id, True)
    return Response(status_code=204)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish_checkpoint(model_id: str, checkpoint_id: str, checkpoints: CheckpointsDep) -> Response:
    checkpoints.set_public(model_id, checkpoint_id, False)
    return Response(status_code=204)


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(
    model_id: str, checkpoint_id: str, request: Request, checkpoints: CheckpointsDep
) -> Response:
    checkpoints.set_ttl(model_id, checkpoint_id, (await decode(request, CheckpointTtlRequest)).ttl_seconds)
    return Response(status_code=204)


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


@router.post("/asample", openapi_extra=body_schema(SampleRequestV2))
async def asample(request: Request, samples: SamplesDep, principal: PrincipalDep) -> Response:
    return encode(await samples.asample(await decode(request, SampleRequestV2), principal))


@router.post("/join_sampling_session")
async def join_sampling_session(request: Request, sampling: SamplingDep) -> Response:
    req = await decode(request, JoinSamplingSessionRequest)
    return encode(
        JoinSamplingSessionResponse(client_counter=await sampling.join_sampling_session(req.sampling_session_id))
    )


@router.post("/retrieve_futures")
async def retrieve_futures(request: Request, sampling: SamplingDep) -> Response:
    req = await decode(request, FuturesRetrieveRequest)
    done, cursor = await sampling.retrieve_futures(
        req.target.sampling_session_id, req.target.cloned_sampler_id, req.prev_cursor, req.timeout
    )
    return encode(FuturesRetrieveResponse.model_validate({"completions": done, "cursor": cursor}))


@router.post("/cancel_future")
async def cancel_future(request: Request, samples: SamplesDep) -> Response:
    req = await decode(request, CancelFutureRequest)
    return encode({"request_id": req.request_id, "cancelled": await samples.cancel_future(req.request_id)})


# ------------------------------------------------------------------------------------------------ not built
@router.post("/create_custom_loss")
async def create_custom_loss(request: Request) -> Response:
    await body_json(request)  # a body that is not JSON is named as such first
    raise NotBuiltError(
        "server-side custom losses are not built (client/config leaves custom_loss_server_side "
        "off): forward_backward_custom runs the loss on the client, which needs no server support"
    )


@router.post("/copy_weights")
async def copy_weights(request: Request) -> Response:
    await body_json(request)  # a body that is not JSON is named as such first
    raise NotBuiltError(
        "copy_weights is not built: livelora has one owner per store, so every session can "
        "already load any checkpoint by its tinker:// path; use that path directly"
    )


@router.get("/auth/apikey/me")
async def apikey_me(principal: PrincipalDep) -> Response:
    """The presented key's public metadata (``key_id`` is a stable number derived from livelora's key id)."""
    key = principal.key_id or "open"
    return encode(
        SelfApiKeyResponse(
            key_id=zlib.crc32(key.encode()),
            name=principal.name,
            note=f"livelora key of tenant {principal.tenant}; roles {', '.join(sorted(principal.roles))}",
            details={"org_details": {"name": principal.tenant}, "user_details": {}},
        )
    )


@router.delete("/auth/apikey/me")
async def apikey_me_revoke() -> Response:
    raise NotBuiltError("keys are revoked by an administrator: `livelora keys revoke KEY_ID`")
