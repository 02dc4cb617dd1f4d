"""Built-in losses against hand-computed numbers and the reference formulas.

Expected numbers come from ../shared/reference/losses.md §3 (printed by calc/vectors.py, float64; values to
6 significant digits, ``VEC`` tolerances below) and, to 1e-9, from closed forms worked out by hand here
(e.g. the IS loss of §3.4 is ``-(0.5 e^0.2 + 0.5 e^0.3 + 0.5 - 0.5 e^-0.1 - 0.5 e^-0.9)``). KTO and DPO are
also checked against the TRL formulas, re-written independently in this file. Regression cases are
losses.md §7 (numbered as there).
"""

from __future__ import annotations

import math
import typing

import pytest
import torch
import torch.nn.functional as F

from livelora.clients.errors import BadRequestError
from livelora.core.losses import LOSS_SPECS as LOSSES
from livelora.core.losses import SUPPORTED_LOSSES, LossName
from livelora.trainer.losses import (
    cispo,
    compute_loss,
    cross_entropy,
    dpo,
    dro,
    group_advantages,
    gspo,
    importance_sampling,
    kl_pair_order,
    kto,
    ppo,
    run_custom_loss,
    sequence_logprobs,
    surrogate_weights,
    validate_loss_request,
)

D = torch.float64
e = math.exp


def t(x, **kw) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)


def close(actual, expected, tol: float) -> None:
    actual = torch.as_tensor(actual, dtype=D)
    expected = torch.as_tensor(expected, dtype=D)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, rtol=0, atol=tol), f"{actual.tolist()} != {expected.tolist()}"


# ------------------------------------------------------------------------------------------------
# §3.4 RL losses: 2 datums x 4 positions; position 0 prompt, datum 1 position 3 padding (A = 0 on both)
# ------------------------------------------------------------------------------------------------
LP = [[-0.3, -1.0, -0.2, -0.7], [-2.0, -0.5, -1.5, -0.1]]
Q = [[0.0, -1.2, -0.5, -0.7], [0.0, -0.4, -0.6, 0.0]]
ADV = [[0.0, 0.5, 0.5, 0.5], [0.0, -0.5, -0.5, 0.0]]
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
R1, R2, R3, R5, R6 = e(0.2), e(0.3), 1.0, e(-0.1), e(-0.9)  # ratios at the action tokens

# (fn, config, printed loss:sum (§3.4), closed-form loss, closed-form d loss / d lp, row-major)
RL_CASES = {
    "importance_sampling": (
        importance_sampling,
        {},
        -1.12993,
        -(0.5 * (R1 + R2 + R3) - 0.5 * (R5 + R6)),
        [0, -0.5 * R1, -0.5 * R2, -0.5, 0, 0.5 * R5, 0.5 * R6, 0],
    ),
    "ppo": (ppo, {}, -0.847581, -(0.6 + 0.6 + 0.5 - 0.5 * R5 - 0.4), [0, 0, 0, -0.5, 0, 0.5 * R5, 0, 0]),
    "ppo_0.9_1.1": (
        ppo,
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        -0.697581,
        -(0.55 + 0.55 + 0.5 - 0.5 * R5 - 0.45),
        [0, 0, 0, -0.5, 0, 0.5 * R5, 0, 0],
    ),
    "cispo": (
        cispo,
        {},
        0.564551,
        0.5 * R1 + 0.1 * R2 + 0.35 - 0.25 * R5 - 0.75 * R6,
        [0, -0.5 * R1, -0.5 * R2, -0.5, 0, 0.5 * R5, 0.5 * R6, 0],
    ),
    "cispo_0.8_1.2": (
        cispo,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        0.243791,
        0.6 + 0.12 + 0.35 - 0.25 * R5 - 0.6,
        [0, -0.6, -0.6, -0.5, 0, 0.5 * R5, 0.4, 0],
    ),
    "cispo_0.9_1.1": (
        cispo,
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        0.108791,
        0.55 + 0.11 + 0.35 - 0.25 * R5 - 0.675,
        [0, -0.55, -0.55, -0.5, 0, 0.5 * R5, 0.45, 0],
    ),
}
# dro, beta 0.05, masked to the action tokens: -Σ m (lp·A − ½β(lp−q)²); grad = m(−A + β(lp − q))
DRO_LOSS = -((-0.5 - 0.025 * 0.04) + (-0.1 - 0.025 * 0.09) + (-0.35) + (0.25 - 0.025 * 0.01) + (0.75 - 0.025 * 0.81))
DRO_GRAD = [0, -0.49, -0.485, -0.5, 0, 0.495, 0.455, 0]


