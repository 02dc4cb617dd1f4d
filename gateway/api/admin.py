"""``/admin`` routes (role ``admin``, enforced by :mod:`livelora.gateway.middleware.auth`), scoped to the caller's
tenant.

Handlers call one :class:`~livelora.gateway.services.tenants.admin.GatewayAdmin` method and encode its answer. A change
to an endpoint is applied to this gateway's registry before the answer and announced to the other gateways.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from livelora.clients.types.admin import (
    CreateEndpointRequest,
    CreateKeyRequest,
    CreateSegmentRequest,
    ExportRequest,
    ForgetRequest,
    GateRequest,
    LearningPauseRequest,
    PromoteRequest,
    RollbackRequest,
    SegmentMembersRequest,
)
from livelora.gateway.api.deps import AdminDep

router = APIRouter(prefix="/admin", tags=["admin"])


def _entries(entries) -> list[dict]:
    return [e.model_dump(mode="json", by_alias=True) for e in entries]


@router.get("/endpoints")
async def list_endpoints(admin: AdminDep) -> dict:
    """``{"data": [endpoint, ...]}`` of the caller's tenant."""
    return {"data": admin.list_endpoints()}


@router.post("/endpoints", status_code=201)
async def create_endpoint(body: CreateEndpointRequest, admin: AdminDep) -> dict:
    """Create an endpoint. 400 if a name is outside the caller's namespace (``<tenant>.<rest>``; ``default``: no
    such prefix), 409 if a name of its own namespace is taken."""
    return await admin.create_endpoint(
        body.name, body.lineage, mode=body.mode, version=body.version, reason=body.reason
    )


@router.get("/endpoints/{name:path}/history")
async def endpoint_history(name: str, admin: AdminDep) -> dict:
    """Audit entries of one endpoint, oldest first."""
    return {"data": _entries(admin.history(name))}


@router.post("/endpoints/{name:path}/promote")
async def promote(name: str, body: PromoteRequest, admin: AdminDep) -> dict:
    """Pin ``name`` to a stored version (or follow its lineage); answers once this gateway serves it."""
    entry, endpoint = await admin.promote(name, body.version, follow=body.follow, reason=body.reason)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": endpoint}


@router.post("/endpoints/{name:path}/rollback")
async def rollback(name: str, body: RollbackRequest, admin: AdminDep) -> dict:
    """Back to the version served before the last promotion."""
    entry, endpoint = await admin.rollback(name, reason=body.reason)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": endpoint}


@router.post("/endpoints/{name:path}/pause")
async def pause_learning(name: str, body: LearningPauseRequest, admin: AdminDep) -> dict:
    """Stop training the endpoint's lineage (signals stay queued) until ``resume``; serving is unchanged."""
    entry, endpoint = await admin.set_learning(name, True, reason=body.reason)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": endpoint}


@router.post("/endpoints/{name:path}/resume")
async def resume_learning(name: str, body: LearningPauseRequest, admin: AdminDep) -> dict:
    """Train the endpoint's lineage again (the queued signals first)."""
    entry, endpoint = await admin.set_learning(name, False, reason=body.reason)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": endpoint}


@router.get("/endpoints/{name:path}/stats")
async def endpoint_stats(name: str, admin: AdminDep) -> dict:
    """Per-version live statistics: requests, ratings, thumbs-up rate with its 95 % interval."""
    return await admin.stats(name)


@router.put("/endpoints/{name:path}/gate")
async def set_gate(name: str, body: GateRequest, admin: AdminDep) -> dict:
    """Set the endpoint's evaluation-gate thresholds (null: the defaults)."""
    entry, endpoint = await admin.set_gate(name, body.thresholds, reset=body.reset, reason=body.reason)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": endpoint}


@router.get("/endpoints/{name:path}/segments")
async def list_segments(name: str, admin: AdminDep) -> dict:
    """The endpoint's segments with their members, lineages and the versions they target."""
    return {"data": admin.segments.list(name)}


@router.post("/endpoints/{name:path}/segments", status_code=201)
async def create_segment(name: str, body: CreateSegmentRequest, admin: AdminDep) -> dict:
    """A segment of the endpoint: its own lineage, starting from the version the endpoint serves now. 409 if it
    exists or the endpoint has the most segments."""
    return await admin.segments.create(name, body.name, reason=body.reason)


