"""Merge an adapter version into its base model and write a standalone Hugging Face model directory.

The output (``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files and
``chat_template.jinja``, plus ``livelora_export.json`` naming the source version and its sha256) is
built in a temporary sibling and renamed into place (:func:`livelora.core.atomic.atomic_dir`), so a
crash never leaves a half-written model.

Tied embeddings: SmolLM2 shares one matrix between ``embed_tokens`` and ``lm_head``. When the adapter
has a LoRA on ``lm_head``, merging in place would also change the input embedding, so the two are untied
first (``lm_head.weight`` becomes its own copy) and the exported config says ``tie_word_embeddings:
false``. The merge uses peft's ``merge_and_unload(safe_merge=True)`` (which refuses non-finite results),
computed on CPU in float64 and rounded once to ``dtype`` (the merged logits then differ from base+adapter
only by float32 rounding: within 1e-4 for the tested adapters).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from livelora.adapters.store import CONFIG_FILE, AdapterStore, Manifest
from livelora.clients.errors import BadRequestError, ConflictError
from livelora.core.atomic import atomic_dir
from livelora.core.base_models import BaseModelRef, building_lora, load_model, load_tokenizer

if TYPE_CHECKING:  # torch loads only when an export runs
    import torch

EXPORT_MANIFEST = "livelora_export.json"


def checked_version(store: AdapterStore, lineage: str, version: int, base_ref: BaseModelRef, out: Path) -> Manifest:
    """The version's manifest, once it is known to export to ``out`` on ``base_ref``.

    Raises:
        NotFoundError: no such version. BadRequestError: another base model, or a weights file failing its
            sha256 check. ConflictError: ``out`` exists.
    """
    manifest = store.get(lineage, version)
    if manifest.base_model != base_ref.name:
        raise BadRequestError(
            f"{manifest.name} was trained on {manifest.base_model!r}, not {base_ref.name!r}", param="base_model"
        )
    if not store.verify(lineage, version):
        raise BadRequestError(f"{manifest.name}: weights file does not match its sha256", param="adapter")
    if out.exists():
        raise ConflictError(f"export destination {out} already exists")
    return manifest


def write_export_manifest(directory: Path, manifest: Manifest, **fields) -> None:
    """``directory/livelora_export.json``: the source version, its sha256, base model, time, plus ``fields``."""
    record = {
        "adapter": manifest.name,
        "adapter_sha256": manifest.sha256,
        "base_model": manifest.base_model,
        "created": time.time(),
        **fields,
    }
    (directory / EXPORT_MANIFEST).write_text(json.dumps(record, indent=2))


def export_merged(
    store: AdapterStore,
    lineage: str,
    version: int,
    base_ref: BaseModelRef,
    out_dir: Path | str,
    *,
    dtype: str | torch.dtype = "float32",
) -> Path:
    """Write base + adapter ``<lineage>@<version>`` merged into one HF model at ``out_dir``.

    Args:
        store: the adapter store holding the version.
        base_ref: the version's base model (its name must match the manifest).
        out_dir: destination directory; must not exist yet.
        dtype: dtype of the written weights, a torch dtype or its name (the merge itself runs in float64).

    Returns:
        ``out_dir``.

    Raises:
        NotFoundError: no such version.
        BadRequestError: base model mismatch or a weights file failing its sha256 check.
        ConflictError: ``out_dir`` already exists.
    """
    import torch
    from peft import PeftModel

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    out = Path(out_dir)
    manifest = checked_version(store, lineage, version, base_ref, out)
    vdir = store.version_dir(lineage, version)
    targets = set(json.loads((vdir / CONFIG_FILE).read_text()).get("target_modules") or [])
    model = load_model(base_ref, dtype=torch.float64)  # W + s·B·A rounded once, from float64
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in targets:
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    with building_lora(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tied layer.*")  # untied above
        merged = PeftModel.from_pretrained(model, str(vdir)).merge_and_unload(safe_merge=True)
    merged = merged.to(dtype)
    tokenizer = load_tokenizer(base_ref)
    with atomic_dir(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        template = Path(base_ref.path) / "chat_template.jinja"
        if base_ref.is_local and template.is_file() and not (tmp / "chat_template.jinja").exists():
            shutil.copy(template, tmp / "chat_template.jinja")
        write_export_manifest(tmp, manifest, dtype=str(dtype).removeprefix("torch."))
    return out
