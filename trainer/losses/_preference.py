"""Sequence-level preference losses (KTO, DPO): means over examples / pairs, like TRL and HALOs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from livelora.clients.errors import BadRequestError

from ._token import LossOutput, _masked


def sequence_logprobs(logprobs_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Masked **sum** of token logprobs per sequence: ``Σ_t m_t·lp_t`` → ``(B,)`` nats.

    Masked positions are zeroed before summing (NaN/−inf padding leaks neither into the value nor the
    gradient); non-binary masks act as weights. Result does not depend on padding side or amount.
    Source: HALOs ``get_sequence_rewards`` (``length_normalized=False``); TRL ``concatenated_forward``.
    """
    (lp,) = _masked(mask_B_T, logprobs_B_T)
    return (lp * mask_B_T.to(lp)).sum(-1)


def kto(
    logratios_B: Tensor,
    desirable_B: Tensor,
    kl_logratios_B: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    example_weights_B: Tensor | None = None,
) -> LossOutput:
    """KTO loss (Ethayarajh et al. 2024, arXiv 2402.01306, Eq. 7), mean over examples.

    ``z0 = max(0, mean_B kl_logratios)`` (detached);
    desirable: ``λ_D·(1 − σ(β(r − z0)))``, undesirable: ``λ_U·(1 − σ(β(z0 − r)))``; loss = mean over all B.

    Args:
        logratios_B: ``r_i = Σ_completion (lp − lp_ref)`` per example (nats per sequence; with grad),
            e.g. ``sequence_logprobs(lp_B_T, w_B_T) - sequence_logprobs(ref_B_T, w_B_T)``.
        desirable_B: bool (or 0/1) labels, True = desirable (thumbs up).
        kl_logratios_B: the same log-ratio for **mismatched** pairs ``(x_i, y_{perm(i)})`` with
            ``perm = kl_pair_order(prompts)`` (TRL: ``perm(i) = i − 1``), any length ≥ 1. Only its mean is
            used, detached: no gradient flows into it.
        beta, desirable_weight, undesirable_weight: β > 0, λ_D, λ_U ≥ 0 (paper Eq. 8: choose so that
            ``λ_D·n_D / (λ_U·n_U) ∈ [1, 4/3]``).
        example_weights_B: optional per-example weights a_i ≥ 0 (rater agreement): the loss is
            ``mean_B a_i·ℓ_i`` (still divided by B, so a down-weighted rater's examples lose their share instead
            of raising everyone else's); ``None``: all 1.

    Returns: ``loss:sum`` (= the mean; unitless, in [0, max λ]), ``kto/z0:mean`` (nats), and the implied rewards
    ``β·r`` averaged per class (``kto/rewards_desirable:mean``, ``kto/rewards_undesirable:mean``, only for
    classes present).
    Raises: BadRequestError on an empty batch or mismatched shapes.
    Source: TRL ``kto_trainer.py`` ``kto_loss`` (v0.26.2; 1.16 L1442–1444 for z0); HALOs
    ``train/trainers.py::KTOTrainer.loss``; docs/internals/losses.md §2.2, §3.2 (0.479398).
    """
    if logratios_B.ndim != 1 or logratios_B.numel() == 0:
        raise BadRequestError("kto needs a non-empty 1-D batch of sequence log-ratios", param="logratios")
    if desirable_B.shape != logratios_B.shape:
        raise BadRequestError("kto labels must have one entry per example", param="label")
    if kl_logratios_B.ndim != 1 or kl_logratios_B.numel() == 0:
        raise BadRequestError("kto needs at least one mismatched-pair KL log-ratio", param="kl_logratio")
    z0 = kl_logratios_B.detach().to(logratios_B).mean().clamp(min=0)
    desirable_B = desirable_B.to(device=logratios_B.device).bool()
    loss_desirable_B = desirable_weight * (1 - torch.sigmoid(beta * (logratios_B - z0)))
    loss_undesirable_B = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios_B)))
    loss_B = torch.where(desirable_B, loss_desirable_B, loss_undesirable_B)
    if example_weights_B is not None:
        if example_weights_B.shape != logratios_B.shape:
            raise BadRequestError("kto example weights must have one entry per example", param="example_weight")
        loss_B = loss_B * example_weights_B.to(loss_B)
    loss = loss_B.mean()
    rewards_B = beta * logratios_B.detach()
    metrics = {"loss:sum": float(loss.detach()), "kto/z0:mean": float(z0)}
    if desirable_B.any():
        metrics["kto/rewards_desirable:mean"] = float(rewards_B[desirable_B].mean())
    if (~desirable_B).any():
        metrics["kto/rewards_undesirable:mean"] = float(rewards_B[~desirable_B].mean())
    return LossOutput(loss, metrics)