@router.post("/endpoints/{name:path}/segments/{segment}/assign")
async def assign_segment(name: str, segment: str, body: SegmentMembersRequest, admin: AdminDep) -> dict:
    """Add users, API key ids or header values to a segment; 409 if one is in a segment of the endpoint already."""
    members = {"users": body.users, "keys": body.keys, "headers": body.headers}
    return await admin.segments.assign(name, segment, members, remove=False, reason=body.reason)


@router.post("/endpoints/{name:path}/segments/{segment}/unassign")
async def unassign_segment(name: str, segment: str, body: SegmentMembersRequest, admin: AdminDep) -> dict:
    """Take members out of a segment (404 for one that is not in it); their requests go to the shared version."""
    members = {"users": body.users, "keys": body.keys, "headers": body.headers}
    return await admin.segments.assign(name, segment, members, remove=True, reason=body.reason)


@router.get("/endpoints/{name:path}")
async def get_endpoint(name: str, admin: AdminDep) -> dict:
    """One endpoint (404 if missing or another tenant's)."""
    return admin.get_endpoint(name)


@router.get("/quarantine")
async def quarantine(admin: AdminDep) -> dict:
    """Events kept out of training by feedback governance (rate-limit bursts), oldest first."""
    return {"data": admin.quarantine()}


@router.get("/raters")
async def raters(admin: AdminDep) -> dict:
    """Rater agreement weights on the caller's lineages (weight each rater's examples get in training),
    lowest first."""
    return {"data": await admin.raters()}


@router.post("/users/{name}/forget")
async def forget_user(name: str, body: ForgetRequest, admin: AdminDep) -> dict:
    """Delete a user's signals and completions on the caller's endpoints (right to be forgotten); later
    training batches exclude them."""
    return await admin.forget_user(name, reason=body.reason)


@router.get("/history")
async def history(admin: AdminDep) -> dict:
    """Every audit entry of the caller's tenant, oldest first."""
    return {"data": _entries(admin.history())}


@router.get("/adapters")
async def list_adapters(admin: AdminDep, lineage: str | None = None) -> dict:
    """Visible adapter versions with the endpoints serving each."""
    return {"data": admin.list_adapters(lineage)}


@router.get("/adapters/{name}")
async def show_adapter(name: str, admin: AdminDep) -> dict:
    """One version (``<lineage>@<n>``): manifest, files, sha256 check, serving endpoints."""
    return await admin.show_adapter(name)


@router.delete("/adapters/{name}")
async def delete_adapter(name: str, admin: AdminDep) -> dict:
    """Delete a version; 409 while an endpoint targets it."""
    await admin.delete_adapter(name)
    return {"deleted": name}


@router.post("/adapters/{name}/export")
async def export_adapter(name: str, body: ExportRequest, admin: AdminDep) -> dict:
    """Export into ``<home>/exports/<name>.<format>`` (reused when it exists; ``path`` is relative to the store,
    never a server file path); download it with ``GET /admin/exports/{name}/{format}``."""
    path, files = await admin.export(name, body.format)
    return {
        "adapter": name,
        "format": body.format,
        "path": f"exports/{path.name}",
        "files": files,
        "download": f"/admin/exports/{name}/{body.format}",
    }


@router.get("/exports/{name}/{fmt}")
async def download_export(name: str, fmt: str, admin: AdminDep) -> Response:
    """An export directory as an uncompressed tar (``application/x-tar``)."""
    data, filename = await admin.export_tar(name, fmt)
    return Response(
        data, media_type="application/x-tar", headers={"Content-Disposition": f'attachment; filename="{filename}"'}
    )


@router.get("/keys")
async def list_keys(admin: AdminDep) -> dict:
    """The tenant's API keys (never the key or its hash)."""
    return {"data": admin.list_keys()}


@router.post("/keys", status_code=201)
async def create_key(body: CreateKeyRequest, admin: AdminDep) -> dict:
    """A new key for the caller's tenant; ``key`` is shown in this answer only."""
    return admin.create_key(list(body.roles), name=body.name, tenant=body.tenant)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, admin: AdminDep) -> dict:
    """Revoke a key (takes effect on every gateway at its next request)."""
    return admin.revoke_key(key_id)