# gspo on the §3.4 numbers, sequence_ratio_mask = MASK (the action tokens). Sequence ratios by hand:
# datum 0: mean(lp − q) over positions 1..3 = (0.2 + 0.3 + 0.0) / 3 = 1/6 → s0 = e^(1/6) = 1.181360;
# datum 1: over positions 1..2 = (−0.1 − 0.9) / 2 = −0.5 → s1 = e^−0.5 = 0.606531.
# Every token of datum i has ratio value s_i and d r_t / d lp_t = s_i, so d L / d lp_t = −A_t·s_i where the
# unclipped branch is the min and 0 where the clip binds (A > 0 & s > hi, A < 0 & s < lo).
S0, S1 = e(1 / 6), e(-0.5)
GSPO_CASES = {  # config → (loss, gradient row-major over the 2 x 4 positions)
    "paper_defaults": ({}, -3 * 0.5 * (1 + 4e-4) + 2 * 0.5 * (1 - 3e-4), [0] * 8),  # both sequences clipped
    "0.8_1.2": (
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        -1.5 * S0 + 2 * 0.5 * 0.8,
        [0, -0.5 * S0, -0.5 * S0, -0.5 * S0, 0, 0, 0, 0],
    ),  # s0 inside, s1 < 0.8 with A < 0: clipped
    "0.5_1.5": (
        {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
        -1.5 * S0 + 2 * 0.5 * S1,
        [0, -0.5 * S0, -0.5 * S0, -0.5 * S0, 0, 0.5 * S1, 0.5 * S1, 0],
    ),  # neither clipped
}


@pytest.mark.parametrize("case", sorted(GSPO_CASES))
def test_gspo_sequence_ratio_value_and_gradient_by_hand(case):
    config, loss, grad = GSPO_CASES[case]
    assert S0 == pytest.approx(1.181360, abs=1e-6) and S1 == pytest.approx(0.606531, abs=1e-6)
    lp_D = [t(LP[0], requires_grad=True), t(LP[1], requires_grad=True)]
    datums = [
        {
            "target_tokens": torch.arange(4),
            "logprobs": t(Q[i]),
            "advantages": t(ADV[i]),
            "sequence_ratio_mask": t(MASK[i]),
        }
        for i in range(2)
    ]
    out = compute_loss("gspo", lp_D, datums, config or None)
    out.loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(loss, abs=1e-9)
    close(torch.cat([lp_D[0].grad, lp_D[1].grad]), grad, 1e-9)
    # the tensor function directly, same numbers
    lp2 = [t(LP[0], requires_grad=True), t(LP[1], requires_grad=True)]
    direct = gspo(lp2, [t(q) for q in Q], [t(a) for a in ADV], [t(m) for m in MASK], **config)
    assert direct.loss.item() == pytest.approx(loss, abs=1e-9)


def test_gspo_equals_ppo_when_each_sequence_has_one_sampled_token():
    """With one masked position per datum the sequence ratio is that token's ratio: GSPO = PPO there."""
    lp = [t([-0.3, -1.0], requires_grad=True), t([-2.0, -0.5], requires_grad=True)]
    q, adv, m = [t([0.0, -1.2]), t([0.0, -0.4])], [t([0.0, 0.5]), t([0.0, -0.5])], [t([0.0, 1.0]), t([0.0, 1.0])]
    g = gspo(lp, q, adv, m, clip_low_threshold=0.8, clip_high_threshold=1.2).loss
    p = ppo(torch.cat([x.detach() for x in lp]), torch.cat(q), torch.cat(adv)).loss
    assert g.item() == pytest.approx(p.item(), abs=1e-12)


def test_rl_closed_forms_agree_with_printed_vectors():
    for _, _, printed, closed, _ in RL_CASES.values():
        assert closed == pytest.approx(printed, abs=5e-6)
    assert DRO_LOSS == pytest.approx(-0.0262500, abs=1e-9)


@pytest.mark.parametrize("case", sorted(RL_CASES))
def test_rl_loss_value_and_gradient_match_section_3_4(case):
    fn, config, printed, closed, grad = RL_CASES[case]
    lp = t(LP, requires_grad=True)
    out = fn(lp, t(Q), t(ADV), **config)
    out.loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(closed, abs=1e-9)
    assert out.loss.item() == pytest.approx(printed, abs=5e-6)
    close(lp.grad.flatten(), grad, 1e-9)


def test_dro_masked_matches_section_3_4():
    lp = t(LP, requires_grad=True)
    out = dro(lp, t(Q), t(ADV), beta=0.05, mask_T=torch.tensor(MASK))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(DRO_LOSS, abs=1e-9)
    close(lp.grad.flatten(), DRO_GRAD, 1e-9)


def test_dro_without_mask_follows_tinker_formula_and_penalises_prompt_positions():
    lp = t(LP)
    unmasked = dro(lp, t(Q), t(ADV), beta=0.05).loss
    # prompt positions (q placeholder 0) and the pad add ½β(lp−q)²: 0.025·(0.09 + 4.0 + 0.01)
    assert float(unmasked) == pytest.approx(DRO_LOSS + 0.025 * (0.09 + 4.0 + 0.01), abs=1e-9)


def _rl_datums(with_mask=False):
    """§3.4 as ragged Tinker datums: datum 1 has no padding (length 3)."""
    datums = []
    for i, n in enumerate((4, 3)):
        x = {"target_tokens": torch.arange(n), "logprobs": t(Q[i][:n]), "advantages": t(ADV[i][:n])}
        if with_mask:
            x["mask"] = t(MASK[i][:n])
        datums.append(x)
    return datums


@pytest.mark.parametrize("case", sorted(RL_CASES))
def test_rl_losses_through_registry_on_ragged_datums(case):
    fn, config, _, closed, grad = RL_CASES[case]
    name = fn.__name__
    lp_D = [t(LP[0], requires_grad=True), t(LP[1][:3], requires_grad=True)]
    out = compute_loss(name, lp_D, _rl_datums(), config or None)
    out.loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(closed, abs=1e-9)
    close(torch.cat([lp_D[0].grad, lp_D[1].grad]), grad[:7], 1e-9)


def test_dro_through_registry_uses_optional_mask_input():
    lp_D = [t(LP[0], requires_grad=True), t(LP[1][:3], requires_grad=True)]
    out = compute_loss("dro", lp_D, _rl_datums(with_mask=True), {"beta": 0.05})
    out.loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(DRO_LOSS, abs=1e-9)
    close(torch.cat([lp_D[0].grad, lp_D[1].grad]), DRO_GRAD[:7], 1e-9)


def test_registry_defaults_are_tinker_defaults():
    assert dict(LOSSES["ppo"].config_defaults) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert dict(LOSSES["cispo"].config_defaults) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert dict(LOSSES["kto"].config_defaults) == {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    assert dict(LOSSES["dpo"].config_defaults) == {"beta": 0.1}


def test_on_policy_gradients_equal_minus_advantage_and_cispo_value_is_reinforce():
    """§3.4 on-policy invariant; regression 7 (open-instruct PR #1269): CISPO = −Σ A·lp = 0.7, not −Σ A."""
    expected_value = {importance_sampling: -0.5, ppo: -0.5, cispo: 0.7}
    for fn, value in expected_value.items():
        lp = t(Q, requires_grad=True)
        out = fn(lp, t(Q), t(ADV))
        out.loss.backward()
        assert out.loss.item() == pytest.approx(value, abs=1e-12)
        close(lp.grad, -t(ADV), 1e-12)


def test_cispo_keeps_gradient_where_ppo_clip_binds():
    """Regression 6 (trl PR #4499, inverted CISPO branch): tokens 1, 2 (A>0, r>1.2) and 6 (A<0, r<0.8)."""
    clipped = [1, 2, 6]
    lp_p, lp_c = t(LP, requires_grad=True), t(LP, requires_grad=True)
    ppo(lp_p, t(Q), t(ADV)).loss.backward()
    cispo(lp_c, t(Q), t(ADV), clip_low_threshold=0.8, clip_high_threshold=1.2).loss.backward()
    assert all(lp_p.grad.flatten()[i] == 0 for i in clipped)
    close(lp_c.grad.flatten()[clipped], [-0.6, -0.6, 0.4], 1e-12)  # −clip(r)·A


@pytest.mark.parametrize("fn", [importance_sampling, ppo, cispo, dro])
@pytest.mark.parametrize("garbage", [float("nan"), float("-inf"), 50.0])
def test_padding_is_masked_exactly(fn, garbage):
    """Regressions 4/5: padded (D, T) with garbage at pad positions (in lp, q and A) changes nothing."""
    lp_ref = t(LP, requires_grad=True)
    ref = fn(lp_ref, t(Q), t(ADV), mask_T=torch.tensor(MASK))
    ref.loss.backward()
    pad = 3  # extra pad columns, plus the existing pad at datum 1 position 3
    lp = torch.full((2, 4 + pad), garbage, dtype=D)
    q = torch.full((2, 4 + pad), garbage, dtype=D)
    adv = torch.full((2, 4 + pad), garbage, dtype=D)
    lp[:, :4], q[:, :4], adv[:, :4] = t(LP), t(Q), t(ADV)
    lp[1, 3] = q[1, 3] = adv[1, 3] = garbage
    mask = torch.zeros(2, 4 + pad)
    mask[:, :4] = torch.tensor(MASK)
    lp.requires_grad_(True)
    out = fn(lp, q, adv, mask_T=mask)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-12)
    assert torch.isfinite(lp.grad).all()
    close(lp.grad[:, :4] * torch.tensor(MASK), lp_ref.grad * torch.tensor(MASK), 1e-12)
    assert (lp.grad[mask == 0] == 0).all()


# ------------------------------------------------------------------------------------------------
# §3.1 cross-entropy
# ------------------------------------------------------------------------------------------------
def test_cross_entropy_from_logits_matches_section_3_1():
    input_ids = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    logits = t(
        [
            [[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0], [2.0, -1.0, 0.0, 1.5]],
            [[0.3, 0.1, 2.0, -0.5], [1.0, 1.0, 1.0, 1.0], [-2.0, 4.0, 0.0, 0.0]],
        ]
    )
    lp = F.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    close(lp, [[-0.495182, -0.210998, -1.08314], [-0.346661, -1.38629, -6.03836]], 5e-6)
    weights = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])[:, 1:]  # completion mask shifted by one
    # hand: −[lp(seq0, pos 1) + lp(seq0, pos 2) + lp(seq1, pos 2)] with lp = x_target − logsumexp(row)
    lse = lambda row: math.log(sum(e(v) for v in row))  # noqa: E731
    hand = -((3.0 - lse([0, 0, 3, 1])) + (1.5 - lse([2, -1, 0, 1.5])) + (-2.0 - lse([-2, 4, 0, 0])))
    out = cross_entropy(lp, weights)
    assert out.loss.item() == pytest.approx(hand, abs=1e-12)
    assert out.loss.item() == pytest.approx(7.33250, abs=5e-6)
    # TRL/HF token mean is a different convention (2.44417): ours is the Tinker sum
    assert out.loss.item() / 3 == pytest.approx(2.44417, abs=5e-6)


