"""The built-in losses' specifications: one :class:`~livelora.core.losses.spec.LossSpec` per ``loss_fn``.

This is the one registry of loss names (:data:`LOSS_SPECS`). Tinker's six server losses (``cross_entropy``,
``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``) keep Tinker's input names, defaults and ``loss:sum``
reduction; ``kto`` and ``dpo`` are livelora's preference losses, means over examples/pairs with reference
logprobs the trainer computes from the base model (adapter disabled). Each spec's ``reference`` names the paper
and a version-pinned implementation; formulas, test vectors and pins: ``docs/internals/losses.md``.
"""

from __future__ import annotations

from livelora.core.losses.spec import ConfigKey, GradientPositions, LossInput, LossSpec

# ------------------------------------------------------------------------------------------------ inputs
TARGET_TOKENS = LossInput(
    "target_tokens",
    "int64",
    "targets",
    "token ids: target_tokens[i] is the token after model_input[i] (N = model_input length)",
)
SFT_WEIGHTS = LossInput(
    "weights",
    "float32",
    "tokens",
    "per-token weight (0 on prompt positions; any real number; teacher probabilities for (N, K))",
)
SAMPLER_LOGPROBS = LossInput(
    "logprobs", "float32", "tokens", "q: log-probability of each target token under the sampler that produced it (nats)"
)
ADVANTAGES = LossInput("advantages", "float32", "tokens", "A: per-token advantage (0 on prompt and padding positions)")
RL_MASK = LossInput(
    "mask", "float32", "tokens", "optional exact mask: positions where it is 0 contribute nothing", required=False
)
COMPLETION_WEIGHTS = LossInput(
    "weights",
    "float32",
    "tokens",
    "completion mask: 1 on completion tokens, 0 on the prompt",
    nonzero_reason="needs at least one completion token (a non-zero weight)",
)
REF_LOGPROBS = LossInput(
    "ref_logprobs",
    "float32",
    "tokens",
    "reference-model logprobs of the targets (nats), computed by the trainer with the adapter disabled",
    source="trainer",
)
KTO_LABEL = LossInput(
    "label", "float32", "datum", "1 = desirable (thumbs up), 0 = undesirable", allowed_values=(0.0, 1.0)
)
KL_LOGRATIO = LossInput(
    "kl_logratio",
    "float32",
    "datum",
    "Σ_completion(lp − lp_ref) of this prompt with another datum's completion (nats), computed "
    "by the trainer without grad",
    source="trainer",
)
EXAMPLE_WEIGHT = LossInput(
    "example_weight",
    "float32",
    "datum",
    "optional weight ≥ 0 of this example's loss term (default 1; the live loop sets its rater's "
    "agreement weight); the loss stays the mean over examples",
    required=False,
)

_RL_INPUTS = (TARGET_TOKENS, SAMPLER_LOGPROBS, ADVANTAGES, RL_MASK)


# ------------------------------------------------------------------------------------------------ config keys
def _clip_low(default: float) -> ConfigKey:
    return ConfigKey(
        "clip_low_threshold",
        default,
        "lower bound of the ratio r = exp(lp − q) (absolute, not ε)",
        minimum=0.0,
        maximum=1.0,
        hint="an absolute ratio bound, e.g. 0.8 for PPO's ε = 0.2",
    )


def _clip_high(default: float) -> ConfigKey:
    return ConfigKey(
        "clip_high_threshold",
        default,
        "upper bound of the ratio r = exp(lp − q) (absolute, not ε)",
        minimum=1.0,
        hint="an absolute ratio bound, e.g. 1.2 for PPO's ε = 0.2",
    )


def _beta(default: float, doc: str) -> ConfigKey:
    return ConfigKey("beta", default, doc, minimum=0.0, exclusive_minimum=True)


_FROM_ADVANTAGES = GradientPositions("advantages", ("mask",), "every term is multiplied by A: dL/dlp = 0 where A = 0")
_FROM_WEIGHTS = GradientPositions("weights", why="the sequence log-ratio sums lp over positions with a non-zero weight")

