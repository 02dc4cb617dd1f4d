"""Checkpoint I/O of a :class:`~livelora.trainer.model.TrainingModel`: adapter versions in the store.

A version directory holds the PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable by ``PeftModel.from_pretrained`` and vLLM) and, for ``save_state``, ``optimizer.pt`` (AdamW
state) and ``trainer_state.json`` (step, data counts, seed, torch RNG state), written atomically by
:meth:`~livelora.adapters.store.AdapterStore.write_version`. Reading checks everything before the model
changes, so a bad checkpoint leaves the model as it was.

Test hook: with ``LIVELORA_TEST_PAUSE_SAVES_IN`` set to a directory, a file there named after a lineage makes the
next save of that lineage (in any process) stop after writing its weights file, until the process is killed; the
file is renamed ``<lineage>.paused-<pid>`` first (tests/test_session_kill_during_save.py).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from livelora.adapters.store import (
    CONFIG_FILE,
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    AdapterStore,
    Manifest,
)
from livelora.clients.errors import BadRequestError, NotFoundError

if TYPE_CHECKING:
    from livelora.trainer.model import TrainingModel

#: test hook (see the module docstring): a directory of lineage names whose next save stops half written
PAUSE_SAVES_ENV = "LIVELORA_TEST_PAUSE_SAVES_IN"


def _pause_if_armed(lineage: str) -> None:
    folder = os.environ.get(PAUSE_SAVES_ENV)
    if not folder:
        return
    try:  # one process claims the armed file
        os.rename(Path(folder) / lineage, Path(folder) / f"{lineage}.paused-{os.getpid()}")
    except FileNotFoundError:
        return
    threading.Event().wait()


def write_version(
    model: TrainingModel,
    store: AdapterStore,
    lineage: str,
    *,
    metrics: dict[str, float] | None,
    with_optimizer: bool,
    gate: dict[str, Any] | None = None,
    base_model_name_or_path: str | None = None,
) -> Manifest:
    """Write ``model``'s adapter (and, with ``with_optimizer``, its optimizer and trainer state) as a new
    immutable version of ``lineage``; the model's lineage/parent then point at it. ``adapter_config.json`` names
    ``base_model_name_or_path`` as the base (default: the base model's name; the manifest always has the name).

    Raises:
        BadRequestError: invalid lineage name.
    """
    from safetensors.torch import save_file

    tensors = model.adapter_state()
    opt_state = model.optimizer.state_dict() if with_optimizer else None
    trainer_state = {
        "step": model.step,
        "data_counts": dict(model.data_counts),
        "seed": model.seed,
        "torch_rng_state": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    cfg = model.peft_config.to_dict()
    cfg.update(base_model_name_or_path=base_model_name_or_path or model.base_ref.name, inference_mode=True)
    cfg["target_modules"] = sorted(cfg["target_modules"])

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _pause_if_armed(lineage)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=list))
        if opt_state is not None:
            torch.save(opt_state, tmp / OPTIMIZER_FILE)
            (tmp / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2))

    parent = model.parent if model.lineage == lineage else None
    manifest = store.write_version(
        lineage,
        write,
        base_model=model.base_ref.name,
        parent=parent,
        step=model.step,
        metrics=metrics,
        data_counts=model.data_counts,
        rank=model.lora.rank,
        alpha=model.alpha,
        gate=gate,
    )
    model.lineage, model.parent = lineage, manifest.version
    return manifest


def read_version(
    model: TrainingModel, store: AdapterStore, lineage: str, version: int, *, with_optimizer: bool
) -> Manifest:
    """Load a version into ``model``: LoRA weights, and with ``with_optimizer`` AdamW state, step and RNG state.

    Checked before anything changes: sha256, base model, (rank, alpha, targets), tensor keys and shapes,
    optimizer state structure. Without the optimizer the optimizer is fresh and gradients are dropped; the
    step counter is the version's.

    Raises:
        NotFoundError: no such version, or ``with_optimizer`` on a version saved without optimizer state.
        BadRequestError: checksum mismatch or an adapter that does not fit this model.
    """
    from safetensors.torch import load_file

    manifest = store.get(lineage, version)
    vdir = store.version_dir(lineage, version)
    if manifest.base_model != model.base_ref.name:
        raise BadRequestError(
            f"{manifest.name} was trained on {manifest.base_model!r}, this model is {model.base_ref.name!r}",
            param="path",
        )
    if not store.verify(lineage, version):
        raise BadRequestError(f"{manifest.name}: weights file does not match its sha256", param="path")
    cfg = json.loads((vdir / CONFIG_FILE).read_text())
    mine = (model.lora.rank, model.alpha, sorted(model.peft_config.target_modules))
    theirs = (cfg.get("r"), float(cfg.get("lora_alpha", 0)), sorted(cfg.get("target_modules") or []))
    if mine != theirs:
        raise BadRequestError(
            f"{manifest.name} has (rank, alpha, targets) {theirs}; this model has {mine}", param="path"
        )
    tensors = load_file(str(vdir / WEIGHTS_FILE))
    params = model.lora_params
    if set(tensors) != set(params):
        diff = sorted(set(tensors) ^ set(params))[:3]
        raise BadRequestError(f"{manifest.name}: tensor keys do not match this model (e.g. {diff})", param="path")
    for k, t in tensors.items():
        if t.shape != params[k].shape:
            raise BadRequestError(
                f"{manifest.name}: {k} has shape {list(t.shape)}, expected {list(params[k].shape)}", param="path"
            )
    optimizer = model.new_optimizer()
    state: dict[str, Any] = {}
    if with_optimizer:
        if not manifest.has_optimizer:
            raise NotFoundError(f"{manifest.name} was saved without optimizer state (use save_state)", param="path")
        try:
            optimizer.load_state_dict(store.load_optimizer(lineage, version))
        except (ValueError, KeyError) as exc:
            raise BadRequestError(
                f"{manifest.name}: optimizer state does not fit this model: {exc}", param="path"
            ) from exc
        state = store.load_trainer_state(lineage, version)
    # ---- commit: nothing above changed the model
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(tensors[k].to(p.device, p.dtype))
    model.zero_grad()
    model.optimizer = optimizer
    model.step = int(state.get("step", manifest.step))
    model.data_counts = {**{"datums": 0, "tokens": 0}, **manifest.data_counts}
    if "torch_rng_state" in state:
        rng = torch.frombuffer(bytearray(base64.b64decode(state["torch_rng_state"])), dtype=torch.uint8)
        torch.set_rng_state(rng.clone())
    model.lineage, model.parent = lineage, version
    return manifest
