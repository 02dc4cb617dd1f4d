"""A Tinker :class:`~livelora.clients.types.tinker.LoraConfig` as peft's LoRA and back: which modules it wraps
(:func:`target_modules`), the seeded wrap of a base model (:func:`wrap_lora`) and the config of a stored
version's ``adapter_config.json`` (:func:`lora_config_of`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from livelora.clients.errors import BadRequestError
from livelora.clients.types.tinker import LoraConfig
from livelora.core.base_models import building_lora

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def target_modules(lora: LoraConfig) -> list[str]:
    """Module names LoRA wraps for a :class:`LoraConfig` (attention, MLP, unembedding)."""
    return [
        *(ATTN_MODULES if lora.train_attn else ()),
        *(MLP_MODULES if lora.train_mlp else ()),
        *(UNEMBED_MODULES if lora.train_unembed else ()),
    ]


def wrap_lora(model: Any, lora: LoraConfig, *, alpha: float, seed: int, base_name: str) -> tuple[Any, Any]:
    """``(peft_model, peft LoraConfig)``: ``model`` (modified in place) with a fresh LoRA adapter of rank
    ``lora.rank``, ``alpha``, dropout 0, initialised from ``seed`` (the global RNG is left as it was).

    Raises:
        BadRequestError: a target module group the architecture of ``base_name`` does not have.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = target_modules(lora)
    absent = [t for t in targets if t not in names]
    if absent:
        raise BadRequestError(
            f"base model {base_name} has no linear modules named {absent}; turn off the corresponding train_* flag",
            param="lora_config",
        )
    peft_config = PeftLoraConfig(
        r=lora.rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM"
    )
    with building_lora(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # handled, see trainer/model.py
        warnings.filterwarnings("ignore", message=".*tied layer.*")
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config)
    return peft_model, peft_config


def lora_config_of(adapter_config: dict[str, Any]) -> LoraConfig:
    """The :class:`LoraConfig` (rank, alpha, module groups) of a parsed ``adapter_config.json``."""
    targets = set(adapter_config.get("target_modules") or [])
    return LoraConfig(
        rank=int(adapter_config["r"]),
        alpha=float(adapter_config["lora_alpha"]),
        train_attn=bool(targets & set(ATTN_MODULES)),
        train_mlp=bool(targets & set(MLP_MODULES)),
        train_unembed=bool(targets & set(UNEMBED_MODULES)),
    )