# ------------------------------------------------------------------------------------------------ the specs
CROSS_ENTROPY = LossSpec(
    name="cross_entropy",
    summary="L = −Σ_t w_t·lp_t (SFT with per-token weights; (N, K) targets: −Σ_t Σ_k w_t,k·log p(x_t,k))",
    inputs=(TARGET_TOKENS, SFT_WEIGHTS),
    gradient=GradientPositions("weights", why="dL/dlp = −w: zero where w = 0"),
    reference="Tinker docs losses/cross-entropy; tinker-cookbook 0.6.1 supervised/common.py::compute_mean_nll "
    "(mean_nll = loss:sum / Σw); docs/internals/losses.md §2.1, vectors §3.1",
    top_k_targets=True,
)

IMPORTANCE_SAMPLING = LossSpec(
    name="importance_sampling",
    summary="L = −Σ_t exp(lp_t − q_t)·A_t (REINFORCE with importance weights; dL/dlp = −r·A)",
    inputs=_RL_INPUTS,
    gradient=_FROM_ADVANTAGES,
    reference="Tinker docs (losses page, importance_sampling); tinker-cookbook 0.6.1 rl/data_processing.py "
    "(advantages 0 on prompt tokens); docs/internals/losses.md §2.4, vectors §3.4",
)

PPO = LossSpec(
    name="ppo",
    summary="L = −Σ_t min(r_t·A_t, clip(r_t, lo, hi)·A_t), r = exp(lp − q)",
    inputs=_RL_INPUTS,
    gradient=_FROM_ADVANTAGES,
    config=(_clip_low(0.8), _clip_high(1.2)),
    reference="Schulman et al. 2017, arXiv 1707.06347, Eq. 7; Tinker docs (losses page) and tutorial "
    "202_loss_functions.py (absolute thresholds 0.8 / 1.2); docs/internals/losses.md §2.5, vectors §3.4",
)

CISPO = LossSpec(
    name="cispo",
    summary="L = −Σ_t sg(clip(r_t, lo, hi))·A_t·lp_t (the clipped ratio is a detached weight; never zeroes a gradient)",
    inputs=_RL_INPUTS,
    gradient=_FROM_ADVANTAGES,
    config=(_clip_low(0.0), _clip_high(4.0)),
    reference="MiniMax-M1, arXiv 2506.13585, Eq. 4; TRL 1.16.0 trl/trainer/grpo_trainer.py L3109–3111 "
    "(loss_type='cispo'); Tinker tutorial 202_loss_functions.py (one-sided 0.0 / 4.0); "
    "docs/internals/losses.md §2.6, vectors §3.4",
)

DRO = LossSpec(
    name="dro",
    summary="L = −Σ_t (lp_t·A_t − ½·β·(lp_t − q_t)²)",
    inputs=_RL_INPUTS,
    gradient=GradientPositions(
        None,
        ("mask",),
        "the quadratic term has a gradient wherever lp ≠ q, also where A = 0 "
        "(send mask to restrict it to sampled tokens)",
    ),
    config=(
        ConfigKey("beta", 0.05, "weight of the quadratic penalty (per nat²); Tinker docs example value", minimum=0.0),
    ),
    reference="Richemond et al. 2024, arXiv 2405.19107 (DRO); Tinker docs (losses page); "
    "docs/internals/losses.md §2.6, vectors §3.4 (masked, β = 0.05)",
)

SEQUENCE_RATIO_MASK = LossInput(
    "sequence_ratio_mask",
    "float32",
    "tokens",
    "non-zero at the positions whose log-ratios (lp − q) the sequence ratio averages (the sampled tokens)",
    nonzero_reason="the sequence ratio is a mean over its non-zero positions",
)

GSPO = LossSpec(
    name="gspo",
    summary="L = −Σ_t min(r_t·A_t, clip(r_t, lo, hi)·A_t), "
    "r_t = exp(mean_{m≠0}(sg(lp) − q) + lp_t − sg(lp_t)) per datum",
    inputs=(TARGET_TOKENS, SAMPLER_LOGPROBS, ADVANTAGES, SEQUENCE_RATIO_MASK, RL_MASK),
    gradient=_FROM_ADVANTAGES,
    config=(_clip_low(1.0 - 3e-4), _clip_high(1.0 + 4e-4)),
    reference="Zheng et al. 2025, arXiv 2507.18071, Eq. 7, §4.3 (GSPO-token), §5.1 (clipping ranges 3e-4 / 4e-4 "
    "as absolute bounds 0.9997 / 1.0004); Tinker docs (losses/gspo page); "
    "tinker-cookbook 0.6.1 recipes/rl_loop.py (sequence_ratio_mask); docs/internals/losses.md §2.7 "
    "(vectors by hand in tests/test_losses.py)",
)

