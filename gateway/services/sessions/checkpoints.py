"""Checkpoints of Tinker training runs: ``tinker://`` paths → adapter versions in the store.

Each training run keeps a checkpoint index (:class:`~livelora.adapters.session_protocol.CheckpointIndex`,
``sessions/<lineage>.json``) mapping checkpoint ids (``weights/<name>``, ``sampler_weights/<name>``) to store
versions; the op executor writes it, these routes read it and delete entries (with their versions).
"""

from __future__ import annotations

import contextlib
from typing import Any

from livelora.adapters.session_protocol import (CHECKPOINT_KINDS, CheckpointIndex, lineage_for, resolve_checkpoint,
                                                tinker_path)
from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.clients.types.tinker import (Checkpoint, CheckpointsListResponse, Cursor, TrainingRun,
                                           WeightsInfoResponse)
from livelora.gateway.services.sessions.context import SessionContext


class Checkpoints:
    """Read and delete training runs' checkpoints (``weights_info``, ``training_runs``, ``checkpoints``)."""

    def __init__(self, ctx: SessionContext):
        self.home = ctx.home
        self.store = ctx.store
        self.base_model = ctx.base_model

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
