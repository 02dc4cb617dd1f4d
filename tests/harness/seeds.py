"""Adapter versions with seeded random weights, so that each version's logprobs differ from the base model's and
from each other's (the tests compare against the model itself, never hard-coded values)."""

from __future__ import annotations

from pathlib import Path

import torch

#: every projection of SmolLM2's blocks (attention and MLP)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def randomize_lora_b(training_model, generator: torch.Generator, scale: float) -> None:
    """Set every ``lora_B`` of a :class:`~livelora.trainer.model.TrainingModel` to ``N(0, scale²)`` draws."""
    with torch.no_grad():
        for name, p in training_model.lora_params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def saved_versions(base_ref, home: Path, lineage: str, seed: int, n: int = 2, scale: float = 0.05) -> None:
    """``<lineage>@1 .. @n`` in the store at ``home``: a rank-2 attention-only
    :class:`~livelora.trainer.model.TrainingModel` saved after each :func:`randomize_lora_b` draw."""
    from livelora.adapters.store import AdapterStore
    from livelora.clients.types.tinker import LoraConfig
    from livelora.trainer.model import TrainingModel

    store = AdapterStore(home)
    model = TrainingModel(base_ref, LoraConfig(rank=2, train_unembed=False, train_mlp=False))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        randomize_lora_b(model, generator, scale)
        model.save_weights(store, lineage)


def peft_versions(
    base_ref,
    root: Path,
    seeds,
    *,
    rank: int,
    b_scale: float,
    a_scale: float | None = None,
    name: str = "r{rank}-s{seed}",
) -> list[Path]:
    """Save one PEFT LoRA directory per seed under ``root`` (``name`` formatted with rank and seed): rank ``rank``,
    alpha ``2 * rank``, on :data:`TARGETS`; ``lora_B ~ N(0, b_scale²)`` from ``torch.Generator().manual_seed(seed)``,
    and ``lora_A ~ N(0, a_scale²)`` from the same generator when ``a_scale`` is given (else peft's init)."""
    from peft import LoraConfig, get_peft_model

    from livelora.core.base_models import load_model

    model = get_peft_model(load_model(base_ref), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname or (a_scale is not None and "lora_A" in pname):
                    p.copy_(torch.randn(p.shape, generator=g) * (b_scale if "lora_B" in pname else a_scale))
        path = Path(root) / name.format(rank=rank, seed=seed)
        model.save_pretrained(path)
        out.append(path)
    return out
