"""The save ops of a training session (:class:`CheckpointSaves`): named checkpoints (``weights``,
``sampler_weights``, ``external_weights``) in the model's checkpoint index, and ephemeral sampler weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import BadRequestError, ConflictError, LiveloraError, UnsupportedParameterError
from livelora.clients.types.tinker import SaveWeightsForSamplerRequest, SaveWeightsRequest
from livelora.clients.types.tinker_ext import SaveWeightsExternalRequest
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import (
    CheckpointIndex,
    check_checkpoint_name,
    expires_at,
    lineage_for,
    now_iso,
    tinker_path,
)
from livelora.core.settings import SessionSection

log = logging.getLogger(__name__)


def delete_version(store: AdapterStore, lineage: str, version: int) -> None:
    """Delete ``lineage@version``; a failure is logged, not raised."""
    try:
        store.delete(lineage, version)
    except LiveloraError as exc:
        log.warning("could not delete %s@%d: %s", lineage, version, exc)


class CheckpointSaves:
    """``save_weights``, ``save_weights_for_sampler`` and ``save_weights_external`` on one model slot.

    Args:
        redis_client, keys, home, store, settings: the executor's.
        base_model: the served base-model name (written in sampler records and adapter configs).
        base_ref: the resolved base model (its hub id goes into exported adapter configs).
        versions: the tenants' ``max_adapter_versions``, checked again before a new name is written (``None``: not).
    """

    def __init__(
        self,
        redis_client,
        keys: KeyLayout,
        home: Path,
        store: AdapterStore,
        settings: SessionSection,
        base_model: str,
        base_ref: Any,
        versions: Any,
    ):
        self.redis = redis_client
        self.keys = keys
        self.home = home
        self.store = store
        self.settings = settings
        self.base_model = base_model
        self.base_ref = base_ref
        self.versions = versions  # max_adapter_versions (adapters/quotas.AdapterVersions); None: not checked

    def save(
        self,
        slot: Any,
        kind: str,
        name: str,
        overwrite: bool,
        with_optimizer: bool,
        request_id: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, Any] | None = None,
        base_model_name_or_path: str | None = None,
    ) -> Manifest:
        """Save a named checkpoint; ``ttl_seconds`` (default ``checkpoint_retention_s``) sets its ``expires_at``
        (housekeeping deletes it after that, never while in use:
        :meth:`livelora.gateway.services.sessions.Checkpoints.expire_due`).
        ``base_model_name_or_path``: what the version's ``adapter_config.json`` names as its base (default: the
        served base-model name).

        Raises:
            ConflictError: the name exists and not ``overwrite``.
            RateLimitError: a new name past the tenant's ``max_adapter_versions`` or ``max_adapter_bytes`` (the
                LoRA tensors in float32, × 3 with the optimizer; nothing is written).
        """
        index = CheckpointIndex(self.home, slot.model_id)
        key = f"{kind}/{name}"
        old = index.read().get("checkpoints", {}).get(key)
        if old is not None and old.get("request_id") == request_id:  # this very op, run by an owner that died
            return self.store.get(index.lineage, int(old["version"]))
        if old is not None and not overwrite:
            raise ConflictError(
                f"checkpoint {tinker_path(slot.model_id, kind, name)} exists; pass overwrite=True or use another name",
                param="path",
            )
        versions = self.versions  # max_adapter_versions, checked again here: saves queued
        if old is None and versions is not None:  # together below the limit must not all pass it
            size = sum(p.numel() * 4 for p in slot.model.lora_params.values()) * (3 if with_optimizer else 1)
            versions.check(versions.tenant_of(index.lineage), adding_bytes=size)
        manifest = slot.model.save_weights(
            self.store, index.lineage, with_optimizer=with_optimizer, base_model_name_or_path=base_model_name_or_path
        )
        entry = {
            "version": manifest.version,
            "time": now_iso(),
            "adapter": manifest.name,
            "request_id": request_id,
            "expires_at": expires_at(ttl_seconds if ttl_seconds is not None else self.settings.checkpoint_retention_s),
            "user_metadata": user_metadata,
        }
        index.update(lambda d: d.setdefault("checkpoints", {}).__setitem__(key, entry), fence=slot.token)
        if old is not None:
            delete_version(self.store, index.lineage, int(old["version"]))
        return manifest

    def save_state(self, slot: Any, req: SaveWeightsRequest, request_id: str) -> dict[str, Any]:
        name = check_checkpoint_name(req.path)
        self.save(
            slot,
            "weights",
            name,
            req.overwrite,
            with_optimizer=True,
            request_id=request_id,
            ttl_seconds=req.ttl_seconds,
            user_metadata=req.user_metadata,
        )
        return {"path": tinker_path(slot.model_id, "weights", name), "type": "save_weights"}

    def save_external(self, slot: Any, req: SaveWeightsExternalRequest, request_id: str) -> dict[str, Any]:
        """``save_weights_external``: the LoRA weights (no optimizer state) as a PEFT adapter directory,
        checkpoint ``external_weights/<path>`` (an existing one is replaced). Its ``adapter_config.json`` names the
        base model by its Hugging Face hub id where livelora knows one, so ``AutoPeftModelForCausalLM`` finds it.

        Returns:
            ``{"path": "tinker://<model_id>/external_weights/<path>", "size_bytes": bytes of the exported files,
            "type": "save_weights_external"}``.

        Raises:
            BadRequestError: invalid name; UnsupportedParameterError: ``age_encryption_recipients`` (the gateway
            refuses both before queueing; checked again for ops queued by an older gateway).
        """
        from livelora.adapters.store import CONFIG_FILE, WEIGHTS_FILE
        from livelora.core.base_models import HUB_IDS

        name = check_checkpoint_name(req.path)
        if req.age_encryption_recipients:
            raise UnsupportedParameterError(
                "age_encryption_recipients is not supported", param="age_encryption_recipients"
            )
        hub_id = next((HUB_IDS[n] for n in (self.base_ref.name, self.base_model) if n in HUB_IDS), None)
        manifest = self.save(
            slot,
            "external_weights",
            name,
            True,
            with_optimizer=False,
            request_id=request_id,
            ttl_seconds=req.ttl_seconds,
            base_model_name_or_path=hub_id,
        )
        vdir = self.store.version_dir(manifest.lineage, manifest.version)
        size = sum((vdir / f).stat().st_size for f in (WEIGHTS_FILE, CONFIG_FILE))
        return {
            "path": tinker_path(slot.model_id, "external_weights", name),
            "size_bytes": size,
            "type": "save_weights_external",
        }

    def save_for_sampler(self, slot: Any, req: SaveWeightsForSamplerRequest, request_id: str) -> dict[str, Any]:
        if req.ttl_seconds is not None and req.path is None:
            raise UnsupportedParameterError(
                "ttl_seconds applies to named sampler checkpoints (path); ephemeral "
                "sampler weights end with their session",
                param="ttl_seconds",
            )
        if req.kind == "inflight":
            raise UnsupportedParameterError("kind='inflight' is not supported; use 'snapshot'", param="kind")
        if (req.path is None) == (req.sampling_session_seq_id is None):
            raise BadRequestError(
                "give exactly one of path (a named sampler checkpoint) and sampling_session_seq_id "
                "(ephemeral weights for a new sampling session)",
                param="path",
            )
        if req.path is not None:
            name = check_checkpoint_name(req.path)
            manifest = self.save(
                slot,
                "sampler_weights",
                name,
                True,
                with_optimizer=False,
                request_id=request_id,
                ttl_seconds=req.ttl_seconds,
                user_metadata=req.user_metadata,
            )
            return {
                "path": tinker_path(slot.model_id, "sampler_weights", name),
                "adapter": manifest.name,
                "type": "save_weights_for_sampler",
            }
        manifest = slot.model.save_weights(self.store, lineage_for(slot.model_id))  # deleted when the model is freed
        sampling_id = f"{slot.session_id}:sample:{req.sampling_session_seq_id}"
        record = {
            "sampler_id": sampling_id,
            "session_id": slot.session_id,
            "base_model": self.base_model,
            "model_path": None,
            "adapter": manifest.name,
            "adapter_path": str(self.store.version_dir(manifest.lineage, manifest.version)),
        }
        self.redis.set(self.keys.sampler(sampling_id), json.dumps(record), ex=self.settings.future_ttl_s)
        return {
            "sampling_session_id": sampling_id,
            "path": None,
            "adapter": manifest.name,
            "type": "save_weights_for_sampler",
        }
