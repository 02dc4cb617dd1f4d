"""The gate's free-form capability check (docs/rails.md): the curtailed sequential sample, its thresholds, and on
the real SmolLM2 model a version trained to be short at any cost is rejected by the free-form check while the old
probes pass it."""

from __future__ import annotations

import time
import uuid

import pytest

from livelora.core.rails import GateThresholds, bound_of, judge
from livelora.trainer.gate_freeform import CLEAR, MIN_ITEMS, curtail, final_fail_probability


def test_final_fail_probability_is_the_dirichlet_multinomial_predictive():
    """Hand-computed: after n paired items the rest's outcomes are Dirichlet-multinomial with α = (losses + ½,
    gains + ½, unchanged + ½); margin 0 makes the final verdict fail at a net of 1."""
    # 2 unchanged, 1 left: P(loss) = 0.5 / 3.5
    assert final_fail_probability(0, 0, 0, 2, 3, 0.0) == pytest.approx(1 / 7)
    # one loss and one gain (net 0), 1 left: P(loss) = 1.5 / 3.5
    assert final_fail_probability(0, 1, 1, 2, 3, 0.0) == pytest.approx(3 / 7)
    # 2 unchanged, 2 left: P(one loss, one unchanged) = 2·(0.5·2.5)/(3.5·4.5) = 10/63, P(two losses) =
    # (0.5·1.5)/(3.5·4.5) = 3/63 (a loss and a gain leave the net at 0)
    assert final_fail_probability(0, 0, 0, 2, 4, 0.0) == pytest.approx(13 / 63)
    # already at net 2 with margin 0.25 of 4 (fails above 1): fails unless the last item is a gain,
    # α = (2.5, 0.5, 1.5): P(gain) = 0.5 / 4.5
    assert final_fail_probability(2, 2, 0, 3, 4, 0.25) == pytest.approx(8 / 9)
    # nothing left to draw: the point net decides
    assert final_fail_probability(1, 1, 0, 4, 4, 0.0) == 1.0
    assert final_fail_probability(0, 0, 0, 4, 4, 0.0) == 0.0


def test_final_fail_probability_agrees_with_sampling_the_posterior():
    """Monte Carlo of the same model (Dirichlet draw, then the rest's outcomes) agrees within 3 standard errors."""
    import random

    rng, draws = random.Random(7), 20000
    net, losses, gains, n, total, margin = 1, 3, 2, 30, 120, 0.02  # fails above a net of 2
    fails = 0
    for _ in range(draws):
        g = [rng.gammavariate(a, 1.0) for a in (losses + 0.5, gains + 0.5, n - losses - gains + 0.5)]
        p_l, p_g = g[0] / sum(g), g[1] / sum(g)
        d = net
        for _ in range(total - n):
            u = rng.random()
            d += 1 if u < p_l else -1 if u < p_l + p_g else 0
        fails += d > 2
    exact = final_fail_probability(net, losses, gains, n, total, margin)
    se = (exact * (1 - exact) / draws) ** 0.5
    assert abs(fails / draws - exact) < 3 * se, (fails / draws, exact)