def test_cross_entropy_per_token_weights_value_and_gradient():
    """§3.1(b): loss:sum 8.9, d loss / d lp = −w."""
    w = t([[0.0, 0.5, 1.0], [1.0, 1.0, 2.0]])
    lp = t([[-0.5, -1.0, -2.0], [-0.1, -0.3, -3.0]], requires_grad=True)
    out = cross_entropy(lp, w)
    out.loss.backward()
    assert out.metrics == {"loss:sum": pytest.approx(8.9, abs=1e-12)}
    close(lp.grad, -w, 0)


def test_cross_entropy_two_d_top_k_targets_through_registry():
    """Top-K soft targets: target_tokens (N, K), weights (N, K) teacher probabilities; L = −Σ_{t,k} w·lp."""
    lp = t([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True)
    w = t([[0.75, 0.25], [0.5, 0.5]])
    datum = {"target_tokens": torch.tensor([[3, 7], [1, 2]]), "weights": w}
    out = compute_loss("cross_entropy", [lp], [datum])
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.375 + 0.25 + 1.0 + 0.05, abs=1e-12)
    close(lp.grad, -w, 0)


# ------------------------------------------------------------------------------------------------
# §3.2 KTO
# ------------------------------------------------------------------------------------------------
KTO_POL_TOK = [[-1.0, -2.0, -0.5], [-0.2, -0.4, -0.6], [-3.0, -1.0, 0.0], [-2.0, -2.0, -2.0]]
KTO_REF_TOK = [[-1.5, -2.5, -1.0], [-0.3, -0.3, -0.9], [-2.0, -1.5, 0.0], [-1.0, -1.5, -2.5]]
KTO_MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
KTO_R = [1.5, 0.3, -0.5, -1.0]  # r = Σ m (lp − ref)
KTO_DESIRABLE = [True, True, False, False]
KTO_KL = [0.4, 0.1, -0.5, 0.3]  # mismatched-pair log-ratios: z0 = 0.075


