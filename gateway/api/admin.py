"""``/admin`` routes (role ``admin``, enforced by :mod:`livelora.gateway.auth`), scoped to the caller's tenant.

Handlers call :class:`~livelora.gateway.admin.AdminService`. A change to an endpoint is applied to this
gateway's registry before the answer (so the next request here gets the new version) and announced on
the notices channel so every other gateway re-reads ``endpoints.json`` at once.
"""

from __future__ import annotations

import asyncio
import io
import logging
import tarfile
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from livelora.adapters.api_keys import OPEN_PRINCIPAL, Principal
from livelora.clients.types.admin import (CreateEndpointRequest, CreateKeyRequest, ExportRequest, PromoteRequest,
                                          RollbackRequest)
from livelora.gateway.admin import AdminService, endpoint_notice

log = logging.getLogger(__name__)
router = APIRouter(prefix="/admin", tags=["admin"])


def _principal(request: Request) -> Principal:
    return getattr(request.state, "principal", None) or OPEN_PRINCIPAL


def _service(request: Request) -> AdminService:
    return AdminService(request.app.state.settings.home, _principal(request).tenant)


async def _apply(request: Request, endpoint: str) -> None:
    """Move this gateway now, then tell the others (a Redis failure only delays them until their resync)."""
    registry = getattr(request.app.state, "registry", None)
    if registry is None:
        return
    await registry.sync_from_store()
    try:
        await registry.client.publish(registry.keys.notices, endpoint_notice(endpoint))
    except Exception as exc:
        log.warning("endpoint %s changed but the notice was not published (%s); other gateways catch up "
                    "from the store", endpoint, exc)


@router.get("/endpoints")
async def list_endpoints(request: Request) -> dict:
    """``{"data": [endpoint, ...]}`` of the caller's tenant."""
    return {"data": _service(request).list_endpoints()}


@router.post("/endpoints", status_code=201)
async def create_endpoint(body: CreateEndpointRequest, request: Request) -> dict:
    """Create an endpoint. 409 if it exists or the lineage is another tenant's."""
    info = await asyncio.to_thread(_service(request).create_endpoint, body.name, body.lineage, mode=body.mode,
                                   version=body.version, who=_principal(request).who, reason=body.reason)
    await _apply(request, body.name)
    return info


@router.get("/endpoints/{name:path}/history")
async def endpoint_history(name: str, request: Request) -> dict:
    """Audit entries of one endpoint, oldest first."""
    _service(request).get_endpoint(name)
    return {"data": [e.model_dump(mode="json", by_alias=True) for e in _service(request).history(name)]}


@router.post("/endpoints/{name:path}/promote")
async def promote(name: str, body: PromoteRequest, request: Request) -> dict:
    """Pin ``name`` to a stored version (or follow its lineage); answers once this gateway serves it."""
    entry = await asyncio.to_thread(_service(request).promote, name, body.version, follow=body.follow,
                                    who=_principal(request).who, reason=body.reason)
    await _apply(request, name)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": _service(request).get_endpoint(name)}


@router.post("/endpoints/{name:path}/rollback")
async def rollback(name: str, body: RollbackRequest, request: Request) -> dict:
    """Back to the version served before the last promotion."""
    entry = await asyncio.to_thread(_service(request).rollback, name, who=_principal(request).who,
                                    reason=body.reason)
    await _apply(request, name)
    return {"history": entry.model_dump(mode="json", by_alias=True), "endpoint": _service(request).get_endpoint(name)}


@router.get("/endpoints/{name:path}")
async def get_endpoint(name: str, request: Request) -> dict:
    """One endpoint (404 if missing or another tenant's)."""
    return _service(request).get_endpoint(name)


@router.get("/history")
async def history(request: Request) -> dict:
    """Every audit entry of the caller's tenant, oldest first."""
    return {"data": [e.model_dump(mode="json", by_alias=True) for e in _service(request).history()]}


@router.get("/adapters")
async def list_adapters(request: Request, lineage: str | None = None) -> dict:
    """Visible adapter versions with the endpoints serving each."""
    return {"data": _service(request).list_adapters(lineage)}


@router.get("/adapters/{name}")
async def show_adapter(name: str, request: Request) -> dict:
    """One version (``<lineage>@<n>``): manifest, files, sha256 check, serving endpoints."""
    return await asyncio.to_thread(_service(request).show_adapter, name)


@router.delete("/adapters/{name}")
async def delete_adapter(name: str, request: Request) -> dict:
    """Delete a version; 409 while an endpoint targets it."""
    await asyncio.to_thread(_service(request).delete_adapter, name)
    return {"deleted": name}


@router.post("/adapters/{name}/export")
async def export_adapter(name: str, body: ExportRequest, request: Request) -> dict:
    """Export into ``<home>/exports/<name>.<format>`` (reused when it exists); download it with
    ``GET /admin/exports/{name}/{format}``."""
    path = await asyncio.to_thread(_service(request).export, name, body.format)
    files = {p.name: p.stat().st_size for p in sorted(Path(path).iterdir()) if p.is_file()}
    return {"adapter": name, "format": body.format, "path": str(path), "files": files,
            "download": f"/admin/exports/{name}/{body.format}"}


@router.get("/exports/{name}/{fmt}")
async def download_export(name: str, fmt: str, request: Request) -> Response:
    """An export directory as an uncompressed tar (``application/x-tar``)."""
    service = _service(request)
    service.manifest(name)  # 404 for other tenants' versions
    path = service.export_dir(name, fmt)
    if not path.is_dir():
        path = await asyncio.to_thread(service.export, name, fmt)

    def pack() -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p in sorted(path.iterdir()):
                if p.is_file():
                    tar.add(p, arcname=p.name)
        return buf.getvalue()

    return Response(await asyncio.to_thread(pack), media_type="application/x-tar",
                    headers={"Content-Disposition": f'attachment; filename="{path.name}.tar"'})


@router.get("/keys")
async def list_keys(request: Request) -> dict:
    """The tenant's API keys (never the key or its hash)."""
    return {"data": _service(request).list_keys()}


@router.post("/keys", status_code=201)
async def create_key(body: CreateKeyRequest, request: Request) -> dict:
    """A new key for the caller's tenant; ``key`` is shown in this answer only."""
    info, key = _service(request).create_key(list(body.roles), name=body.name)
    return {**info, "key": key}


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict:
    """Revoke a key (takes effect on every gateway at its next request)."""
    return _service(request).revoke_key(key_id)
