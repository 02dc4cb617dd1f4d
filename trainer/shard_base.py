"""The frozen base weights of a trainer group's model sharded over its ranks with FSDP2
(``torch.distributed.fsdp.fully_shard``): each decoder layer, then the root (embeddings, final norm, tied head).

The LoRA parameters are left out of every shard (``ignored_params``): each rank keeps them whole, the group
all-reduces their gradients and every rank takes the same AdamW step, as without sharding
(:mod:`livelora.trainer.distributed`). Every forward and backward of a sharded model is a collective, so every rank
must make the same passes; :class:`~livelora.trainer.logprobs.LogprobPass` sees to it. The setting and what is
tested: ``docs/scaling-out.md``.
"""

from __future__ import annotations

from typing import Any

import torch


def shard_base(peft_model: Any, group: Any) -> bool:
    """Shard ``peft_model``'s base weights in place over ``group`` (a
    :class:`~livelora.trainer.distributed.TrainerGroup`; the shards move to its device: ``cpu`` with gloo, this
    rank's GPU with nccl) when it has ``shard_base``; returns whether it did (None: no group, False).

    Raises:
        ValueError: the model has no list of decoder layers (``model.layers``) to shard one by one.
    """
    if group is None or not group.shard_base:
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    causal_lm = peft_model.get_base_model()
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot shard the base weights of {type(causal_lm).__name__}: no model.layers")
    lora = {p for p in peft_model.parameters() if p.requires_grad}
    mesh = init_device_mesh(group.device.type, (group.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=lora)
    fully_shard(causal_lm, mesh=mesh, ignored_params=lora)
    return True


def base_bytes(peft_model: Any) -> tuple[int, int]:
    """``(held, whole)``: bytes of the frozen base weights this rank holds, and of the whole base model."""
    held = whole = 0
    for p in peft_model.parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel() * local.element_size()
        whole += p.numel() * p.element_size()
    return held, whole