def trl_kto(
    policy_chosen,
    policy_rejected,
    policy_kl,
    ref_chosen,
    ref_rejected,
    ref_kl,
    beta=0.1,
    desirable_weight=1.0,
    undesirable_weight=1.0,
):
    """TRL KTOTrainer.kto_loss, loss_type "kto" (trl 0.26.2 kto_trainer.py; 1.16 L1442–1444), one process."""
    kl = (policy_kl - ref_kl).mean().detach().clamp(min=0)
    chosen_losses = 1 - torch.sigmoid(beta * ((policy_chosen - ref_chosen) - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - (policy_rejected - ref_rejected)))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses.nanmean()


def _kto(r, desirable, kl, **kw):
    return kto(t(r), torch.tensor(desirable), t(kl), **kw)


@pytest.mark.parametrize(
    "beta,lam_u,per_example,mean",
    [
        (0.1, 1.0, [0.464435, 0.494375, 0.485629, 0.473151], 0.479398),
        (0.1, 1.33, [0.464435, 0.494375, 0.645887, 0.629291], 0.558497),
        (0.5, 1.0, [0.329047, 0.471905, 0.428616, 0.368769], 0.399584),
    ],
)
def test_kto_matches_section_3_2_and_trl_formula(beta, lam_u, per_example, mean):
    out = _kto(KTO_R, KTO_DESIRABLE, KTO_KL, beta=beta, undesirable_weight=lam_u)
    assert out.loss.item() == pytest.approx(mean, abs=1e-6)
    assert out.metrics["kto/z0:mean"] == pytest.approx(0.075, abs=1e-12)
    # per-example values: one-example batches with the same KL pairs
    singles = [
        _kto([r], [d], KTO_KL, beta=beta, undesirable_weight=lam_u).loss.item() for r, d in zip(KTO_R, KTO_DESIRABLE)
    ]
    close(singles, per_example, 1e-6)
    pol, ref = t([-3.5, -1.2, -4.0, -6.0]), t([-5.0, -1.5, -3.5, -5.0])
    pol_kl, ref_kl = t([-7.0, -4.0, -6.5, -5.0]), t([-7.4, -4.1, -6.0, -5.3])
    reference = trl_kto(pol[:2], pol[2:], pol_kl, ref[:2], ref[2:], ref_kl, beta, 1.0, lam_u)
    assert out.loss.item() == pytest.approx(float(reference), abs=1e-12)


def test_kto_implied_rewards_and_gradients_match_section_3_2():
    r = t(KTO_R, requires_grad=True)
    kl = t(KTO_KL, requires_grad=True)
    out = kto(r, torch.tensor(KTO_DESIRABLE), kl)
    out.loss.backward()
    close(r.grad, [-0.00621838, -0.00624921, 0.00624484, 0.00623198], 1e-8)
    assert kl.grad is None  # regression 2: z0 detached
    assert out.metrics["kto/rewards_desirable:mean"] == pytest.approx((0.15 + 0.03) / 2, abs=1e-12)
    assert out.metrics["kto/rewards_undesirable:mean"] == pytest.approx((-0.05 - 0.1) / 2, abs=1e-12)


def test_kto_clamps_negative_kl_reference_point_to_zero():
    """§3.2 clamp case (regression 3 keeps the clamp): raw KL mean −0.5 → z0 = 0."""
    kl = [-1.0, -0.5, -0.5, 0.0]
    singles = [_kto([r], [d], kl).loss.item() for r, d in zip(KTO_R, KTO_DESIRABLE)]
    close(singles, [0.462570, 0.492501, 0.487503, 0.475021], 1e-6)
    assert _kto(KTO_R, KTO_DESIRABLE, kl).loss.item() == pytest.approx(0.479399, abs=1e-6)
    # unbalanced batch: desirable {0, 1, 3}, undesirable {2}: 0.491888, not the unclamped 0.485669
    unbalanced = _kto(KTO_R, [True, True, False, True], kl)
    assert unbalanced.loss.item() == pytest.approx(0.491888, abs=1e-6)
    assert unbalanced.metrics["kto/z0:mean"] == 0.0


def test_kto_single_class_batches_are_finite():
    """Regression 2 (trl PR #1380/#1402): only desirable (→ 0.483770) or only undesirable examples."""
    only_desirable = _kto(KTO_R[:2], [True, True], KTO_KL[:2])
    assert only_desirable.loss.item() == pytest.approx(0.483770, abs=1e-6)
    assert "kto/rewards_undesirable:mean" not in only_desirable.metrics
    only_undesirable = _kto(KTO_R[2:], [False, False], KTO_KL[2:])
    z0 = max(0.0, (KTO_KL[2] + KTO_KL[3]) / 2)
    hand = sum(1 - 1 / (1 + e(-0.1 * (z0 - r))) for r in KTO_R[2:]) / 2
    assert only_undesirable.loss.item() == pytest.approx(hand, abs=1e-12)
    assert math.isfinite(only_undesirable.loss.item())


