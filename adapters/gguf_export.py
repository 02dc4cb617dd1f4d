"""An adapter version as a llama.cpp LoRA adapter: one GGUF file (``general.type = adapter``,
``adapter.type = lora``) that ``llama-cli --lora``, ``llama-server --lora``, ``llama_cpp.Llama(lora_path=)`` and
Ollama's ``ADAPTER`` load on the base model's own GGUF.

Tensors: ``blk.<i>.<attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down>.weight.lora_a`` ``(r, d_in)`` and
``.lora_b`` ``(d_out, r)``, float32. peft's scaling ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is
folded into ``lora_b`` and ``adapter.lora.alpha`` is 0, which llama.cpp reads as scale 1. The GGUF llama layout
stores ``q``/``k`` rows interleaved per rotary pair where Hugging Face keeps the two halves apart, so their
``lora_b`` rows get the same permutation as llama.cpp's converter applies to the base weights (:func:`rope_permute`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from livelora.adapters.export import checked_version, write_export_manifest
from livelora.adapters.store import CONFIG_FILE, WEIGHTS_FILE, AdapterStore
from livelora.clients.errors import BadRequestError
from livelora.core.atomic import atomic_dir
from livelora.core.base_models import BaseModelRef

GGUF_FILE = "adapter.gguf"
#: peft module path (after ``model.layers.<i>.``) → GGUF tensor name (after ``blk.<i>.``).
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def rope_permute(w, n_head: int):
    """Rows of ``w`` ``(n_head · head_dim, ...)`` from Hugging Face's rotary order (two halves per head) to GGUF's
    (pairs interleaved), as llama.cpp's ``convert_hf_to_gguf.py`` permutes ``q_proj``/``k_proj``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_lora_tensors(adapter_dir: Path, config) -> dict[str, object]:
    """``{gguf name: float32 tensor}`` of a peft adapter directory for a llama-architecture ``config``
    (:func:`gguf_lora_from_state`)."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter_dir / CONFIG_FILE).read_text())
    return gguf_lora_from_state(cfg, load_file(str(adapter_dir / WEIGHTS_FILE)), config)


def gguf_lora_from_state(cfg: dict, state: dict, config) -> dict[str, Any]:
    """``{gguf name: float32 tensor}`` of a peft adapter (its ``adapter_config.json`` as ``cfg``, its state dict)
    for a llama-architecture ``config``.

    Raises:
        BadRequestError: a base that is not llama-architecture, or an adapter llama.cpp cannot apply (a LoRA on
            the embeddings or ``lm_head``, DoRA, LoRA biases, per-module rank or alpha patterns).
    """
    import math

    import torch

    if getattr(config, "model_type", None) != "llama":
        raise BadRequestError(
            f"gguf export supports llama-architecture base models, not {config.model_type!r}", param="format"
        )
    for key in ("use_dora", "lora_bias"):
        if cfg.get(key):
            raise BadRequestError(f"gguf export cannot write an adapter with {key}", param="format")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise BadRequestError("gguf export cannot write per-module rank or alpha patterns", param="format")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, _, kind = key.rpartition(".lora_")
        parts = module.split(".layers.", 1)
        tail = parts[1].split(".", 1) if len(parts) == 2 else []
        if len(tail) != 2 or tail[1] not in GGUF_NAMES or kind not in ("A.weight", "B.weight"):
            raise BadRequestError(
                f"gguf export supports LoRA on the attention and MLP projections only, not {module!r}",
                param="format",
            )
        factors.setdefault(f"blk.{int(tail[0])}.{GGUF_NAMES[tail[1]]}.weight", {})[kind[0]] = tensor.float()
    out: dict[str, torch.Tensor] = {}
    for name, f in sorted(factors.items()):
        b = f["B"] * scale
        if ".attn_q." in name:
            b = rope_permute(b, n_head)
        elif ".attn_k." in name:
            b = rope_permute(b, n_kv)
        out[f"{name}.lora_a"] = f["A"].contiguous()
        out[f"{name}.lora_b"] = b.contiguous()
    return out


def write_gguf_lora(path: Path | str, tensors: dict[str, Any], name: str) -> None:
    """Write ``tensors`` (:func:`gguf_lora_from_state`) as the llama.cpp LoRA adapter file ``path``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # 0: scale 1, the scaling is in lora_b
    writer.add_name(name)
    for key, t in tensors.items():
        writer.add_tensor(key, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(store: AdapterStore, lineage: str, version: int, base_ref: BaseModelRef, out_dir: Path | str) -> Path:
    """Write ``<lineage>@<version>`` as ``out_dir/adapter.gguf`` plus ``livelora_export.json``.

    Raises:
        NotFoundError: no such version. BadRequestError: base mismatch, bad weights, or see
            :func:`gguf_lora_tensors`. ConflictError: ``out_dir`` exists.
    """
    from transformers import AutoConfig

    out = Path(out_dir)
    manifest = checked_version(store, lineage, version, base_ref, out)
    tensors = gguf_lora_tensors(store.version_dir(lineage, version), AutoConfig.from_pretrained(base_ref.path))
    with atomic_dir(out) as tmp:
        write_gguf_lora(tmp / GGUF_FILE, tensors, manifest.name)
        write_export_manifest(tmp, manifest, format="gguf")
    return out
