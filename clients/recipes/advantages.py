"""Advantage estimators of the RL recipes (plain Python: the client needs no torch for them).

Notation: one *group* = the G samples of one prompt, ``rewards_G``; advantages broadcast to every sampled
token of their sample. Reference values: docs/internals/losses.md §3.5 (computed in float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Estimator = Literal["mean", "mean_std", "loo"]


def group_advantages(
    rewards_G: Sequence[float], estimator: Estimator = "mean", *, eps: float = 1e-4, std_floor: float = 1e-3
) -> list[float]:
    """Per-sample advantages of one group.

    Args:
        rewards_G: the G rewards of one prompt's samples.
        estimator: ``"mean"``: ``r_i − mean(r)`` (tinker-cookbook ``compute_advantages``; Dr. GRPO, Liu et al.
            2025, arXiv 2503.20783); ``"mean_std"``: ``(r_i − mean(r)) / (std_unbiased(r) + eps)`` (GRPO,
            Shao et al. 2024, arXiv 2402.03300; TRL ``scale_rewards="group"``); ``"loo"``: leave-one-out,
            ``r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean)`` (RLOO, Ahmadian et al. 2024, arXiv 2402.14740).
        eps: added to the std (TRL: 1e-4).
        std_floor: a group whose std is below this gets exactly 0 (no NaN; float residue in "equal" rewards is
            never amplified, NeMo-RL PR #4161). A group of one sample has no baseline and gets 0.

    Returns: G advantages (reward units; ``mean_std``: unitless).
    Raises: ValueError on an unknown estimator or a non-finite reward.
    """
    if estimator not in ("mean", "mean_std", "loo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}: use mean, mean_std or loo")
    r = [float(x) for x in rewards_G]
    if not all(math.isfinite(x) for x in r):
        raise ValueError(f"rewards must be finite, got {r}")
    g = len(r)
    if g < 2:
        return [0.0] * g
    mean = sum(r) / g
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (g - 1))
    if std < std_floor:
        return [0.0] * g
    centred = [x - mean for x in r]
    if estimator == "mean_std":
        return [c / (std + eps) for c in centred]
    if estimator == "loo":
        return [c * g / (g - 1) for c in centred]
    return centred


def reverse_kl_advantages(
    sampled_logprobs_T: Sequence[float], teacher_logprobs_T: Sequence[float], coef: float = 1.0
) -> list[float]:
    """On-policy distillation: per-token ``A_t = −coef·(q_t − lp^teacher_t)``, the negative sampled reverse KL
    (tinker-cookbook ``distillation/train_on_policy.py``; Agarwal et al. 2024, arXiv 2306.13649;
    docs/internals/losses.md §4). ``q_t`` is the student's (sampler's) logprob of its own token t.

    Raises: ValueError when the lengths differ.
    """
    if len(sampled_logprobs_T) != len(teacher_logprobs_T):
        raise ValueError(f"{len(sampled_logprobs_T)} student vs {len(teacher_logprobs_T)} teacher logprobs")
    return [-coef * (float(q) - float(t)) for q, t in zip(sampled_logprobs_T, teacher_logprobs_T)]