def test_kto_reference_point_is_the_mean_of_all_kl_pairs():
    """Regression 3 (align-anything #215): per-batch KLs [2, 8, 4, 6] aggregate to 5, not the last one."""
    out = _kto([0.0, 0.0, 0.0, 0.0], [True, False, True, False], [2.0, 8.0, 4.0, 6.0])
    assert out.metrics["kto/z0:mean"] == 5.0


@pytest.mark.parametrize("batch_size", range(2, 10))
def test_kl_pairs_never_pair_an_example_with_its_own_completion(batch_size):
    """Regression 1 (trl #1911): a reversed batch self-pairs the middle example at odd sizes."""
    perm = kl_pair_order([f"prompt-{i}" for i in range(batch_size)])
    assert sorted(perm) == list(range(batch_size))
    assert all(perm[i] != i for i in range(batch_size))
    assert perm == [(i - 1) % batch_size for i in range(batch_size)]  # TRL: [y_n, y_1, …, y_{n−1}]


def test_kl_pairs_avoid_duplicate_prompts_when_possible():
    prompts = ["a", "a", "b", "b", "c"]
    perm = kl_pair_order(prompts)
    assert all(prompts[perm[i]] != prompts[i] for i in range(5))
    same = kl_pair_order(["a", "a", "a"])  # impossible to avoid: still a derangement
    assert all(same[i] != i for i in range(3))
    with pytest.raises(BadRequestError):
        kl_pair_order(["only"])


def test_kto_odd_batch_matches_trl_formula():
    g = torch.Generator().manual_seed(0)
    pol, ref = -torch.rand(5, 6, generator=g, dtype=D) * 3, -torch.rand(5, 6, generator=g, dtype=D) * 3
    mask = (torch.rand(5, 6, generator=g) > 0.3).to(D)
    desirable = torch.tensor([True, False, True, True, False])
    perm = kl_pair_order(list(range(5)))
    r = sequence_logprobs(pol, mask) - sequence_logprobs(ref, mask)
    kl_pol = sequence_logprobs(pol[perm] * 0.9, mask[perm])  # stand-ins for the mismatched-pair scores
    kl_ref = sequence_logprobs(ref[perm], mask[perm])
    out = kto(r, desirable, kl_pol - kl_ref, beta=0.3, desirable_weight=1.0, undesirable_weight=1.2)
    pol_seq, ref_seq = sequence_logprobs(pol, mask), sequence_logprobs(ref, mask)
    reference = trl_kto(
        pol_seq[desirable], pol_seq[~desirable], kl_pol, ref_seq[desirable], ref_seq[~desirable], kl_ref, 0.3, 1.0, 1.2
    )
    assert out.loss.item() == pytest.approx(float(reference), abs=1e-12)


def test_kto_through_registry_from_per_token_datums():
    """§3.2 per-token construction as Tinker datums (ragged: datum 2 has 2 completion tokens)."""
    lp_D, datums = [], []
    for i in range(4):
        n = sum(KTO_MASK[i])
        lp_D.append(t([-0.7] + KTO_POL_TOK[i][:n], requires_grad=True))  # position 0 = prompt
        datums.append(
            {
                "target_tokens": torch.arange(n + 1),
                "weights": t([0.0] + [1.0] * n),
                "ref_logprobs": t([-9.0] + KTO_REF_TOK[i][:n]),
                "label": t([float(KTO_DESIRABLE[i])]),
                "kl_logratio": t([KTO_KL[i]]),
            }
        )
    out = compute_loss("kto", lp_D, datums)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.479398, abs=1e-6)
    assert float(lp_D[0].grad[0]) == 0.0
    close(lp_D[0].grad[1:], [-0.00621838] * 3, 1e-8)  # every completion token gets d loss / d r