def dpo(
    chosen_logratios_B: Tensor,
    rejected_logratios_B: Tensor,
    *,
    beta: float = 0.1,
    example_weights_B: Tensor | None = None,
) -> LossOutput:
    """DPO sigmoid loss (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7), mean over pairs.

    ``h = (lp_c − ref_c) − (lp_r − ref_r)``; per pair ``−log σ(β·h)``; at init (policy = ref) = ln 2.

    Args:
        chosen_logratios_B: ``Σ_completion (lp − lp_ref)`` of each chosen completion (nats per
            sequence, with grad); use :func:`sequence_logprobs` so padding is masked.
        rejected_logratios_B: the same for the rejected completion of the same pair.
        beta: β > 0.
        example_weights_B: optional per-pair weights a_k ≥ 0 (rater agreement): loss ``mean_k a_k·ℓ_k``;
            ``None``: all 1.

    Returns: ``loss:sum`` (= mean over pairs), ``dpo/rewards_chosen:mean``, ``dpo/rewards_rejected:mean``
    (implied rewards β·(lp − ref)), ``dpo/margin:mean`` (β·h) and ``dpo/accuracy:mean`` (h > 0).
    Raises: BadRequestError on empty or mismatched batches.
    Source: TRL ``dpo_trainer.py`` ``loss_type="sigmoid"`` (1.16 L1302–1310, L1528; 0.26.2 ``dpo_loss``);
    tinker-cookbook ``preference/train_dpo.py::compute_dpo_loss``; docs/internals/losses.md §2.3, §3.3 (0.663797).
    """
    if chosen_logratios_B.ndim != 1 or chosen_logratios_B.numel() == 0:
        raise BadRequestError("dpo needs a non-empty 1-D batch of pairs", param="chosen")
    if rejected_logratios_B.shape != chosen_logratios_B.shape:
        raise BadRequestError("dpo needs one rejected completion per chosen completion", param="rejected")
    margin_B = beta * (chosen_logratios_B - rejected_logratios_B)
    loss_B = -F.logsigmoid(margin_B)
    if example_weights_B is not None:
        if example_weights_B.shape != margin_B.shape:
            raise BadRequestError("dpo example weights must have one entry per pair", param="example_weight")
        loss_B = loss_B * example_weights_B.to(loss_B)
    loss = loss_B.mean()
    return LossOutput(
        loss,
        {
            "loss:sum": float(loss.detach()),
            "dpo/rewards_chosen:mean": float(beta * chosen_logratios_B.detach().mean()),
            "dpo/rewards_rejected:mean": float(beta * rejected_logratios_B.detach().mean()),
            "dpo/margin:mean": float(margin_B.detach().mean()),
            "dpo/accuracy:mean": float((margin_B.detach() > 0).to(margin_B.dtype).mean()),
        },
    )


def kl_pair_order(prompts_B: Sequence[Any]) -> list[int]:
    """Which completion each KTO example is paired with for the KL reference point z0.

    Returns ``perm`` (length B): the trainer scores completion ``y_{perm[i]}`` after prompt ``x_i`` under
    the policy and the reference (no grad), giving ``kl_logratios_B[i] = Σ_completion(lp − lp_ref)``.
    ``perm`` is always a derangement (``perm[i] != i`` for every i, also for odd B: trl #1911, where a
    *reversed* batch paired the middle example with itself). It is the rotation ``perm[i] = (i − s) mod B``
    with the smallest shift s ≥ 1 (s = 1 is TRL's ``[y_n, y_1, …, y_{n−1}]``) under which no example is
    paired with a completion of an equal prompt; if no rotation achieves that (e.g. all prompts equal),
    s = 1. Labels play no part.

    Args:
        prompts_B: one hashable key per example (prompt token tuple, prompt hash, …).
    Raises: BadRequestError if B < 2 (a KL estimate needs two examples; TRL refuses batch size 1).
    Source: TRL ``kto_trainer.py`` L1141–1156 (rotation), HALOs ``UnpairedPreferenceDataLoader``.
    """
    n = len(prompts_B)
    if n < 2:
        raise BadRequestError(
            "KTO needs at least 2 examples per batch to build mismatched KL pairs", param="batch_size"
        )
    for shift in range(1, n):
        if all(prompts_B[i] != prompts_B[(i - shift) % n] for i in range(n)):
            return [(i - shift) % n for i in range(n)]
    return [(i - 1) % n for i in range(n)]
