"""The training ops themselves (:class:`SessionOps`), as the op executor runs them on a model it owns; the
ordering is :class:`~livelora.trainer.executor.OpExecutor`'s, ownership and recovery
:class:`~livelora.trainer.model_slots.ModelSlots`', checkpoint saves :mod:`.checkpoint_saves`'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from livelora.adapters.store import AdapterStore
from livelora.clients.errors import BadRequestError, ConflictError, InternalError, LiveloraError, NotFoundError
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
from livelora.core.session_protocol import CheckpointIndex, Op, now_iso, resolve_checkpoint
from livelora.core.settings import SessionSection
from livelora.trainer.checkpoint_saves import CheckpointSaves


class SessionOps:
    """``create_model``, create-via-load, ``forward``, ``forward_backward``, ``optim_step``, ``save_weights``,
    ``save_weights_for_sampler``, ``save_weights_external``, ``load_weights`` on one model slot
    (:class:`~livelora.trainer.model_slots.ModelSlot`), for the one base model trained here; the saves are
    :class:`~livelora.trainer.checkpoint_saves.CheckpointSaves`'.

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
        self.saves = CheckpointSaves(
            redis_client, keys, home, store, settings, self.base_model, self.base_ref, versions
        )

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
            return self.saves.save_state(slot, SaveWeightsRequest.model_validate(op.body), op.request_id)
        if op.kind == "save_weights_for_sampler":
            return self.saves.save_for_sampler(
                slot, SaveWeightsForSamplerRequest.model_validate(op.body), op.request_id
            )
        if op.kind == "save_weights_external":
            return self.saves.save_external(slot, SaveWeightsExternalRequest.model_validate(op.body), op.request_id)
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