def test_kto_micro_batches_add_up_when_every_datum_carries_the_batch_kl_mean():
    """LossSpec note: chunk losses scaled by chunk_size / B, kl_logratio = batch mean → the full-batch loss."""
    full = _kto(KTO_R, KTO_DESIRABLE, KTO_KL).loss.item()
    kl_mean = [sum(KTO_KL) / 4] * 4
    chunks = [_kto(KTO_R[a:b], KTO_DESIRABLE[a:b], kl_mean[a:b]).loss.item() * (b - a) / 4 for a, b in ((0, 1), (1, 4))]
    assert sum(chunks) == pytest.approx(full, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# §3.3 DPO
# ------------------------------------------------------------------------------------------------
C_TOK = [[-0.5, -1.0, -0.7, -9.0], [-1.2, -0.8, -9.0, -9.0]]
C_MSK = [[1, 1, 1, 0], [1, 1, 0, 0]]
R_TOK = [[-1.5, -2.0, -9.0, -9.0], [-0.9, -1.1, -1.3, -0.4]]
R_MSK = [[1, 1, 0, 0], [1, 1, 1, 1]]
REF_C_TOK = [[-0.8, -1.1, -0.9, -5.0], [-1.0, -1.0, -5.0, -5.0]]
REF_R_TOK = [[-1.2, -1.9, -5.0, -5.0], [-1.0, -1.0, -1.0, -0.5]]


def trl_dpo_sigmoid(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1):
    """TRL DPOTrainer sigmoid loss (1.16 dpo_trainer.py L1302–1310, L1528; 0.26.2 dpo_loss, ls = 0)."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    return (-F.logsigmoid(beta * logits)).mean()


def _dpo_logratios(c_tok, r_tok, c_msk, r_msk, ref_c_tok=REF_C_TOK, ref_r_tok=REF_R_TOK):
    c_msk, r_msk = torch.tensor(c_msk), torch.tensor(r_msk)
    return (
        sequence_logprobs(c_tok, c_msk) - sequence_logprobs(t(ref_c_tok), c_msk),
        sequence_logprobs(r_tok, r_msk) - sequence_logprobs(t(ref_r_tok), r_msk),
    )


@pytest.mark.parametrize("beta,mean", [(0.1, 0.663797), (0.5, 0.559237)])
def test_dpo_matches_section_3_3_and_trl_formula(beta, mean):
    chosen, rejected = _dpo_logratios(t(C_TOK), t(R_TOK), C_MSK, R_MSK)
    close(chosen, [-2.2 + 2.8, -2.0 + 2.0], 1e-12)
    close(rejected, [-3.5 + 3.1, -3.7 + 3.5], 1e-12)
    out = dpo(chosen, rejected, beta=beta)
    hand = sum(math.log1p(e(-beta * h)) for h in (1.0, 0.2)) / 2  # −log σ(βh) = log(1 + e^{−βh})
    assert out.loss.item() == pytest.approx(hand, abs=1e-12)
    assert out.loss.item() == pytest.approx(mean, abs=1e-6)
    reference = trl_dpo_sigmoid(t([-2.2, -2.0]), t([-3.5, -3.7]), t([-2.8, -2.0]), t([-3.1, -3.5]), beta)
    assert out.loss.item() == pytest.approx(float(reference), abs=1e-12)
    assert out.loss.item() != pytest.approx(0.815711, abs=1e-3)  # regression 4: unmasked pads


def test_dpo_gradients_and_rewards_match_section_3_3():
    c_tok, r_tok = t(C_TOK, requires_grad=True), t(R_TOK, requires_grad=True)
    out = dpo(*_dpo_logratios(c_tok, r_tok, C_MSK, R_MSK), beta=0.1)
    out.loss.backward()
    g = [0.1 / (1 + e(0.1 * h)) / 2 for h in (1.0, 0.2)]  # β·σ(−βh)/B
    assert g == pytest.approx([0.0237510, 0.0247500], abs=1e-7)
    close(c_tok.grad, -t(g)[:, None] * t(C_MSK), 1e-12)  # each completion token gets d loss / d seq logp
    close(r_tok.grad, t(g)[:, None] * t(R_MSK), 1e-12)
    assert out.metrics["dpo/rewards_chosen:mean"] == pytest.approx((0.06 + 0.0) / 2, abs=1e-12)
    assert out.metrics["dpo/rewards_rejected:mean"] == pytest.approx((-0.04 - 0.02) / 2, abs=1e-12)
    assert out.metrics["dpo/accuracy:mean"] == 1.0


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("extra,garbage", [(0, -9.0), (3, float("nan")), (2, float("-inf"))])
def test_dpo_does_not_depend_on_padding_side_or_amount(side, extra, garbage):
    """Regression 4 (CosyVoice #1449, trl PR #1284): pads excluded whatever their value, side or amount."""

    def repad(rows, masks):
        out_rows, out_masks = [], []
        for row, m in zip(rows, masks):
            real = [v for v, k in zip(row, m) if k]
            pad = 4 + extra - len(real)
            out_rows.append(real + [garbage] * pad if side == "right" else [garbage] * pad + real)
            out_masks.append([1] * len(real) + [0] * pad if side == "right" else [0] * pad + [1] * len(real))
        return t(out_rows), out_masks

    c_tok, c_msk = repad(C_TOK, C_MSK)
    r_tok, r_msk = repad(R_TOK, R_MSK)
    ref_c, _ = repad(REF_C_TOK, C_MSK)
    ref_r, _ = repad(REF_R_TOK, R_MSK)
    c_tok.requires_grad_(True)
    out = dpo(*_dpo_logratios(c_tok, r_tok, c_msk, r_msk, ref_c.tolist(), ref_r.tolist()), beta=0.1)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.663797, abs=1e-6)
    assert torch.isfinite(c_tok.grad).all() and (c_tok.grad[torch.tensor(c_msk) == 0] == 0).all()


def test_dpo_at_initialisation_is_ln_2():
    """Regression 9: policy = reference → loss ln 2 for any β."""
    for beta in (0.1, 0.5, 2.0):
        loss = dpo(t([0.0, 0.0, 0.0]), t([0.0, 0.0, 0.0]), beta=beta).loss
        assert loss.item() == pytest.approx(math.log(2), abs=1e-15)


def test_dpo_through_registry_on_interleaved_ragged_datums():
    datums, lp_D = [], []
    for k in range(2):
        for tok, msk, ref in ((C_TOK, C_MSK, REF_C_TOK), (R_TOK, R_MSK, REF_R_TOK)):
            n = sum(msk[k])
            lp_D.append(t([-0.3] + tok[k][:n], requires_grad=True))
            datums.append(
                {
                    "target_tokens": torch.arange(n + 1),
                    "weights": t([0.0] + [1.0] * n),
                    "ref_logprobs": t([-0.3] + ref[k][:n]),
                }
            )
    out = compute_loss("dpo", lp_D, datums)
    assert out.loss.item() == pytest.approx(0.663797, abs=1e-6)
    assert out.metrics["loss:sum"] == out.loss.item()


# ------------------------------------------------------------------------------------------------
# §3.5 group advantages
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rewards,centred,group",
    [
        ([1, 0, 0, 1], [0.5, -0.5, -0.5, 0.5], [0.865875, -0.865875, -0.865875, 0.865875]),
        ([1, -0.1, 0.9, 0], [0.55, -0.55, 0.45, -0.45], [0.947737, -0.947737, 0.775421, -0.775421]),
        ([0, 0, 0, 1], [-0.25, -0.25, -0.25, 0.75], [-0.4999, -0.4999, -0.4999, 1.4997]),
        ([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]),
    ],
)
def test_group_advantages_match_section_3_5(rewards, centred, group):
    r = t([rewards])
    close(group_advantages(r)[0], centred, 1e-12)
    got = group_advantages(r, normalize="group")[0]
    close(got, group, 1e-6)
    std = torch.tensor(rewards, dtype=D).std()
    if std > 0:  # hand: (r − μ)/(s + 1e-4) with the unbiased s
        close(got, t(centred) / (float(std) + 1e-4), 1e-12)
    assert torch.isfinite(got).all()


