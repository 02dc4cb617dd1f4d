"""Token-level losses with Tinker server semantics: per-token, summed over every token of every datum."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossOutput:
    """A loss and its metrics.

    Attributes:
        loss: 0-d tensor (nats), differentiable w.r.t. the logprobs passed in.
        metrics: flat ``{"name:reduction": float}``; always holds ``"loss:sum"`` (= ``loss.item()``).
    """

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Token-level losses (Tinker server semantics: sum over every token of every datum)
# ----------------------------------------------------------------------------------------------------


def _masked(mask_T: Tensor | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Replace masked-out entries by 0 before any arithmetic (exact masking, no NaN through ``where``)."""
    if mask_T is None:
        return tensors
    keep_T = mask_T.to(device=tensors[0].device) != 0
    return tuple(torch.where(keep_T, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in tensors)


def _token_output(per_token_T: Tensor) -> LossOutput:
    loss = per_token_T.sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach())})


def cross_entropy(logprobs_T: Tensor, weights_T: Tensor, *, mask_T: Tensor | None = None) -> LossOutput:
    """Tinker ``cross_entropy``: ``L = -Σ_t w_t · lp_t`` (SFT with per-token weights; top-K distillation).

    Args:
        logprobs_T: log p_θ(target), any shape: ``(T,)``, padded ``(D, T)``, or ``(T, K)`` for top-K soft
            targets (then ``weights_T`` holds the teacher probabilities).
        weights_T: same shape; 0 on prompt positions. Any real weights; ``dL/dlp = -w``.
        mask_T: optional, same shape; positions where it is 0 contribute exactly nothing.

    Returns: ``loss:sum`` in nats summed over tokens (no mean; the cookbook's ``mean_nll`` divides by Σw).

    Source: tinker docs ``losses/cross-entropy`` (llms-full.txt at commit 0f1c05da^); tinker-cookbook 0.6.1
    ``supervised/common.py::compute_mean_nll``; docs/internals/losses.md §2.1, vector §3.1 (7.33250, 8.90000).
    """
    lp, w = _masked(mask_T, logprobs_T, weights_T.to(logprobs_T))
    return _token_output(-(w * lp))


def importance_sampling(
    logprobs_T: Tensor, sampling_logprobs_T: Tensor, advantages_T: Tensor, *, mask_T: Tensor | None = None
) -> LossOutput:
    """Tinker ``importance_sampling``: ``L = -Σ_t exp(lp_t - q_t) · A_t``; ``dL/dlp = -r·A``.

    Args:
        logprobs_T: trainer logprobs lp (with grad), any shape.
        sampling_logprobs_T: sampler logprobs q (Tinker input ``logprobs``), same shape.
        advantages_T: A, same shape; 0 on prompt positions (that is what masks them in Tinker).
        mask_T: optional exact mask (padding).

    Returns: ``loss:sum`` (nats-weighted advantage, summed over tokens).
    Source: Tinker docs (losses page); REINFORCE with importance weights. docs/internals/losses.md §2.4,
    §3.4 (−1.12993).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    return _token_output(-(torch.exp(lp - q) * adv))


def ppo(
    logprobs_T: Tensor,
    sampling_logprobs_T: Tensor,
    advantages_T: Tensor,
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
    mask_T: Tensor | None = None,
) -> LossOutput:
    """Tinker ``ppo``: ``L = -Σ_t min(r_t·A_t, clip(r_t, lo, hi)·A_t)`` with ``r = exp(lp - q)``.

    ``lo``/``hi`` are **absolute ratio bounds** (defaults 0.8 / 1.2 = ε 0.2), not ε. The gradient is
    ``-r·A`` where the unclipped branch is the min, and 0 where the clip binds (A>0 & r>hi, A<0 & r<lo).

    Args: as :func:`importance_sampling`, plus the two thresholds.
    Returns: ``loss:sum``.
    Source: Schulman et al. 2017 (arXiv 1707.06347) Eq. 7; Tinker docs (losses page) / tutorial 202;
    docs/internals/losses.md §2.5, §3.4 (−0.847581).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    ratio = torch.exp(lp - q)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return _token_output(-torch.minimum(ratio * adv, clipped * adv))