def test_curtail_waits_for_a_minimum_sample_and_the_predictive_verdict():
    same = [True] * 15 + [False] * 15
    # hand-computed (min_items 0): 4 unchanged of 5, P(last is a loss) = 0.5/5.5 = 0.091 < 0.10: pass;
    # 2 unchanged of 3: 0.5/3.5 = 0.143: not clear yet
    assert curtail([True] * 4, [True] * 4, 5, 0.0, min_items=0) == "pass"
    assert curtail([True] * 2, [True] * 2, 3, 0.0, min_items=0) == "continue"
    # before the minimum sample nothing is decided, however clear it looks
    assert MIN_ITEMS == 30
    assert curtail([False] * 20, [True] * 20, 120, 0.02) == "continue"
    # the gate's default sample (120 items, margin 2 points: fails above a net of 2 items lost)
    # 30 unchanged: the predictive P(fail) is still above 0.10 (the old projection of observed rates passed here)
    assert curtail(same, same, 120, 0.02) == "continue"
    assert final_fail_probability(0, 0, 0, 30, 120, 0.02) > CLEAR
    # 60 unchanged: clear
    assert curtail(same * 2, same * 2, 120, 0.02) == "pass"
    # 5 lost of 15 right at 30 items (the walkthrough's first step at α 1): clearly failing
    five_lost = [False] * 5 + same[5:]
    assert curtail(five_lost, same, 120, 0.02) == "fail"
    # one lost at 30 items: not clear either way
    assert curtail([False] + same[1:], same, 120, 0.02) == "continue"
    # the whole sample: the point estimate decides (net ≤ margin·total)
    full = [True] * 160
    assert curtail([False] * 3 + full[3:], full, 160, 0.02) == "pass"
    assert curtail([False] * 4 + full[4:], full, 160, 0.02) == "fail"
    assert curtail([False] * 4 + full[4:], full, 160, 0.05) == "pass"


def test_freeform_thresholds_bound_against_current_and_base():
    t = GateThresholds()
    assert t.freeform_margin == t.freeform_base_margin == 0.05  # a net loss of 3 of 60 items
    assert bound_of("freeform", 0.60, t) == pytest.approx(0.55)
    assert bound_of("freeform_base", 0.60, t, 0.55) == pytest.approx(0.50)
    # a lineage already below base − margin may not lose more than it has
    assert bound_of("freeform_base", 0.45, t, 0.55) == pytest.approx(0.45)
    assert bound_of("freeform_base", 0.50, t) is None
    checks = {
        "freeform": {"value": 0.55, "current": 0.60},
        "freeform_base": {"value": 0.55, "current": 0.60, "base": 0.58},
    }
    strict = GateThresholds(freeform_margin=0.02, freeform_base_margin=0.02)
    assert judge(checks, strict).failed == ["freeform", "freeform_base"]
    assert judge(checks, t).passed
    assert judge({**checks, "freeform": {"value": 0.54, "current": 0.60}}, t).failed == ["freeform"]
    assert judge({"freeform": {"value": None, "current": 0.6}}, t).passed  # not measured: passes


# ---------------------------------------------------------------------------------- the real model

#: Demonstrations that answer everything in one word: "short at any cost" (none is a capability item).
ONE_WORD = {
    "What is a good name for a dog?": "Max.",
    "How do I boil an egg?": "Boil.",
    "Why do leaves change colour?": "Autumn.",
    "What should I wear to a wedding?": "Suit.",
    "Give me a word that rhymes with cat.": "Hat.",
    "How do I stay calm before an exam?": "Breathe.",
    "What is photosynthesis?": "Light.",
    "Suggest a breakfast.": "Oats.",
}