def test_batch_normalisation_differs_from_group_normalisation():
    """grpo-flat #2: groups [1,0,0,1] and [0,0,0,1], centred per group, ÷ (batch std + 1e-4)."""
    r = t([[1, 0, 0, 1], [0, 0, 0, 1]])
    close(
        group_advantages(r, normalize="batch").flatten(),
        [0.965905, -0.965905, -0.965905, 0.965905, -0.482953, -0.482953, -0.482953, 1.44886],
        1e-5,
    )
    assert not torch.allclose(group_advantages(r, normalize="batch"), group_advantages(r, normalize="group"))


def test_ragged_groups_and_singletons():
    out = group_advantages([t([1.0, 0.0]), t([3.0]), t([0.2, 0.2, 0.8])])
    close(out[0], [0.5, -0.5], 1e-12)
    close(out[1], [0.0], 0)  # a group of one has no baseline
    close(out[2], [-0.2, -0.2, 0.4], 1e-12)


def test_std_floor_never_amplifies_float_residue():
    """Regression 8 (NeMo-RL PR #4161): fp32 "identical" non-dyadic rewards have residue variance."""
    same = torch.full((7,), 0.35, dtype=torch.float32)
    naive_std = torch.sqrt((same**2).mean() - same.mean() ** 2)
    assert naive_std > 1e-5  # the one-pass fp32 formula leaves ≈1e-4 of residue std, not 0
    for normalize in ("none", "group", "batch"):
        assert (group_advantages(same[None], normalize=normalize) == 0).all()
    residue = same.clone()
    residue[3] = torch.nextafter(residue[3], torch.tensor(1.0))  # one ulp apart
    for normalize in ("none", "group", "batch"):
        adv = group_advantages(residue[None], normalize=normalize)
        assert (adv == 0).all() and adv.dtype == torch.float32
    # with a real singleton outlier the advantage stays bounded by the z-score limit (G−1)/√G
    group = torch.cat([same, torch.tensor([0.95])])[None]
    adv = group_advantages(group, normalize="group")
    assert float(adv.abs().max()) <= 7 / math.sqrt(8) + 1e-6


def test_group_advantages_reject_bad_input():
    with pytest.raises(BadRequestError):
        group_advantages(t([[1.0, float("nan")]]))
    with pytest.raises(BadRequestError):
        group_advantages(t([[1.0, 0.0]]), normalize="rloo")


# ------------------------------------------------------------------------------------------------
# Custom losses: two-pass surrogate (tinker_protocol.md §3.4)
# ------------------------------------------------------------------------------------------------
def test_custom_loss_surrogate_gradient_equals_autograd_of_the_user_loss():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 7, generator=g, dtype=D, requires_grad=True)  # a tiny "model": features → vocab
    feats = [torch.randn(4, 5, generator=g, dtype=D), torch.randn(3, 5, generator=g, dtype=D)]
    targets = [torch.tensor([1, 6, 2, 0]), torch.tensor([3, 3, 5])]

    def logprobs_D():
        return [F.log_softmax(f @ weight, -1).gather(-1, tt[:, None]).squeeze(-1) for f, tt in zip(feats, targets)]

    def user_loss(data, lps):  # non-linear in the logprobs: DPO-like on the two sequence sums + a square
        h = lps[0][1:].sum() - lps[1].sum()
        return -F.logsigmoid(0.5 * h) + 0.1 * (lps[0] ** 2).sum(), {"custom/h:mean": h.item()}

    direct, _ = user_loss(None, logprobs_D())
    (grad_direct,) = torch.autograd.grad(direct, [weight])
    with torch.no_grad():  # pass 1: forward only
        pass1 = logprobs_D()
    result = run_custom_loss(user_loss, None, pass1)
    assert result.loss == pytest.approx(direct.item(), abs=1e-12)
    assert result.metrics["loss:sum"] == result.loss and "custom/h:mean" in result.metrics
    datums = [{"target_tokens": tt, "weights": w} for tt, w in zip(targets, result.weights_D)]
    surrogate = compute_loss("cross_entropy", logprobs_D(), datums)  # pass 2: L_s = −Σ w·lp
    (grad_surrogate,) = torch.autograd.grad(surrogate.loss, [weight])
    close(grad_surrogate, grad_direct, 1e-12)


def test_surrogate_weights_are_minus_the_gradient_and_zero_for_unused_datums():
    a, b = t([-1.0, -2.0], requires_grad=True), t([-0.5], requires_grad=True)
    loss = (a**2).sum()
    w_a, w_b = surrogate_weights(loss, [a, b])
    close(w_a, [2.0, 4.0], 0)  # −∂(Σ a²)/∂a = −2a
    close(w_b, [0.0], 0)
    with pytest.raises(BadRequestError):
        surrogate_weights(t([1.0, 2.0], requires_grad=True).sum() * t(float("nan")), [a])
    with pytest.raises(BadRequestError):
        surrogate_weights(t(1.0), [a])


