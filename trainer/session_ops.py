"""The training ops themselves (:class:`SessionOps`), as the op executor runs them on a model it owns; the
ordering is :class:`~livelora.trainer.executor.OpExecutor`'s, ownership and recovery
:class:`~livelora.trainer.model_slots.ModelSlots`'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore, Manifest
from livelora.clients.errors import (
    BadRequestError,
    ConflictError,
    InternalError,
    LiveloraError,
    NotFoundError,
    UnsupportedParameterError,
)
from livelora.clients.types.tinker import (
    AdamParams,
    CreateModelRequest,
    ForwardBackwardInput,
    LoadWeightsRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)
from livelora.clients.types.tinker_ext import SaveWeightsExternalRequest
from livelora.core.metering import datum_tokens
from livelora.core.redis_keys import KeyLayout
from livelora.core.session_protocol import (
    CheckpointIndex,
    Op,
    check_checkpoint_name,
    expires_at,
    lineage_for,
    now_iso,
    resolve_checkpoint,
    tinker_path,
)
from livelora.core.settings import SessionSection

log = __import__("logging").getLogger(__name__)


def delete_version(store: AdapterStore, lineage: str, version: int) -> None:
    """Delete ``lineage@version``; a failure is logged, not raised."""
    try:
        store.delete(lineage, version)
    except LiveloraError as exc:
        log.warning("could not delete %s@%d: %s", lineage, version, exc)


class SessionOps:
    """``create_model``, create-via-load, ``forward``, ``forward_backward``, ``optim_step``, ``save_weights``,
    ``save_weights_for_sampler``, ``save_weights_external``, ``load_weights`` on one model slot
    (:class:`~livelora.trainer.model_slots.ModelSlot`), for the one base model trained here.

    Args: as :class:`~livelora.trainer.executor.OpExecutor`'s (``home`` a :class:`~pathlib.Path`, ``store`` its
    adapter store).
    """

    def __init__(
        self,
        redis_client,
        keys: KeyLayout,
        home: Path,
        store: AdapterStore,
        settings: SessionSection,
        base_model: str,
        *,
        device: str,
        max_seq_len: int | None,
        base_model_aliases: tuple[str, ...],
        served_name: str | None,
        versions: Any,
    ):
        from livelora.core.base_models import HUB_IDS, resolve_base_model

        self.redis = redis_client
        self.keys = keys
        self.home = home
        self.store = store
        self.settings = settings
        self.base_model = served_name or settings.served_model_name or base_model
        self.base_names = {
            base_model,
            self.base_model,
            *base_model_aliases,
            *([HUB_IDS[base_model]] if base_model in HUB_IDS else []),
        }  # the canonical hub id
        self.base_ref = resolve_base_model(base_model, home)
        self.device = device
        self.max_seq_len = max_seq_len
        self.versions = versions  # max_adapter_versions (adapters/quotas.AdapterVersions); None: not checked

    def restore(self, state: dict[str, Any]) -> Any:
        """The training model of a recovery snapshot's ``state`` (:func:`~livelora.trainer.recovery.read_snapshot`)."""
        from livelora.trainer.recovery import restore_model

        return restore_model(state, self.base_ref, device=self.device, max_seq_len=self.max_seq_len)

    # -------------------------------------------------------------------------------- ops
    def run(self, slot: Any, op: Op) -> dict[str, Any]:
        """Run ``op`` on ``slot``'s model; returns the op's result. Raises the op's error (a :class:`LiveloraError`
        the client sees, anything else an internal error)."""
        if op.kind in ("create_model", "create_via_load"):
            return self._create(slot, op)
        if slot.model is None:
            raise NotFoundError(
                f"model {slot.model_id} is not available: {slot.broken or 'it was never created'}", param="model_id"
            )
        model = slot.model
        if op.kind in ("forward", "forward_backward"):
            fb = ForwardBackwardInput.model_validate(op.body["input"])
            slot.op_tokens = datum_tokens(fb.data)
            fn = model.forward if op.kind == "forward" else model.forward_backward
            return fn(fb.data, fb.loss_fn, fb.loss_fn_config).model_dump(mode="json")
        if op.kind == "optim_step":
            if slot.lost_grads:
                model.zero_grad()
                seqs = ", ".join(map(str, sorted(slot.lost_grads)))
                raise InternalError(
                    f"optim_step seq {op.seq_id} of {slot.model_id} was not applied: the gradients of "
                    f"forward_backward seq {seqs} were accumulated by a trainer process that died; another "
                    f"trainer took the model over from its state after seq {slot.saved_seq}. No optimizer "
                    "step is applied on lost gradients; the accumulated gradients were dropped: run "
                    "forward_backward again, then optim_step.",
                    code="trainer_lost",
                )
            metrics = model.optim_step(AdamParams.model_validate(op.body.get("adam_params") or {}))
            return {"metrics": metrics, "type": "optim_step"}
        if op.kind == "save_weights":
            return self._save_state(slot, SaveWeightsRequest.model_validate(op.body), op.request_id)
        if op.kind == "save_weights_for_sampler":
            return self._save_for_sampler(slot, SaveWeightsForSamplerRequest.model_validate(op.body), op.request_id)
        if op.kind == "save_weights_external":
            return self._save_external(slot, SaveWeightsExternalRequest.model_validate(op.body), op.request_id)
        if op.kind == "load_weights":
            req = LoadWeightsRequest.model_validate(op.body)
            index, _, version = resolve_checkpoint(self.home, req.path, want="weights")
            model.load_state(self.store, index.lineage, version, with_optimizer=req.optimizer)
            slot.lost_grads.clear()  # load_state dropped every gradient
            return {"path": req.path, "model_id": slot.model_id, "type": "load_weights"}
        raise BadRequestError(f"unknown op {op.kind!r}")

    def _check_base(self, name: str | None) -> None:
        if name is not None and name not in self.base_names:
            raise NotFoundError(
                f"base model {name!r} is not served here; this server trains {self.base_model!r}", param="base_model"
            )

    def _create(self, slot: Any, op: Op) -> dict[str, Any]:
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
                model = TrainingModel.from_version(
                    self.base_ref, self.store, index.lineage, version, with_optimizer=req.optimizer, **kw
                )
                user_metadata = req.user_metadata
        except LiveloraError as exc:
            slot.broken = str(exc)
            raise
        slot.model = model
        lora = model.lora
        record = {
            "model_id": slot.model_id,
            "session_id": slot.session_id,
            "base_model": self.base_model,
            "lora": {**lora.model_dump(), "alpha": model.alpha},
            "state": "ready",
            "arch": type(model.peft_model.base_model.model).__name__,
            "tokenizer_id": str(self.base_ref.path),
            "user_metadata": user_metadata,
        }
        self.redis.set(self.keys.model(slot.model_id), json.dumps(record))
        CheckpointIndex(self.home, slot.model_id).update(
            lambda d: d.update(
                model_id=slot.model_id,
                base_model=self.base_model,
                lora=record["lora"],
                user_metadata=user_metadata,
                created=d.get("created") or now_iso(),
            ),
            fence=slot.token,
        )
        if op.kind == "create_model":
            return {"model_id": slot.model_id, "type": "create_model"}
        return {
            "model_id": slot.model_id,
            "path": LoadWeightsRequest.model_validate(op.body).path,
            "type": "load_weights",
        }

    def _save(
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
        """Save a named checkpoint; ``ttl_seconds`` sets its ``expires_at`` (housekeeping deletes it after
        that, never while in use: :meth:`livelora.gateway.services.sessions.Checkpoints.expire_due`).
        ``base_model_name_or_path``: what the version's ``adapter_config.json`` names as its base (default: the
        served base-model name).

        Raises:
            ConflictError: the name exists and not ``overwrite``.
            RateLimitError: a new name past the tenant's ``max_adapter_versions`` (nothing is written).
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
            versions.check(versions.tenant_of(index.lineage))
        manifest = slot.model.save_weights(
            self.store, index.lineage, with_optimizer=with_optimizer, base_model_name_or_path=base_model_name_or_path
        )
        entry = {
            "version": manifest.version,
            "time": now_iso(),
            "adapter": manifest.name,
            "request_id": request_id,
            "expires_at": expires_at(ttl_seconds),
            "user_metadata": user_metadata,
        }
        index.update(lambda d: d.setdefault("checkpoints", {}).__setitem__(key, entry), fence=slot.token)
        if old is not None:
            delete_version(self.store, index.lineage, int(old["version"]))
        return manifest

    def _save_state(self, slot: Any, req: SaveWeightsRequest, request_id: str) -> dict[str, Any]:
        name = check_checkpoint_name(req.path)
        self._save(
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

    def _save_external(self, slot: Any, req: SaveWeightsExternalRequest, request_id: str) -> dict[str, Any]:
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
        manifest = self._save(
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

    def _save_for_sampler(self, slot: Any, req: SaveWeightsForSamplerRequest, request_id: str) -> dict[str, Any]:
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
            manifest = self._save(
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
