"""Checkpoints of Tinker training runs: ``tinker://`` paths → adapter versions in the store; the RestClient surface.

:class:`Checkpoints` reads a run's checkpoint index (:class:`~livelora.core.session_protocol.CheckpointIndex`,
written by the op executor), deletes entries with their versions, publishes them and changes their TTL;
:meth:`Checkpoints.expire_due` deletes expired ones not in use; archive and external-weights downloads go through
URLs signed for :data:`SIGNED_URL_TTL_S`. The rules: ``docs/internals/training-sessions.md``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import io
import json
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from livelora.adapters.endpoints import EndpointStore
from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.clients.types.tinker import Cursor, WeightsInfoResponse
from livelora.clients.types.tinker_rest import (
    CheckpointArchiveUrlResponse,
    CheckpointsListResponseV2,
    CheckpointV2,
    ExternalWeightsUrlsResponse,
    TrainingRunsResponse,
    TrainingRunV2,
)
from livelora.core.api_keys import Principal
from livelora.core.object_ids import parse_ref
from livelora.core.owners import OwnerStore
from livelora.core.session_protocol import (
    CHECKPOINT_KINDS,
    CheckpointIndex,
    expires_at,
    is_expired,
    lineage_for,
    resolve_checkpoint,
    tinker_path,
)
from livelora.core.store_secret import store_secret
from livelora.gateway.services.sessions.context import SessionContext

#: Lifetime of a signed archive or external-weights file URL (seconds).
SIGNED_URL_TTL_S = 900
#: Files of a checkpoint archive (the SDK ≤0.24 CLI checks the first two and ``checkpoint_complete``) and of an
#: external-weights export: a PEFT adapter directory (``PeftModel.from_pretrained(base, dir)`` loads it).
ARCHIVE_FILES = ("adapter_config.json", "adapter_model.safetensors")
EXPORT_FILES = ARCHIVE_FILES


class Checkpoints:
    """Read, list, delete, publish, expire and archive training runs' checkpoints."""

    def __init__(self, ctx: SessionContext, engine: Any = None):
        self.ctx = ctx
        self.home = Path(ctx.home)
        self.store = ctx.store
        self.base_model = ctx.base_model
        self.engine = engine if engine is not None else ctx.engine

    # -------------------------------------------------------------------------------- reading
    def weights_info(self, path: str) -> WeightsInfoResponse:
        """Raises: BadRequestError (malformed path), NotFoundError (unknown checkpoint)."""
        index, _, _ = resolve_checkpoint(self.home, path)
        data = index.read()
        lora = data.get("lora") or {}
        return WeightsInfoResponse(
            base_model=data.get("base_model", self.base_model),
            lora_rank=lora.get("rank"),
            lora_alpha=lora.get("alpha"),
            train_unembed=lora.get("train_unembed"),
            train_mlp=lora.get("train_mlp"),
            train_attn=lora.get("train_attn"),
        )

    def _checkpoint(self, model_id: str, ckpt_id: str, entry: dict[str, Any]) -> CheckpointV2:
        kind, name = ckpt_id.split("/", 1)
        vdir = self.store.version_dir(lineage_for(model_id), int(entry["version"]))
        files = (
            [vdir / f for f in EXPORT_FILES]
            if kind == "external_weights"
            else (list(vdir.iterdir()) if vdir.is_dir() else [])
        )
        size = sum(f.stat().st_size for f in files if f.is_file()) if vdir.is_dir() else None
        return CheckpointV2(
            checkpoint_id=ckpt_id,
            checkpoint_type=CHECKPOINT_KINDS[kind],
            time=entry["time"],
            tinker_path=tinker_path(model_id, kind, name),
            adapter=entry.get("adapter"),
            size_bytes=size,
            public=bool(entry.get("public")),
            expires_at=entry.get("expires_at"),
            user_metadata=_str_dict(entry.get("user_metadata")),
        )

    def _entries(self, model_id: str) -> list[tuple[str, dict[str, Any]]]:
        entries = CheckpointIndex(self.home, model_id).read().get("checkpoints", {})
        return sorted(entries.items(), key=lambda kv: kv[1]["time"])

    def list_checkpoints(self, model_id: str) -> CheckpointsListResponseV2:
        """Raises: NotFoundError for an unknown training run."""
        items = [self._checkpoint(model_id, k, v) for k, v in self._entries(model_id)]
        return CheckpointsListResponseV2(
            checkpoints=items, cursor=Cursor(offset=0, limit=len(items), total_count=len(items))
        )

    def run_ids(self, tenant: str | None = None) -> list[str]:
        """Every training run with an index, oldest first; with ``tenant``, only those of its sessions (recorded
        owners, :mod:`livelora.core.owners`)."""
        runs = []
        for f in (self.home / "sessions").glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                data = json.loads(f.read_text())
                if data.get("model_id"):
                    runs.append((data.get("created") or "", data["model_id"]))
        ids = [m for _, m in sorted(runs)]
        if tenant is None:
            return ids
        owners = OwnerStore(self.home)
        return [m for m in ids if owners.owns("session", m.split(":", 1)[0], tenant)]

    def list_user_checkpoints(
        self, principal: Principal, limit: int = 100, offset: int = 0
    ) -> CheckpointsListResponseV2:
        """Every checkpoint of ``principal``'s tenant's training runs, newest first (``limit``/``offset`` page them)."""
        items = [self._checkpoint(m, k, v) for m in self.run_ids(principal.tenant) for k, v in self._entries(m)]
        items.sort(key=lambda c: c.time, reverse=True)
        return CheckpointsListResponseV2(
            checkpoints=items[offset : offset + limit],
            cursor=Cursor(offset=offset, limit=limit, total_count=len(items)),
        )

    async def training_run(self, model_id: str) -> TrainingRunV2:
        """Raises: NotFoundError for an unknown training run."""
        data = CheckpointIndex(self.home, model_id).read()
        ckpts = self.list_checkpoints(model_id).checkpoints
        last = next((c for c in reversed(ckpts) if c.checkpoint_type == "training"), None)
        last_s = next((c for c in reversed(ckpts) if c.checkpoint_type == "sampler"), None)
        last_request = await self.ctx.redis.get(self.ctx.keys.model_last_request(model_id))
        times = [t for t in (last_request, *(c.time.isoformat() for c in ckpts), data.get("created")) if t]
        when = max((_as_datetime(t) for t in times), default=datetime.now(UTC))
        return TrainingRunV2(
            training_run_id=model_id,
            base_model=data.get("base_model", self.base_model),
            model_owner="local",
            is_lora=True,
            lora_rank=(data.get("lora") or {}).get("rank"),
            last_request_time=when,
            last_checkpoint=last,
            last_sampler_checkpoint=last_s,
            user_metadata=_str_dict(data.get("user_metadata")),
        )

    async def list_training_runs(self, principal: Principal, limit: int = 20, offset: int = 0) -> TrainingRunsResponse:
        """``principal``'s tenant's training runs, most recent request first."""
        runs = []
        for model_id in self.run_ids(principal.tenant):
            with contextlib.suppress(NotFoundError):
                runs.append(await self.training_run(model_id))
        runs.sort(key=lambda r: r.last_request_time, reverse=True)
        return TrainingRunsResponse(
            training_runs=runs[offset : offset + limit],
            cursor=Cursor(offset=offset, limit=limit, total_count=len(runs)),
        )

    # -------------------------------------------------------------------------------- changing
    def _update_entry(self, model_id: str, checkpoint_id: str, fn) -> dict[str, Any]:
        kind, name = _split_id(checkpoint_id)
        index = CheckpointIndex(self.home, model_id)
        index.read()
        out: dict[str, Any] = {}

        def change(data: dict[str, Any]) -> None:
            entry = data.get("checkpoints", {}).get(checkpoint_id)
            if entry is None:
                raise NotFoundError(f"checkpoint {tinker_path(model_id, kind, name)} does not exist", param="path")
            fn(data["checkpoints"], entry)
            out.update(entry)

        index.update(change)
        return out

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint (its adapter version too).

        Raises:
            BadRequestError: malformed checkpoint id. NotFoundError: unknown run or checkpoint.
        """
        removed = self._update_entry(model_id, checkpoint_id, lambda ckpts, entry: ckpts.pop(checkpoint_id))
        with contextlib.suppress(NotFoundError):
            self.store.delete(lineage_for(model_id), int(removed["version"]))

    def set_public(self, model_id: str, checkpoint_id: str, public: bool) -> None:
        """Publish or unpublish. livelora has one owner per store, so ``public`` is recorded and listed; every
        caller with the ``train`` role can already read every checkpoint. Raises as :meth:`delete_checkpoint`."""
        self._update_entry(model_id, checkpoint_id, lambda ckpts, entry: entry.__setitem__("public", public))

    def set_ttl(self, model_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """``expires_at`` = now + ``ttl_seconds`` (None: kept until deleted). Raises as :meth:`delete_checkpoint`."""
        self._update_entry(
            model_id, checkpoint_id, lambda ckpts, entry: entry.__setitem__("expires_at", expires_at(ttl_seconds))
        )

    # -------------------------------------------------------------------------------- expiry
    def _in_use(self) -> tuple[set[str], set[str]]:
        """(adapter names loaded in the engine, lineages bound to an endpoint)."""
        loaded = set(self.engine.loaded_adapters()) if self.engine is not None else set()
        bound = {b.lineage for b in EndpointStore(self.home).all().values()}
        return loaded, bound

    def expire_due(self, now: datetime | None = None) -> list[str]:
        """Delete every checkpoint whose ``expires_at`` has passed and that is not in use (see the module
        docstring); returns the deleted tinker paths."""
        loaded, bound = self._in_use()
        deleted: list[str] = []
        for model_id in self.run_ids():
            lineage = lineage_for(model_id)
            for ckpt_id, entry in self._entries(model_id):
                if not is_expired(entry, now) or entry.get("adapter") in loaded or lineage in bound:
                    continue
                with contextlib.suppress(NotFoundError):
                    self.delete_checkpoint(model_id, ckpt_id)
                    deleted.append(tinker_path(model_id, *ckpt_id.split("/", 1)))
        return deleted

    # -------------------------------------------------------------------------------- signed URLs
    def _secret(self) -> bytes:
        return store_secret(self.home, "archive_secret")  # the key of every signed URL

    def _sign(self, purpose: str, fields: list[Any]) -> tuple[str, datetime]:
        """``(token, expiry)``: ``fields`` plus an expiry :data:`SIGNED_URL_TTL_S` from now, as URL-safe base64,
        ``.``, and the hex HMAC-SHA256 of ``purpose:payload`` under the store's secret."""
        expiry = int(time.time()) + SIGNED_URL_TTL_S
        payload = base64.urlsafe_b64encode(json.dumps([*fields, expiry]).encode()).decode()
        sig = hmac.new(self._secret(), f"{purpose}:{payload}".encode(), hashlib.sha256).hexdigest()
        return f"{payload}.{sig}", datetime.fromtimestamp(expiry, UTC)

    def _verify(self, purpose: str, token: str) -> list[Any]:
        """The signed fields of a token :meth:`_sign` made for ``purpose`` (the expiry removed).

        Raises: NotFoundError (a bad signature, another purpose's token, or an expired one: the routes that take
        tokens are public, so a URL that does not verify is "not found").
        """
        payload, _, sig = token.rpartition(".")
        good = hmac.new(self._secret(), f"{purpose}:{payload}".encode(), hashlib.sha256).hexdigest()
        if not payload or not hmac.compare_digest(sig, good):
            raise NotFoundError("unknown download URL (its signature does not verify)", code="invalid_signature")
        *fields, expiry = json.loads(base64.urlsafe_b64decode(payload.encode()))
        if time.time() > expiry:
            raise NotFoundError("this download URL has expired; ask for a new one", code="expired_url")
        return fields

    # -------------------------------------------------------------------------------- archives
    def archive_url(self, model_id: str, checkpoint_id: str, base_url: str) -> CheckpointArchiveUrlResponse:
        """A signed URL of the checkpoint's tar, valid :data:`SIGNED_URL_TTL_S` seconds.

        Raises: BadRequestError (malformed id), NotFoundError (unknown run or checkpoint).
        """
        kind, name = _split_id(checkpoint_id)
        CheckpointIndex(self.home, model_id).resolve(kind, name)
        token, expires = self._sign("archive", [model_id, checkpoint_id])
        return CheckpointArchiveUrlResponse(
            url=f"{base_url.rstrip('/')}/api/v1/checkpoint_archives/{token}", expires=expires
        )

    def archive(self, token: str) -> tuple[str, bytes]:
        """``(file name, tar bytes)`` for a signed archive token.

        Raises: NotFoundError (a bad signature, an expired URL, or a checkpoint deleted since).
        """
        model_id, checkpoint_id = self._verify("archive", token)
        kind, _, name = checkpoint_id.partition("/")
        version = CheckpointIndex(self.home, model_id).resolve(kind, name)
        vdir = self.store.version_dir(lineage_for(model_id), version)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for fname in ARCHIVE_FILES:
                tar.add(vdir / fname, arcname=fname)
            info = tarfile.TarInfo("checkpoint_complete")
            tar.addfile(info, io.BytesIO(b""))
        return f"{model_id}_{kind}_{name}.tar".replace(":", "_"), buf.getvalue()

    # -------------------------------------------------------------------------------- external weights
    def external_weights_urls(self, model_id: str, checkpoint_id: str, base_url: str) -> ExternalWeightsUrlsResponse:
        """One signed URL per file of an external-weights export (:data:`EXPORT_FILES`), all valid
        :data:`SIGNED_URL_TTL_S` seconds; each serves the file's bytes without an API key
        (``GET /api/v1/external_weights_files/<token>/<file>``).

        Raises:
            BadRequestError: a malformed id, or a checkpoint of another kind (only ``external_weights/<name>``
                has file URLs). NotFoundError: unknown run or checkpoint.
        """
        kind, name = _split_id(checkpoint_id)
        if kind != "external_weights":
            raise BadRequestError(
                f"{tinker_path(model_id, kind, name)} is not an external-weights checkpoint: only "
                "tinker://<model_id>/external_weights/<name> (made by save_weights_external) has "
                "file URLs; a training checkpoint downloads as a tar from …/archive",
                param="checkpoint_id",
            )
        CheckpointIndex(self.home, model_id).resolve(kind, name)
        urls, expires = {}, None
        for fname in EXPORT_FILES:
            token, expires = self._sign("file", [model_id, checkpoint_id, fname])
            urls[fname] = f"{base_url.rstrip('/')}/api/v1/external_weights_files/{token}/{fname}"
        return ExternalWeightsUrlsResponse(urls=urls, expires=expires)

    def external_file(self, token: str, fname: str) -> Path:
        """The file a signed external-weights URL names.

        Raises: NotFoundError (a bad signature, a file name other than the signed one, an expired URL, or an
        export deleted since).
        """
        model_id, checkpoint_id, signed_name = self._verify("file", token)
        if fname != signed_name:
            raise NotFoundError("unknown download URL (its signature does not verify)", code="invalid_signature")
        kind, _, name = checkpoint_id.partition("/")
        version = CheckpointIndex(self.home, model_id).resolve(kind, name)
        path = self.store.version_dir(lineage_for(model_id), version) / fname
        if not path.is_file():
            raise NotFoundError(f"checkpoint {tinker_path(model_id, kind, name)} has no file {fname}", param="path")
        return path


def _split_id(checkpoint_id: str) -> tuple[str, str]:
    """``(kind, name)`` of a checkpoint id ``<kind>/<name>``.

    Raises: BadRequestError: another form, an unknown kind or a name in another spelling (``invalid_id``).
    """
    parse_ref("checkpoint", checkpoint_id, param="checkpoint_id")  # one spelling, as in a tinker:// path
    kind, _, name = checkpoint_id.partition("/")
    return kind, name


def _str_dict(d: Any) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) else None


def _as_datetime(value: str) -> datetime:
    dt = datetime.fromisoformat(value)
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)
