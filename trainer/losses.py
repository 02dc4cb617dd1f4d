"""Built-in training losses as pure tensor functions, plus the registry the trainer dispatches on.

Two layers:

* **Tensor functions** (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``kto``,
  ``dpo``): take plain tensors, return :class:`LossOutput` (a 0-d loss with grad + flat metrics). Token
  losses accept any shape (concatenated ``(T,)`` tokens or padded ``(D, T)``) plus an optional
  ``mask_T``; masked positions are zeroed *before* any arithmetic, so garbage (NaN, ``-inf``) in padding
  can leak into neither the value nor the gradient.
* **Datum functions** (``LOSSES[name].fn`` / :func:`compute_loss`): the Tinker shape. One entry per
  datum: ``target_logprobs_D[i]`` = log p_θ(target_tokens) of datum i (shape ``(N_i,)``, or ``(N_i, K)``
  for 2-D cross-entropy), computed by the trainer with grad; ``loss_fn_inputs_D[i]`` = that datum's
  ``loss_fn_inputs`` as torch tensors. Ragged lengths, no padding. :func:`validate_loss_request` checks
  name, inputs and ``loss_fn_config`` up front (before any forward pass), raising ``BadRequestError``.

Notation (tinker-cookbook ``CONTRIBUTING.md``): ``_T`` tokens, ``_B`` sequences/examples, ``_D`` datums,
``_G`` group members, ``_P`` groups. ``lp`` = trainer logprob, ``q`` = sampler logprob, ``A`` = advantage,
``r = exp(lp - q)``, ``sg`` = stop-gradient. Units: logprobs in nats; token losses are nats summed over
tokens (``loss:sum``, no normalisation, like Tinker); KTO/DPO are means over examples/pairs.

Reference: ``../shared/reference/losses.md`` (semantics, test vectors §3, regressions §7) and
``tinker_protocol.md`` §3. Every metric key is ``name:reduction``; ``loss:sum`` is always present.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from livelora.clients.errors import BadRequestError

__all__ = [
    "LossName", "LossOutput", "LossSpec", "LOSSES", "compute_loss", "validate_loss_request",
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "kto", "dpo",
    "sequence_logprobs", "kl_pair_order", "group_advantages",
    "surrogate_weights", "CustomLossResult", "run_custom_loss",
]

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "kto", "dpo"]


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

    Source: tinker docs ``losses/cross-entropy``; losses.md §2.1, vector §3.1 (7.33250, 8.90000).
    """
    lp, w = _masked(mask_T, logprobs_T, weights_T.to(logprobs_T))
    return _token_output(-(w * lp))


def importance_sampling(logprobs_T: Tensor, sampling_logprobs_T: Tensor, advantages_T: Tensor, *,
                        mask_T: Tensor | None = None) -> LossOutput:
    """Tinker ``importance_sampling``: ``L = -Σ_t exp(lp_t - q_t) · A_t``; ``dL/dlp = -r·A``.

    Args:
        logprobs_T: trainer logprobs lp (with grad), any shape.
        sampling_logprobs_T: sampler logprobs q (Tinker input ``logprobs``), same shape.
        advantages_T: A, same shape; 0 on prompt positions (that is what masks them in Tinker).
        mask_T: optional exact mask (padding).

    Returns: ``loss:sum`` (nats-weighted advantage, summed over tokens).
    Source: tinker docs ``losses.mdx``; REINFORCE with importance weights. losses.md §2.4, §3.4 (−1.12993).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    return _token_output(-(torch.exp(lp - q) * adv))


def ppo(logprobs_T: Tensor, sampling_logprobs_T: Tensor, advantages_T: Tensor, *,
        clip_low_threshold: float = 0.8, clip_high_threshold: float = 1.2,
        mask_T: Tensor | None = None) -> LossOutput:
    """Tinker ``ppo``: ``L = -Σ_t min(r_t·A_t, clip(r_t, lo, hi)·A_t)`` with ``r = exp(lp - q)``.

    ``lo``/``hi`` are **absolute ratio bounds** (defaults 0.8 / 1.2 = ε 0.2), not ε. The gradient is
    ``-r·A`` where the unclipped branch is the min, and 0 where the clip binds (A>0 & r>hi, A<0 & r<lo).

    Args: as :func:`importance_sampling`, plus the two thresholds.
    Returns: ``loss:sum``.
    Source: Schulman et al. 2017 (arXiv 1707.06347) Eq. 7; tinker docs ``losses.mdx`` / tutorial 202;
    losses.md §2.5, §3.4 (−0.847581).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    ratio = torch.exp(lp - q)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return _token_output(-torch.minimum(ratio * adv, clipped * adv))