# ------------------------------------------------------------------------------------------------
# Registry and validation
# ------------------------------------------------------------------------------------------------
def test_registry_covers_tinker_loss_names_plus_kto_and_dpo():
    assert set(LOSSES) == set(typing.get_args(LossName)) == set(SUPPORTED_LOSSES)
    assert {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "kto", "dpo"} == set(LOSSES)
    assert all(spec.name == name for name, spec in LOSSES.items())


def _ce_datum():
    return {"target_tokens": torch.tensor([1, 2]), "weights": t([0.0, 1.0])}


@pytest.mark.parametrize(
    "loss_fn,datums,config,param",
    [
        (
            "gspo",
            [{"target_tokens": torch.tensor([1, 2]), "logprobs": t([0.0, -1.0]), "advantages": t([0.0, 1.0])}],
            None,
            "loss_fn_inputs.sequence_ratio_mask",
        ),
        (
            "gspo",
            [
                {
                    "target_tokens": torch.tensor([1, 2]),
                    "logprobs": t([0.0, -1.0]),
                    "advantages": t([0.0, 1.0]),
                    "sequence_ratio_mask": t([0.0, 0.0]),
                }
            ],
            None,
            "loss_fn_inputs.sequence_ratio_mask",
        ),
        ("stable_reinforce", [_ce_datum()], None, "loss_fn"),
        ("cross_entropy", [], None, "data"),
        ("cross_entropy", [{"target_tokens": torch.tensor([1, 2])}], None, "loss_fn_inputs.weights"),
        ("cross_entropy", [{**_ce_datum(), "advantages": t([0.0, 1.0])}], None, "loss_fn_inputs.advantages"),
        ("cross_entropy", [_ce_datum()], {"beta": 0.1}, "loss_fn_config.beta"),
        ("cross_entropy", [{**_ce_datum(), "weights": t([1.0])}], None, "loss_fn_inputs.weights"),
        ("ppo", [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0])}], None, "loss_fn_inputs.advantages"),
        (
            "ppo",
            [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([1.0])}],
            {"clip_epsilon": 0.2},
            "loss_fn_config.clip_epsilon",
        ),
        (
            "ppo",
            [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([1.0])}],
            {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2},
            "loss_fn_config.clip_high_threshold",
        ),
        (
            "cispo",
            [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([1.0])}],
            {"clip_low_threshold": 1.2},
            "loss_fn_config.clip_low_threshold",
        ),
        (
            "ppo",
            [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([float("nan")])}],
            None,
            "loss_fn_inputs.advantages",
        ),
        (
            "dro",
            [{"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([1.0])}],
            {"beta": True},
            "loss_fn_config.beta",
        ),
        ("dpo", [{"target_tokens": torch.tensor([1]), "weights": t([1.0]), "ref_logprobs": t([0.0])}], None, "data"),
        (
            "dpo",
            [{"target_tokens": torch.tensor([1]), "weights": t([1.0]), "ref_logprobs": t([0.0])}] * 2,
            {"beta": 0.0},
            "loss_fn_config.beta",
        ),
        (
            "kto",
            [{"target_tokens": torch.tensor([1]), "weights": t([1.0]), "ref_logprobs": t([0.0]), "label": t([1.0])}]
            * 2,
            None,
            "loss_fn_inputs.kl_logratio",
        ),
        (
            "kto",
            [
                {
                    "target_tokens": torch.tensor([1]),
                    "weights": t([1.0]),
                    "ref_logprobs": t([0.0]),
                    "label": t([2.0]),
                    "kl_logratio": t([0.0]),
                }
            ]
            * 2,
            None,
            "loss_fn_inputs.label",
        ),
        (
            "kto",
            [
                {
                    "target_tokens": torch.tensor([1]),
                    "weights": t([1.0]),
                    "ref_logprobs": t([0.0]),
                    "label": t([1.0]),
                    "kl_logratio": t([0.0]),
                }
            ],
            None,
            "data",
        ),
        (
            "kto",
            [
                {
                    "target_tokens": torch.tensor([1]),
                    "weights": t([1.0]),
                    "ref_logprobs": t([0.0]),
                    "label": t([1.0]),
                    "kl_logratio": t([0.0]),
                }
            ]
            * 2,
            {"desirable_weight": -1},
            "loss_fn_config.desirable_weight",
        ),
    ],
)
def test_bad_requests_name_the_offending_key(loss_fn, datums, config, param):
    with pytest.raises(BadRequestError) as info:
        validate_loss_request(loss_fn, datums, config)
    assert info.value.param == param
    assert info.value.status == 400
    key = param.rsplit(".", 1)[-1]
    if key not in ("data",):
        assert key in info.value.message


def test_compute_loss_rejects_logprobs_of_the_wrong_shape_before_any_backward():
    lp = t([-1.0, -2.0, -3.0], requires_grad=True)
    with pytest.raises(BadRequestError, match="target_tokens"):
        compute_loss("cross_entropy", [lp], [_ce_datum()])
    assert lp.grad is None


def test_validate_returns_config_with_defaults():
    datum = {"target_tokens": torch.tensor([1]), "logprobs": t([0.0]), "advantages": t([1.0])}
    assert validate_loss_request("ppo", [datum], {"clip_high_threshold": 1.28}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
    }
    assert validate_loss_request("importance_sampling", [datum]) == {}