def cispo(
    logprobs_T: Tensor,
    sampling_logprobs_T: Tensor,
    advantages_T: Tensor,
    *,
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
    mask_T: Tensor | None = None,
) -> LossOutput:
    """Tinker ``cispo``: ``L = -Σ_t sg(clip(r_t, lo, hi)) · A_t · lp_t``.

    The clipped ratio is a detached *weight* on a REINFORCE term, so the gradient ``-clip(r)·A`` is never
    zeroed by the clip (unlike PPO) and the value depends on lp: on-policy it is ``-Σ A·lp``, not ``-Σ A``
    (regressions trl PR #4499, open-instruct PR #1269). Defaults one-sided 0.0 / 4.0 (Tinker tutorial 202).

    Args: as :func:`importance_sampling`, plus the two absolute thresholds.
    Returns: ``loss:sum``.
    Source: MiniMax-M1 (arXiv 2506.13585) Eq. 4; TRL 1.16.0 ``grpo_trainer.py`` L3109–3111 ``loss_type="cispo"``;
    docs/internals/losses.md §2.6, §3.4 (0.564551).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    weight = torch.exp(lp - q).clamp(clip_low_threshold, clip_high_threshold).detach()
    return _token_output(-(weight * adv * lp))


def dro(
    logprobs_T: Tensor,
    sampling_logprobs_T: Tensor,
    advantages_T: Tensor,
    *,
    beta: float = 0.05,
    mask_T: Tensor | None = None,
) -> LossOutput:
    """Tinker ``dro``: ``L = -Σ_t (lp_t·A_t - ½·β·(lp_t - q_t)²)``.

    The quadratic term touches every position where lp ≠ q, including prompt positions whose q
    placeholder is 0: Tinker's documented formula is unmasked, so pass ``mask_T`` (datum input ``mask``)
    to restrict it to sampled tokens. ``beta`` default 0.05 is the Tinker docs example value.

    Args: as :func:`importance_sampling`, plus ``beta`` (≥ 0, per nat²).
    Returns: ``loss:sum``.
    Source: Tinker docs (losses page; DRO, Richemond et al. 2024, arXiv 2405.19107); docs/internals/losses.md §2.6,
    §3.4 (masked, β=0.05: −0.0262500).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    return _token_output(-(lp * adv - 0.5 * beta * (lp - q) ** 2))


def gspo(
    logprobs_D: list[Tensor],
    sampling_logprobs_D: list[Tensor],
    advantages_D: list[Tensor],
    ratio_mask_D: list[Tensor],
    *,
    clip_low_threshold: float = 1.0 - 3e-4,
    clip_high_threshold: float = 1.0 + 4e-4,
    mask_D: list[Tensor] | None = None,
) -> LossOutput:
    """Tinker ``gspo`` (GSPO-token): a PPO clip on one **sequence-level** ratio per datum.

    Per datum ``i``: ``log s_i = mean_{t: m_t≠0} (sg(lp_t) − q_t)`` over its ``sequence_ratio_mask`` ``m``
    (the sampled tokens), ``r_t = exp(log s_i + lp_t − sg(lp_t))`` (value ``s_i`` at every token, gradient
    ``dr_t/dlp_t = s_i``), then ``L = −Σ_i Σ_t min(r_t·A_t, clip(r_t, lo, hi)·A_t)``. ``lo``/``hi`` are absolute
    ratio bounds; the defaults are the GSPO paper's clipping ranges 3e-4 (left) / 4e-4 (right).

    Args:
        logprobs_D: per datum, trainer logprobs lp ``(N_i,)`` with grad.
        sampling_logprobs_D: per datum, sampler logprobs q ``(N_i,)`` (Tinker input ``logprobs``).
        advantages_D: per datum, A ``(N_i,)``; 0 on prompt positions.
        ratio_mask_D: per datum ``(N_i,)``; non-zero at the positions the sequence ratio averages over
            (at least one per datum: checked by the spec).
        mask_D: optional exact mask per datum (positions where it is 0 contribute nothing to the loss).

    Returns: ``loss:sum`` (summed over tokens and datums, as every Tinker token loss).

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, Eq. 7 and §4.3
    (GSPO-token) and §5.1 (clipping ranges 3e-4 / 4e-4); Tinker docs ``losses/gspo``
    (``log_ratio = (tlp.detach() − slp)[mask≠0].mean()``); tinker-cookbook 0.6.1 ``recipes/rl_loop.py``
    (``sequence_ratio_mask`` = 1 on sampled tokens); docs/internals/losses.md §2.7. Vectors: tests/test_losses.py.
    """
    total = None
    for i, lp in enumerate(logprobs_D):
        q = sampling_logprobs_D[i].to(lp)
        adv = advantages_D[i].to(lp)
        keep = ratio_mask_D[i].to(device=lp.device) != 0
        log_s = (lp.detach() - q)[keep].mean()
        ratio = torch.exp(log_s + lp - lp.detach())
        per_token = -torch.minimum(ratio * adv, ratio.clamp(clip_low_threshold, clip_high_threshold) * adv)
        if mask_D is not None:
            (per_token,) = _masked(mask_D[i], per_token)
        total = per_token.sum() if total is None else total + per_token.sum()
    loss = total if total is not None else torch.zeros(())
    return LossOutput(loss, {"loss:sum": float(loss.detach())})