def cispo(logprobs_T: Tensor, sampling_logprobs_T: Tensor, advantages_T: Tensor, *,
          clip_low_threshold: float = 0.0, clip_high_threshold: float = 4.0,
          mask_T: Tensor | None = None) -> LossOutput:
    """Tinker ``cispo``: ``L = -Σ_t sg(clip(r_t, lo, hi)) · A_t · lp_t``.

    The clipped ratio is a detached *weight* on a REINFORCE term, so the gradient ``-clip(r)·A`` is never
    zeroed by the clip (unlike PPO) and the value depends on lp: on-policy it is ``-Σ A·lp``, not ``-Σ A``
    (regressions trl PR #4499, open-instruct PR #1269). Defaults one-sided 0.0 / 4.0 (Tinker tutorial 202).

    Args: as :func:`importance_sampling`, plus the two absolute thresholds.
    Returns: ``loss:sum``.
    Source: MiniMax-M1 (arXiv 2506.13585) Eq. 4; TRL ``grpo_trainer.py`` ``loss_type="cispo"``;
    losses.md §2.6, §3.4 (0.564551).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    weight = torch.exp(lp - q).clamp(clip_low_threshold, clip_high_threshold).detach()
    return _token_output(-(weight * adv * lp))


def dro(logprobs_T: Tensor, sampling_logprobs_T: Tensor, advantages_T: Tensor, *, beta: float = 0.05,
        mask_T: Tensor | None = None) -> LossOutput:
    """Tinker ``dro``: ``L = -Σ_t (lp_t·A_t - ½·β·(lp_t - q_t)²)``.

    The quadratic term touches every position where lp ≠ q, including prompt positions whose q
    placeholder is 0: Tinker's documented formula is unmasked, so pass ``mask_T`` (datum input ``mask``)
    to restrict it to sampled tokens. ``beta`` default 0.05 is the Tinker docs example value.

    Args: as :func:`importance_sampling`, plus ``beta`` (≥ 0, per nat²).
    Returns: ``loss:sum``.
    Source: tinker docs ``losses.mdx`` (DRO, Richemond et al. 2024, arXiv 2405.19107); losses.md §2.6,
    §3.4 (masked, β=0.05: −0.0262500).
    """
    lp, q, adv = _masked(mask_T, logprobs_T, sampling_logprobs_T.to(logprobs_T), advantages_T.to(logprobs_T))
    return _token_output(-(lp * adv - 0.5 * beta * (lp - q) ** 2))


# ----------------------------------------------------------------------------------------------------
# Sequence-level preference losses (mean over examples / pairs, like TRL and HALOs)
# ----------------------------------------------------------------------------------------------------

def sequence_logprobs(logprobs_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Masked **sum** of token logprobs per sequence: ``Σ_t m_t·lp_t`` → ``(B,)`` nats.

    Masked positions are zeroed before summing (NaN/−inf padding leaks neither into the value nor the
    gradient); non-binary masks act as weights. Result does not depend on padding side or amount.
    Source: HALOs ``get_sequence_rewards`` (``length_normalized=False``); TRL ``concatenated_forward``.
    """
    (lp,) = _masked(mask_B_T, logprobs_B_T)
    return (lp * mask_B_T.to(lp)).sum(-1)


