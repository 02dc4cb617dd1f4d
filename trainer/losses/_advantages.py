"""GRPO-family group advantages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from livelora.clients.errors import BadRequestError


def group_advantages(
    rewards_P_G: Tensor | Sequence[Tensor],
    *,
    normalize: Literal["none", "group", "batch"] = "none",
    eps: float = 1e-4,
    std_floor: float = 1e-3,
) -> Tensor | list[Tensor]:
    """Per-sample advantages from group rewards: ``A = r − mean_group(r)``, optionally ÷ (std + eps).

    Args:
        rewards_P_G: a ``(P, G)`` tensor (P groups of G samples) or a list of 1-D group tensors (ragged).
        normalize: ``"none"`` (Tinker cookbook ``compute_advantages``, Dr. GRPO, TRL ``scale_rewards="none"``),
            ``"group"`` (TRL default / DeepSeekMath: ÷ (unbiased std of the group + eps)) or ``"batch"``
            (TRL: ÷ (unbiased std of all rewards + eps), still centred per group).
        eps: added to the std (TRL: 1e-4).
        std_floor: a group whose std is below this is a zero-variance group: its advantages are exactly 0
            (no NaN, and float residue in "identical" rewards is never amplified; NeMo-RL PR #4161).
            Groups of size 1 have no baseline and get 0.

    Returns: same structure as the input (tensor or list), reward units (÷ std: unitless).
    Raises: BadRequestError on an unknown ``normalize``, non-1-D groups or non-finite rewards.
    Source: tinker-cookbook ``rl/data_processing.py::compute_advantages``; TRL ``grpo_trainer.py``
    L2753–2810; Liu et al. 2025 (Dr. GRPO, arXiv 2503.20783); docs/internals/losses.md §3.5, §4.
    """
    if normalize not in ("none", "group", "batch"):
        raise BadRequestError(
            f"unknown advantage normalisation {normalize!r}; use none, group or batch", param="normalize"
        )
    as_tensor = isinstance(rewards_P_G, Tensor)
    groups = list(rewards_P_G.unbind(0)) if as_tensor else [torch.as_tensor(g) for g in rewards_P_G]
    for g in groups:
        if g.ndim != 1:
            raise BadRequestError("each reward group must be 1-D", param="rewards")
        if not torch.isfinite(g).all():
            raise BadRequestError("rewards must be finite", param="rewards")
    out: list[Tensor] = []
    batch_std = None
    if normalize == "batch":
        flat = torch.cat([g.to(torch.float64) for g in groups])
        batch_std = float(flat.std()) if flat.numel() > 1 else 0.0
    for g in groups:
        g64 = g.to(torch.float64)  # two-pass std in float64: no fp32 E[x²]−E[x]² residue
        std = float(g64.std()) if g64.numel() > 1 else 0.0
        if g64.numel() < 2 or std < std_floor:
            out.append(torch.zeros_like(g))
            continue
        centred = g64 - g64.mean()
        if normalize == "group":
            centred = centred / (std + eps)
        elif normalize == "batch":
            centred = centred / (batch_std + eps)
        out.append(centred.to(g.dtype))
    return torch.stack(out) if as_tensor else out