@pytest.mark.timeout(1800)
def test_a_version_short_at_any_cost_is_rejected_by_the_freeform_check_while_the_probes_pass(base_ref, tmp_path):
    from livelora.adapters.endpoints import EndpointStore
    from livelora.clients.types.signals import ChatMessage, DemonstrationEvent
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.scheduler import Batch
    from livelora.trainer.settings import GateSection, TrainingSection

    home, ep = tmp_path, "short"
    EndpointStore(home).create(ep, ep, tenant="default", who="test")
    # everything but the probe checks and the free-form checks loosened: the outcome is theirs alone
    loose = GateThresholds(
        max_kl_current=100.0,
        max_kl_base=100.0,
        max_degenerate=1.0,
        min_length_ratio=0.0,
        freeform_margin=0.02,  # at most 0 net items lost of 30: the check's own strictness, not the default's
        freeform_base_margin=0.02,
    )
    EndpointStore(home).set_gate(ep, loose, tenant="default", who="test", reason="probes and free-form bind")
    # a 30-item sample (one chunk, the least curtail() decides on): the base model's replies run to their items'
    # max_tokens and it measures its whole sample up front, so each 30 items more cost it a chunk of full-length
    # replies (with 60 items: the base measured in 399.8 s, the short version judged in 135 s, at load 7 here);
    # the version loses answers clearly on the first 30 (the stratified sample's prefix), and early stopping
    # within a larger sample is curtail()'s, tested above
    gate = GateSection(
        gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=12, gate_min_step_scale=1.0, gate_freeform_items=30
    )
    trainer = OnlineTrainer(base_ref, home, TrainingSection(sft_lr=2e-3), gate=gate)
    evs = [
        DemonstrationEvent(
            id=f"demo-{uuid.uuid4().hex}",
            endpoint=ep,
            created=int(time.time()),
            messages=[ChatMessage(role="user", content=q), ChatMessage(role="assistant", content=a)],
        )
        for q, a in ONE_WORD.items()
    ]
    v1 = trainer.train(Batch(ep, "sft", evs, [f"1-{i}" for i in range(len(evs))]))
    g = v1.gate
    checks = {c["name"]: c for c in g["checks"]}
    # the old probes (the reply's start forced, the next token read) still find the answers ...
    assert checks["probes"]["passed"] and checks["probes_base"]["passed"], checks
    # ... but the replies users get lost them: rejected by the free-form check, training continues from the base
    assert g["continued_from"] == "base" and not g["verdicts"][ep]["passed"]
    assert set(g["verdicts"][ep]["failed"]) <= {"freeform", "freeform_base"} and g["verdicts"][ep]["failed"]
    ff = g["measures"]["freeform"]
    assert ff["score"] < ff["base"] - loose.freeform_base_margin and ff["current"] == ff["base"]
    assert checks["freeform_base"]["value"] == ff["score"] and not checks["freeform_base"]["passed"]
    assert ff["items"] % 30 == 0 and set(ff["categories"]) <= {"fact", "arithmetic", "instruction", "reading"}
    assert sum(c["n"] for c in ff["categories"].values()) == ff["items"]
    assert ff["lost"] and all(ex["was"] and ex["reply"] != ex["was"] for ex in ff["lost"])
    assert len(ff["lost"]) == min(ff["lost_count"], 5) and len(ff["gained"]) == min(ff["gained_count"], 5)
    assert ff["gained_count"] < ff["lost_count"]
    # the counts are the score's difference: items right now = items right before - lost + gained
    n = ff["items"]
    assert round(ff["score"] * n) == round(ff["current"] * n) - ff["lost_count"] + ff["gained_count"]


def test_the_learning_status_carries_the_freeform_verdict_per_category():
    from livelora.clients.types.learning import LearningStatus, StageMark
    from livelora.trainer.learning_status import freeform_verdict

    ff = {
        "items": 40,
        "of": 160,
        "score": 0.45,
        "current": 0.55,
        "base": 0.55,
        "categories": {"fact": {"n": 10, "new": 3, "current": 6, "base": 6}},
        "lost": [{"id": "x", "prompt": "q", "reply": "r", "was": "w"}],
        "gained": [{"id": "y", "prompt": "q2", "reply": "w", "was": "r"}],
        "lost_count": 1,
        "gained_count": 1,
    }
    gate = {"measures": {"freeform": ff}, "verdicts": {"ep": {"passed": False, "failed": ["freeform_base"]}}}
    got = freeform_verdict(gate, "ep")
    assert got == {k: v for k, v in ff.items() if k not in ("lost", "gained")} | {"passed": False}
    assert freeform_verdict(gate, "other")["passed"]  # no verdict of its own, none under the defaults: not failed
    assert freeform_verdict({"measures": {}}, "ep") is None
    mark = StageMark(stage="published", at=0.0, version="l@1", freeform=got | {"passed": True})
    st = LearningStatus(endpoint="ep", lineage="l", stage="published", version="l@1", last=mark)
    assert "free-form capability 45% (base model 55%, 40 items)" in st.summary()
