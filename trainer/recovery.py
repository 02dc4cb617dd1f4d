"""Recovery snapshots of training models: what a new owner restores when the old one died.

After every op that changes a model's saved state (``create_model``, create-via-load, ``optim_step``,
``load_weights``, and an ``optim_step`` refused because its gradients were lost) the owner writes a snapshot:
the LoRA tensors, the AdamW state, the step counter, the lineage/parent of its last saved version, the LoRA
shape, the seq id it follows and that op's future record. It is one ``torch.save`` file written atomically to
``<home>/sessions/<lineage>.recovery/<token>-<seq>.pt``; then the checkpoint index points at it
(``recovery``), under the index lock and checked against the owner's fencing token, so a stale owner's
snapshot is never pointed at. Gradients are never in a snapshot: at those points there are none.

Read with ``torch.load(weights_only=True)`` (tensors, dicts, lists, numbers and strings only).
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import torch

from livelora.clients.errors import InternalError
from livelora.clients.types.tinker import LoraConfig
from livelora.core.atomic import atomic_write_bytes
from livelora.core.session_protocol import CheckpointIndex

FORMAT = 1


def recovery_dir(index: CheckpointIndex) -> Path:
    """``<home>/sessions/<lineage>.recovery``."""
    return index.path.with_name(f"{index.lineage}.recovery")


def write_snapshot(index: CheckpointIndex, model: Any, *, seq: int, fence: int, result: str, request_id: str) -> Path:
    """Write a snapshot of ``model`` (a :class:`~livelora.trainer.model.TrainingModel` with no pending
    gradients) after op ``seq`` and point the index at it; older snapshot files are deleted.

    Args:
        result, request_id: the future record of op ``seq`` and its request id (a new owner resolves that
            future if the old one died before it did).

    Returns:
        The snapshot file.

    Raises:
        StaleOwnerError: ``fence`` is lower than the index's (the file is removed, the pointer unchanged).
    """
    state = {
        "format": FORMAT,
        "seq": int(seq),
        "fence": int(fence),
        "result": result,
        "request_id": request_id,
        "time": time.time(),
        **model_state(model),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    folder = recovery_dir(index)
    path = folder / f"{fence}-{seq}.pt"
    atomic_write_bytes(path, buf.getvalue())
    try:
        index.update(
            lambda d: d.__setitem__("recovery", {"file": path.name, "seq": int(seq), "fence": int(fence)}), fence=fence
        )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    for old in folder.glob("*.pt"):
        if old.name != path.name:
            old.unlink(missing_ok=True)
    return path


def read_snapshot(index: CheckpointIndex) -> dict[str, Any] | None:
    """The snapshot the index points at, or None (no index, no snapshot yet).

    Raises:
        InternalError: the pointed-at file is missing or unreadable.
    """
    if not index.path.is_file():
        return None
    pointer = index.read().get("recovery")
    if not pointer:
        return None
    path = recovery_dir(index) / pointer["file"]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise InternalError(f"recovery snapshot {path.name} of {index.model_id} is unreadable: {exc}") from exc
    if state.get("format") != FORMAT:
        raise InternalError(f"recovery snapshot {path.name} has format {state.get('format')}, expected {FORMAT}")
    return state


def restore_model(state: dict[str, Any], base_ref: Any, *, device: str = "cpu", max_seq_len: int | None = None):
    """A new TrainingModel in exactly the snapshot's state (weights, AdamW moments, step, saved-version chain).

    Raises:
        InternalError: the snapshot does not fit a model of its own LoRA shape (a corrupt snapshot).
    """
    from livelora.trainer.model import TrainingModel

    model = TrainingModel(base_ref, LoraConfig.model_validate(state["lora"]), device=device, max_seq_len=max_seq_len)
    load_into(model, state)
    return model


def load_into(model: Any, state: dict[str, Any]) -> None:
    """Put a snapshot's (or :func:`model_state`'s) weights, AdamW state, step and saved-version chain into
    ``model``, a TrainingModel of the same LoRA shape; its gradients are left as they are.

    Raises:
        InternalError: the state does not fit the model.
    """
    tensors = state["tensors"]
    if set(tensors) != set(model.lora_params):
        raise InternalError(
            f"recovery snapshot tensors do not match the model (e.g. "
            f"{sorted(set(tensors) ^ set(model.lora_params))[:3]})"
        )
    with torch.no_grad():
        for k, p in model.lora_params.items():
            p.copy_(tensors[k].to(p.device, p.dtype))
    try:
        model.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise InternalError(f"recovery snapshot optimizer state does not fit the model: {exc}") from exc
    model.step = int(state["step"])
    model.data_counts = dict(state["data_counts"])
    model.lineage = state["lineage"] or None
    model.parent = None if int(state["parent"]) < 0 else int(state["parent"])


def model_state(model: Any) -> dict[str, Any]:
    """What :func:`load_into` and :func:`restore_model` read: LoRA shape, tensors (CPU copies), AdamW state, step,
    data counts and saved-version chain of a TrainingModel."""
    return {
        "lora": {**model.lora.model_dump(), "alpha": model.alpha},
        "tensors": model.adapter_state(),
        "optimizer": model.optimizer.state_dict(),
        "step": int(model.step),
        "data_counts": dict(model.data_counts),
        "lineage": model.lineage or "",
        "parent": -1 if model.parent is None else int(model.parent),
    }


def drop_snapshots(index: CheckpointIndex, fence: int | None = None) -> None:
    """Delete the snapshot files and the index's pointer (the model was freed)."""
    if index.path.is_file():
        index.update(lambda d: d.pop("recovery", None), fence=fence)
    folder = recovery_dir(index)
    if folder.is_dir():
        for f in folder.glob("*"):
            f.unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:
            pass