def kto(logratios_B: Tensor, desirable_B: Tensor, kl_logratios_B: Tensor, *, beta: float = 0.1,
        desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> LossOutput:
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

    Returns: ``loss:sum`` (= the mean, nats-free, in [0, max λ]), ``kto/z0:mean``, and the implied rewards
    ``β·r`` averaged per class (``kto/rewards_desirable:mean``, ``kto/rewards_undesirable:mean``, only for
    classes present).
    Raises: BadRequestError on an empty batch or mismatched shapes.
    Source: TRL ``kto_trainer.py`` ``kto_loss`` (v0.26.2; 1.16 L1442–1444 for z0); HALOs
    ``train/trainers.py::KTOTrainer.loss``; losses.md §2.2, §3.2 (0.479398).
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
    loss = torch.where(desirable_B, loss_desirable_B, loss_undesirable_B).mean()
    rewards_B = beta * logratios_B.detach()
    metrics = {"loss:sum": float(loss.detach()), "kto/z0:mean": float(z0)}
    if desirable_B.any():
        metrics["kto/rewards_desirable:mean"] = float(rewards_B[desirable_B].mean())
    if (~desirable_B).any():
        metrics["kto/rewards_undesirable:mean"] = float(rewards_B[~desirable_B].mean())
    return LossOutput(loss, metrics)


def dpo(chosen_logratios_B: Tensor, rejected_logratios_B: Tensor, *, beta: float = 0.1) -> LossOutput:
    """DPO sigmoid loss (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7), mean over pairs.

    ``h = (lp_c − ref_c) − (lp_r − ref_r)``; per pair ``−log σ(β·h)``; at init (policy = ref) = ln 2.

    Args:
        chosen_logratios_B: ``Σ_completion (lp − lp_ref)`` of each chosen completion (nats per
            sequence, with grad); use :func:`sequence_logprobs` so padding is masked.
        rejected_logratios_B: the same for the rejected completion of the same pair.
        beta: β > 0.

    Returns: ``loss:sum`` (= mean over pairs), ``dpo/rewards_chosen:mean``, ``dpo/rewards_rejected:mean``
    (implied rewards β·(lp − ref)), ``dpo/margin:mean`` (β·h) and ``dpo/accuracy:mean`` (h > 0).
    Raises: BadRequestError on empty or mismatched batches.
    Source: TRL ``dpo_trainer.py`` ``loss_type="sigmoid"`` (1.16 L1302–1310, L1528; 0.26.2 ``dpo_loss``);
    tinker-cookbook ``preference/train_dpo.py::compute_dpo_loss``; losses.md §2.3, §3.3 (0.663797).
    """
    if chosen_logratios_B.ndim != 1 or chosen_logratios_B.numel() == 0:
        raise BadRequestError("dpo needs a non-empty 1-D batch of pairs", param="chosen")
    if rejected_logratios_B.shape != chosen_logratios_B.shape:
        raise BadRequestError("dpo needs one rejected completion per chosen completion", param="rejected")
    margin_B = beta * (chosen_logratios_B - rejected_logratios_B)
    loss = -F.logsigmoid(margin_B).mean()
    return LossOutput(loss, {
        "loss:sum": float(loss.detach()),
        "dpo/rewards_chosen:mean": float(beta * chosen_logratios_B.detach().mean()),
        "dpo/rewards_rejected:mean": float(beta * rejected_logratios_B.detach().mean()),
        "dpo/margin:mean": float(margin_B.detach().mean()),
        "dpo/accuracy:mean": float((margin_B.detach() > 0).to(margin_B.dtype).mean()),
    })


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
        raise BadRequestError("KTO needs at least 2 examples per batch to build mismatched KL pairs",
                              param="batch_size")
    for shift in range(1, n):
        if all(prompts_B[i] != prompts_B[(i - shift) % n] for i in range(n)):
            return [(i - shift) % n for i in range(n)]
    return [(i - 1) % n for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# Group advantages (GRPO family)
# ----------------------------------------------------------------------------------------------------

def group_advantages(rewards_P_G: Tensor | Sequence[Tensor], *,
                     normalize: Literal["none", "group", "batch"] = "none",
                     eps: float = 1e-4, std_floor: float = 1e-3) -> Tensor | list[Tensor]:
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
    L2753–2810; Liu et al. 2025 (Dr. GRPO, arXiv 2503.20783); losses.md §3.5, §4.
    """
    if normalize not in ("none", "group", "batch"):
        raise BadRequestError(f"unknown advantage normalisation {normalize!r}; use none, group or batch",
                              param="normalize")
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


# ----------------------------------------------------------------------------------------------------
# Custom losses: two-pass linear surrogate (tinker_protocol.md §3.4)
# ----------------------------------------------------------------------------------------------------

def surrogate_weights(loss: Tensor, logprobs_D: Sequence[Tensor]) -> list[Tensor]:
    """Per-token weights ``w_i = −∂loss/∂logprobs_i`` for the cross-entropy surrogate of a custom loss.

    The trainer then runs ``cross_entropy`` with these ``weights``: ``L_s = −Σ w·lp``, so
    ``∂L_s/∂lp = −w = ∂loss/∂lp`` and, by the chain rule, ``∂L_s/∂θ = ∂loss/∂θ`` exactly (evaluated at
    the logprobs of pass 1; the surrogate's *value* differs from ``loss``).

    Args:
        loss: 0-d tensor computed from ``logprobs_D``.
        logprobs_D: per-datum logprob tensors (``(N_i,)`` or ``(N_i, K)``) that require grad.
    Returns: detached weights, one per datum, same shapes; zeros where the loss does not depend on a datum.
    Raises: BadRequestError if ``loss`` is not a finite scalar or does not depend on the logprobs.
    Source: tinker SDK ``training_client.py::forward_backward_custom``.
    """
    if loss.numel() != 1 or not bool(torch.isfinite(loss.detach()).all()):
        raise BadRequestError("a custom loss must return a finite scalar tensor", param="loss")
    if not loss.requires_grad:
        raise BadRequestError("the custom loss does not depend on the logprobs (no gradient)", param="loss")
    grads = torch.autograd.grad(loss.reshape(()), list(logprobs_D), allow_unused=True)
    return [(-g if g is not None else torch.zeros_like(lp)).detach() for g, lp in zip(grads, logprobs_D)]


@dataclass(frozen=True)
class CustomLossResult:
    """Outcome of pass 1 of a custom loss: its value, the user's metrics, and the surrogate weights."""

    loss: float
    metrics: dict[str, float]
    weights_D: list[Tensor]


def run_custom_loss(loss_fn: Callable[[Any, list[Tensor]], tuple[Tensor, Mapping[str, float]]],
                    data: Any, logprobs_D: Sequence[Tensor]) -> CustomLossResult:
    """Evaluate ``loss_fn(data, logprobs)`` on fresh leaves and return the surrogate weights.

    Mirrors tinker ``forward_backward_custom`` step 3: ``logprobs_D`` (from a forward pass) are detached,
    made leaves with grad, passed to the user function, and differentiated. Metrics returned to the
    client are the user's, plus ``loss:sum`` = the custom loss value.
    """
    leaves = [lp.detach().clone().requires_grad_(True) for lp in logprobs_D]
    loss, metrics = loss_fn(data, leaves)
    weights_D = surrogate_weights(loss, leaves)
    return CustomLossResult(float(loss.detach()), {**dict(metrics), "loss:sum": float(loss.detach())}, weights_D)


# ----------------------------------------------------------------------------------------------------
# Datum-level entry points and registry
# ----------------------------------------------------------------------------------------------------

DatumLossFn = Callable[[Sequence[Tensor], Sequence[Mapping[str, Tensor]], Mapping[str, float]], LossOutput]


def _cat(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1).to(like) for t in tensors])


def _datum_cross_entropy(lp_D, inputs_D, cfg):
    return cross_entropy(_cat(lp_D, lp_D[0]), _cat([x["weights"] for x in inputs_D], lp_D[0]))


def _datum_rl(fn):
    def run(lp_D, inputs_D, cfg):
        like = lp_D[0]
        mask = None
        if any("mask" in x for x in inputs_D):
            mask = _cat([x.get("mask", torch.ones_like(lp)) for x, lp in zip(inputs_D, lp_D)], like)
        return fn(_cat(lp_D, like), _cat([x["logprobs"] for x in inputs_D], like),
                  _cat([x["advantages"] for x in inputs_D], like), mask_T=mask, **cfg)
    return run


def _datum_logratios(lp_D, inputs_D) -> Tensor:
    like = lp_D[0]
    return torch.stack([
        sequence_logprobs(lp, x["weights"]) - sequence_logprobs(x["ref_logprobs"].to(like), x["weights"])
        for lp, x in zip(lp_D, inputs_D)])


def _datum_kto(lp_D, inputs_D, cfg):
    labels = [float(x["label"].reshape(-1)[0]) for x in inputs_D]
    desirable_B = torch.tensor([lab == 1.0 for lab in labels])
    kl_B = torch.stack([x["kl_logratio"].reshape(-1)[0].to(lp_D[0]) for x in inputs_D])
    return kto(_datum_logratios(lp_D, inputs_D), desirable_B, kl_B, **cfg)


def _datum_dpo(lp_D, inputs_D, cfg):
    logratios = _datum_logratios(lp_D, inputs_D)
    return dpo(logratios[0::2], logratios[1::2], **cfg)


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss as the trainer sees it.

    Attributes:
        name: the ``loss_fn`` string.
        fn: ``fn(target_logprobs_D, loss_fn_inputs_D, config) -> LossOutput`` (config already validated
            and filled with defaults).
        required_inputs / optional_inputs: ``loss_fn_inputs`` keys; any other key is rejected.
        config_defaults: accepted ``loss_fn_config`` keys and their defaults.
        reduction: ``"sum"`` over tokens (Tinker) or ``"mean"`` over examples/pairs (KTO/DPO).
        datum_layout: how datums map to examples (documentation for callers).
    """

    name: LossName
    fn: DatumLossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    reduction: Literal["sum", "mean"] = "sum"
    datum_layout: str = "one datum per sequence; per-token inputs have the shape of target_tokens"


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_PREF_INPUTS = ("target_tokens", "weights", "ref_logprobs")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("cross_entropy", _datum_cross_entropy, ("target_tokens", "weights")),
    "importance_sampling": LossSpec("importance_sampling", _datum_rl(importance_sampling), _RL_INPUTS, ("mask",)),
    "ppo": LossSpec("ppo", _datum_rl(ppo), _RL_INPUTS, ("mask",),
                    {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec("cispo", _datum_rl(cispo), _RL_INPUTS, ("mask",),
                      {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec("dro", _datum_rl(dro), _RL_INPUTS, ("mask",), {"beta": 0.05}),
    "kto": LossSpec("kto", _datum_kto, _PREF_INPUTS + ("label", "kl_logratio"), (),
                    {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}, "mean",
                    "one datum per example (prompt + completion); weights mark completion tokens; label 1 = "
                    "desirable, 0 = undesirable; kl_logratio = Σ_completion(lp − lp_ref) of (x_i, y_perm(i)), "
                    "perm = kl_pair_order(prompts), computed by the trainer without grad"),
    "dpo": LossSpec("dpo", _datum_dpo, _PREF_INPUTS, (), {"beta": 0.1}, "mean",
                    "datums alternate chosen, rejected (pair k = datums 2k, 2k+1, as tinker-cookbook "
                    "train_dpo); weights mark completion tokens"),
}

_SCALAR_INPUTS = ("label", "kl_logratio")


def _check_config(spec: LossSpec, config: Mapping[str, Any] | None) -> dict[str, float]:
    config = dict(config or {})
    for key in config:
        if key not in spec.config_defaults:
            accepted = ", ".join(spec.config_defaults) or "none"
            raise BadRequestError(f"loss_fn_config key {key!r} is not accepted by {spec.name} "
                                  f"(accepted: {accepted})", param=f"loss_fn_config.{key}")
    resolved = {**spec.config_defaults, **config}
    for key, value in resolved.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequestError(f"loss_fn_config {key!r} must be a finite number, got {value!r}",
                                  param=f"loss_fn_config.{key}")
        resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and not 0.0 <= lo <= 1.0:
        raise BadRequestError(f"clip_low_threshold must be an absolute ratio bound in [0, 1] (e.g. 0.8 for "
                              f"ε=0.2), got {lo}", param="loss_fn_config.clip_low_threshold")
    if hi is not None and hi < 1.0:
        raise BadRequestError(f"clip_high_threshold must be an absolute ratio bound ≥ 1 (e.g. 1.2 for "
                              f"ε=0.2), got {hi}", param="loss_fn_config.clip_high_threshold")
    for key in ("desirable_weight", "undesirable_weight"):
        if key in resolved and resolved[key] < 0:
            raise BadRequestError(f"{key} must be ≥ 0, got {resolved[key]}", param=f"loss_fn_config.{key}")
    if "beta" in resolved and (resolved["beta"] < 0 or (spec.name != "dro" and resolved["beta"] == 0)):
        raise BadRequestError(f"beta must be {'≥' if spec.name == 'dro' else '>'} 0 for {spec.name}, "
                              f"got {resolved['beta']}", param="loss_fn_config.beta")
    return resolved


def validate_loss_request(loss_fn: str, loss_fn_inputs_D: Sequence[Mapping[str, Tensor]],
                          loss_fn_config: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Check a forward_backward request before any compute; return the config filled with defaults.

    Checks: known ``loss_fn``; at least one datum; every required input present and no unknown input;
    per-token inputs shaped like ``target_tokens`` (1-D, or (N, K) ``weights`` for 2-D cross-entropy);
    KTO ``label`` ∈ {0, 1} and scalar ``kl_logratio``, ≥ 2 examples; DPO an even number of datums;
    ``loss_fn_config`` keys accepted and values valid.
    Raises: BadRequestError naming the offending key (``param`` = ``loss_fn``, ``loss_fn_inputs.<key>``
    or ``loss_fn_config.<key>``).
    """
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise BadRequestError(f"unknown loss_fn {loss_fn!r}; built-in losses: {', '.join(LOSSES)}",
                              param="loss_fn")
    if len(loss_fn_inputs_D) == 0:
        raise BadRequestError("forward_backward needs at least one datum", param="data")
    allowed = set(spec.required_inputs) | set(spec.optional_inputs)
    for i, inputs in enumerate(loss_fn_inputs_D):
        for key in spec.required_inputs:
            if key not in inputs:
                raise BadRequestError(f"datum {i}: {spec.name} needs loss_fn_inputs[{key!r}]",
                                      param=f"loss_fn_inputs.{key}")
        for key in inputs:
            if key not in allowed:
                raise BadRequestError(f"datum {i}: loss_fn_inputs key {key!r} is not used by {spec.name} "
                                      f"(accepted: {', '.join(sorted(allowed))})", param=f"loss_fn_inputs.{key}")
        tokens_shape = tuple(torch.as_tensor(inputs["target_tokens"]).shape)
        two_d_ok = spec.name == "cross_entropy"
        if len(tokens_shape) != 1 and not (two_d_ok and len(tokens_shape) == 2):
            raise BadRequestError(f"datum {i}: target_tokens must be 1-D (N,)"
                                  f"{' or 2-D (N, K)' if two_d_ok else ''}, got shape {list(tokens_shape)}",
                                  param="loss_fn_inputs.target_tokens")
        for key, value in inputs.items():
            shape = tuple(torch.as_tensor(value).shape)
            if key in _SCALAR_INPUTS:
                if int(torch.as_tensor(value).numel()) != 1:
                    raise BadRequestError(f"datum {i}: {key} must hold one number, got shape {list(shape)}",
                                          param=f"loss_fn_inputs.{key}")
            elif shape != tokens_shape:
                raise BadRequestError(f"datum {i}: {key} has shape {list(shape)} but target_tokens has "
                                      f"{list(tokens_shape)}", param=f"loss_fn_inputs.{key}")
            if key != "target_tokens" and not bool(torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all()):
                raise BadRequestError(f"datum {i}: {key} holds non-finite values", param=f"loss_fn_inputs.{key}")
        if spec.name == "kto" and float(torch.as_tensor(inputs["label"]).reshape(-1)[0]) not in (0.0, 1.0):
            raise BadRequestError(f"datum {i}: kto label must be 1 (desirable) or 0 (undesirable)",
                                  param="loss_fn_inputs.label")
    if spec.name == "kto" and len(loss_fn_inputs_D) < 2:
        raise BadRequestError("kto needs at least 2 examples per batch (mismatched KL pairs)", param="data")
    if spec.name == "dpo" and len(loss_fn_inputs_D) % 2:
        raise BadRequestError("dpo needs an even number of datums: chosen, rejected, chosen, ...", param="data")
    return _check_config(spec, loss_fn_config)


def compute_loss(loss_fn: str, target_logprobs_D: Sequence[Tensor],
                 loss_fn_inputs_D: Sequence[Mapping[str, Tensor]],
                 loss_fn_config: Mapping[str, Any] | None = None) -> LossOutput:
    """Validate, then compute built-in loss ``loss_fn`` over datums (the Tinker ``forward_backward`` loss).

    Args:
        loss_fn: a :data:`LossName`.
        target_logprobs_D: per datum, log p_θ(target_tokens) with grad, shaped like ``target_tokens``.
        loss_fn_inputs_D: per datum, ``loss_fn_inputs`` as tensors (see ``LOSSES[name]``).
        loss_fn_config: optional overrides of ``LOSSES[name].config_defaults``.
    Returns: :class:`LossOutput`; call ``.loss.backward()``.
    Raises: BadRequestError (see :func:`validate_loss_request`; also logprobs/target_tokens shape mismatch).
    """
    config = validate_loss_request(loss_fn, loss_fn_inputs_D, loss_fn_config)
    if len(target_logprobs_D) != len(loss_fn_inputs_D):
        raise BadRequestError(f"{len(target_logprobs_D)} logprob tensors for {len(loss_fn_inputs_D)} datums",
                              param="data")
    for i, (lp, inputs) in enumerate(zip(target_logprobs_D, loss_fn_inputs_D)):
        if tuple(lp.shape) != tuple(torch.as_tensor(inputs["target_tokens"]).shape):
            raise BadRequestError(f"datum {i}: logprobs shape {list(lp.shape)} != target_tokens shape",
                                  param="loss_fn_inputs.target_tokens")
    inputs_D = [{k: torch.as_tensor(v) for k, v in x.items()} for x in loss_fn_inputs_D]
    return LOSSES[loss_fn].fn(list(target_logprobs_D), inputs_D, config)