KTO = LossSpec(
    name="kto",
    summary="L = mean_B a·[λ_D·(1 − σ(β(r − z0))) if desirable else λ_U·(1 − σ(β(z0 − r)))], "
    "r = Σ_completion(lp − lp_ref), z0 = max(0, mean kl_logratio) detached, a = example_weight (1)",
    inputs=(TARGET_TOKENS, COMPLETION_WEIGHTS, KTO_LABEL, REF_LOGPROBS, KL_LOGRATIO, EXAMPLE_WEIGHT),
    gradient=_FROM_WEIGHTS,
    config=(
        _beta(0.1, "β: scale of the implied reward β·r"),
        ConfigKey("desirable_weight", 1.0, "λ_D (paper Eq. 8: λ_D·n_D / (λ_U·n_U) in [1, 4/3])", minimum=0.0),
        ConfigKey("undesirable_weight", 1.0, "λ_U", minimum=0.0),
    ),
    reduction="mean",
    min_batch=2,
    min_batch_reason="the KL reference point z0 pairs each prompt with another datum's completion",
    reference="Ethayarajh et al. 2024, arXiv 2402.01306, Eq. 7–8; TRL 0.26.2 trl/experimental/kto "
    "KTOTrainer.kto_loss (1.16.0 kto_trainer.py L1442–1444 for z0); HALOs train/trainers.py "
    "KTOTrainer.loss; docs/internals/losses.md §2.2, vectors §3.2",
    datum_layout="one datum per example (prompt + completion); weights mark completion tokens; label 1 = desirable, "
    "0 = undesirable; the trainer adds ref_logprobs and kl_logratio (pairs from kl_pair_order)",
)

DPO = LossSpec(
    name="dpo",
    summary="L = mean_pairs a·(−log σ(β·[(lp_c − ref_c) − (lp_r − ref_r)])), each term a masked sum over completion "
    "tokens, a = the chosen datum's example_weight (1)",
    inputs=(TARGET_TOKENS, COMPLETION_WEIGHTS, REF_LOGPROBS, EXAMPLE_WEIGHT),
    gradient=_FROM_WEIGHTS,
    config=(_beta(0.1, "β: scale of the implied reward β·(lp − ref)"),),
    reduction="mean",
    min_batch=2,
    pairing="chosen_rejected",
    min_batch_reason="each example is a (chosen, rejected) pair of datums",
    reference="Rafailov et al. 2023, arXiv 2305.18290, Eq. 7; TRL 1.16.0 trl/trainer/dpo_trainer.py L1302–1310, "
    "L1528 (loss_type='sigmoid'); tinker-cookbook 0.6.1 preference/train_dpo.py::compute_dpo_loss; "
    "docs/internals/losses.md §2.3, vectors §3.3",
    datum_layout="datums alternate chosen, rejected (pair k = datums 2k, 2k+1, as tinker-cookbook train_dpo); "
    "weights mark completion tokens; the trainer adds ref_logprobs",
)

#: The one registry of loss names: ``loss_fn`` → spec. The trainer registers one tensor function per key.
LOSS_SPECS: dict[str, LossSpec] = {
    s.name: s for s in (CROSS_ENTROPY, IMPORTANCE_SAMPLING, PPO, CISPO, DRO, GSPO, KTO, DPO)
}

#: Tinker loss names livelora refuses (400 ``unsupported_parameter``), with the reason given to the client.
#: A custom loss needs no spec: ``forward_backward_custom`` runs it in the client and sends ``cross_entropy``
#: with surrogate weights ``−∂loss/∂lp`` (docs/internals/losses.md §2.8).
REFUSED_LOSSES: dict[str, str] = {
    "stable_reinforce": "stable_reinforce's objective is unpublished; use importance_sampling",
    "custom": "server-side custom losses are not supported; use forward_backward_custom on the client",
}
