"""The gate's line search (docs/rails.md, "A smaller step instead of the same one"): the arithmetic of the
candidates (the weights equal θ₀ + α·(θ₁ − θ₀) exactly), the verdict of a candidate measured only up to its
first failure, and on the real SmolLM2 model a step whose full size collapses the reply length: a scaled step
passes and is published with its α (manifest, history, ``adapters show``, learning status, Prometheus), AdamW's
moments are the step's, and the loop keeps learning from it."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
from harness.gate import rating_batch, wrong_answers_batch
from prometheus_client import REGISTRY
from safetensors.torch import load_file
from typer.testing import CliRunner

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import WEIGHTS_FILE, AdapterStore
from livelora.clients.types.learning import LearningStatus
from livelora.clients.types.signals import ChatMessage, DemonstrationEvent
from livelora.core.rails import GateResult, GateThresholds, judge
from livelora.trainer.gate_measure import CHECKS, PASSES
from livelora.trainer.line_search import candidate_weights, step_scales
from livelora.trainer.scheduler import Batch, BatchScheduler

# ---------------------------------------------------------------------------------- arithmetic


@pytest.mark.unit
def test_step_scales_halve_down_to_the_floor():
    assert step_scales(0.125) == [1.0, 0.5, 0.25, 0.125]
    assert step_scales(0.2) == [1.0, 0.5, 0.25]  # the smallest power of ½ at or above the floor
    assert step_scales(0.5) == [1.0, 0.5] and step_scales(0.51) == [1.0]
    assert step_scales(1.0) == [1.0]  # floor 1: no line search (the full step or nothing, as before)
    assert step_scales(2.0**-10)[-1] == 2.0**-10 and len(step_scales(2.0**-10)) == 11
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            step_scales(bad)


@pytest.mark.unit
def test_candidate_weights_are_the_formula_exactly():
    """θ_α = θ₀ + α·(θ₁ − θ₀), elementwise in float32 with IEEE rounding after each operation (numpy as the
    reference); at α = 1 the trained tensors themselves, bit for bit (θ₀ + (θ₁ − θ₀) may differ from θ₁ by one
    rounding)."""
    g = torch.Generator().manual_seed(7)
    start = {"a.lora_A.weight": torch.randn(8, 64, generator=g), "a.lora_B.weight": torch.zeros(64, 8)}
    trained = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    trained["a.lora_A.weight"][0, :4] = torch.tensor([1e8, -1e-8, 3.0, 0.1])  # large and tiny differences
    for alpha in step_scales(2.0**-6)[1:] + [0.3]:
        got = candidate_weights(start, trained, alpha)
        assert set(got) == set(trained)
        for k in trained:
            s, t = start[k].numpy(), trained[k].numpy()
            want = s + np.float32(alpha) * (t - s)
            assert want.dtype == np.float32 and got[k].dtype == torch.float32
            assert np.array_equal(got[k].numpy(), want), (k, alpha)
            exact = s.astype(np.float64) + alpha * (t.astype(np.float64) - s.astype(np.float64))
            assert np.allclose(got[k].numpy(), exact, rtol=2.0**-22, atol=0)  # within float32 rounding
    one = candidate_weights(start, trained, 1.0)
    assert all(torch.equal(one[k], trained[k]) and one[k] is not trained[k] for k in trained)
    # B = 0 at a lineage's start: the candidate's B is α·B₁, its product with A is not α·B₁A₁ (docs/rails.md)
    half = candidate_weights(start, trained, 0.5)
    assert torch.equal(half["a.lora_B.weight"], 0.5 * trained["a.lora_B.weight"])


@pytest.mark.unit
def test_a_candidate_measured_up_to_its_first_failure_passes_for_no_endpoint():
    """The verdict of a partly measured candidate: the checks not measured are ``skipped`` and it does not pass,
    unless the gate is disabled; the measuring passes cover every check once, cheapest (probes) first."""
    assert list(PASSES) == ["probes", "signal", "replies", "freeform"]
    assert sorted(CHECKS) == sorted(
        ["probes", "probes_base", "kl_current", "kl_base", "signal"]
        + ["degenerate", "length_ratio", "freeform", "freeform_base"]
    )
    probes_pass = {
        "probes": {"value": 0.8, "current": 0.83},
        "probes_base": {"value": 0.8, "current": 0.83, "base": 0.83},
        "kl_current": {"value": 0.5},
        "kl_base": {"value": 0.6},
    }
    skipped = ["degenerate", "length_ratio"]
    t = GateThresholds()
    v = judge(probes_pass, t, skipped)
    assert not v.passed and v.failed == ["kl_current"] and v.skipped == skipped
    loose = GateThresholds(max_kl_current=1.0)
    v = judge(probes_pass, loose, skipped)
    assert not v.passed and v.failed == [] and v.skipped == skipped  # nothing failed, yet not all was measured
    assert judge(probes_pass, loose).passed
    assert judge(probes_pass, GateThresholds(enabled=False), skipped).passed
    assert judge({**probes_pass, "length_ratio": {"value": 0.9}}, loose, ["length_ratio"]).skipped == []
    # a version written before the line search has no step_scale: it holds its full step
    old = GateResult.model_validate({"against": "base", "verdicts": {"*": {"passed": True}}})
    assert old.step_scale == 1.0 and old.line_search == []


# ---------------------------------------------------------------------------------- the real model

SHORT = {
    "What is a good name for a dog?": "Max.",
    "How do I boil an egg?": "Boil it.",
    "Why do leaves change colour?": "Less chlorophyll.",
    "What is the tallest mountain?": "Everest.",
    "Give me a word that rhymes with cat.": "Hat.",
    "How far is the Moon?": "Far.",
    "What is photosynthesis?": "Plant food.",
    "Suggest a breakfast.": "Oats.",
}


def _terse(endpoint: str) -> Batch:
    """Demonstrations answering in one or two words: at ``sft_lr`` 3e-3 the full step collapses the gate's greedy
    replies (mean length 0.20 of the base model's, two of four empty), half of it keeps 0.75 (measured)."""
    evs = [
        DemonstrationEvent(
            id=f"demo-{uuid.uuid4().hex}",
            endpoint=endpoint,
            created=int(time.time()),
            messages=[ChatMessage(role="user", content=q), ChatMessage(role="assistant", content=a)],
        )
        for q, a in SHORT.items()
    ]
    return Batch(endpoint, "sft", evs, [f"3-{i}" for i in range(len(evs))])


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.timeout(1800)
def test_a_step_the_length_check_refuses_is_published_scaled_and_learning_goes_on(base_ref, tmp_path, bus):
    from livelora.cli.main import app
    from livelora.trainer.learning_status import LearningReporter
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    home, ep = tmp_path, "terse"
    EndpointStore(home).create(ep, ep, tenant="default", who="test")
    # only the length check and the drift check bind: the full step's replies are 0.20 of the current length
    # (bound 0.5), half of it 0.75; the other checks are loosened so that the outcome is theirs alone
    t = GateThresholds(
        probe_margin=1.0,
        probe_base_margin=1.0,
        max_kl_current=100.0,
        max_kl_base=100.0,
        max_degenerate=1.0,
        min_length_ratio=0.5,
        signal_tolerance=100.0,
        freeform_margin=1.0,
        freeform_base_margin=1.0,
    )
    EndpointStore(home).set_gate(ep, t, tenant="default", who="test", reason="the length check binds")
    gate = GateSection(gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=16)  # floor 1/8 (the default)
    config = TrainingSection(sft_lr=3e-3)
    trainer = OnlineTrainer(base_ref, home, config, gate=gate)
    client, keys = bus
    reporter = LearningReporter(client, keys, config)
    seen: dict[float, dict[str, torch.Tensor]] = {}  # α → the weights the model held when the gate measured it
    checks: list[tuple[str, float]] = []
    details: list[str] = []

    def progress(lineage, stage, **fields):
        reporter.progress(lineage, stage, **fields)
        if stage == "training":
            details.append(fields["detail"])
        if stage == "gate":
            checks.append((fields["check"], fields["step_scale"]))
        if stage == "gate" and fields["check"] == "probes":
            params = trainer.model_for(lineage).lora_params
            seen[fields["step_scale"]] = {k: p.detach().clone() for k, p in params.items()}

    trainer.progress = progress
    model = trainer.model_for(ep)
    start = {k: p.detach().clone() for k, p in model.lora_params.items()}  # θ₀: the fresh adapter (B = 0)
    rejected_before = _metric("livelora_gate_candidates_total", endpoint=ep, outcome="rejected")
    scheduler = BatchScheduler(config)
    batch = _terse(ep)
    reporter.training(batch, scheduler)
    v1 = trainer.train(batch)
    reporter.outcome(batch, v1, scheduler)

    g = v1.gate
    assert g["against"] == "base" and g["continued_from"] is None and g["verdicts"][ep]["passed"]
    assert g["step_scale"] == 0.5
    full, half = g["line_search"]
    assert (full["step_scale"], full["passed"], full["failed"], full["skipped"]) == (1.0, False, ["length_ratio"], [])
    assert (half["step_scale"], half["passed"], half["failed"]) == (0.5, True, [])
    by_name = {c["name"]: c for c in g["checks"]}
    assert 0.5 <= by_name["length_ratio"]["value"] < 1.0 and by_name["length_ratio"]["bound"] == 0.5
    assert not any(c["skipped"] for c in g["checks"]) and set(by_name) == set(CHECKS)
    # the gate measured the probes, then the replies, for each candidate (no held-out examples: no signal pass; the
    # free-form check is off by default)
    assert checks == [
        ("probes", 1.0),
        ("replies", 1.0),
        ("verdict", 1.0),
        ("probes", 0.5),
        ("replies", 0.5),
        ("verdict", 0.5),
    ]

    # the weights: exactly θ₀ + ½·(θ₁ − θ₀) on every LoRA factor, in memory and in the version written
    assert set(seen) == {1.0, 0.5}
    want = candidate_weights(start, seen[1.0], 0.5)
    saved = load_file(str(AdapterStore(home).version_dir(ep, 1) / WEIGHTS_FILE))
    assert set(saved) == set(want)
    assert all(torch.equal(seen[0.5][k], want[k]) and torch.equal(saved[k], want[k]) for k in want)
    assert all(torch.equal(model.lora_params[k].detach(), want[k]) for k in want)
    b_key = next(k for k in want if "lora_B" in k)
    assert not torch.equal(seen[1.0][b_key], want[b_key]) and torch.equal(want[b_key], 0.5 * seen[1.0][b_key])
    # AdamW keeps the step's moments (the gradient was measured at θ₀; only the move was shortened)
    state = model.optimizer.state_dict()["state"]
    assert model.step == 1 and v1.step == 1 and v1.has_optimizer
    assert all(float(s["step"]) == 1.0 for s in state.values())  # (A's gradient is 0 while B = 0: B's moments)
    assert sum(float(s["exp_avg"].abs().sum() > 0) for s in state.values()) == len(state) // 2
    assert v1.metrics["update_norm:mean"] > 0

    # where α shows: the history, `adapters show`, the learning status, Prometheus
    [line] = [h for h in EndpointStore(home).history(ep) if h.action == "gate"]
    assert line.reason == "passed" and line.details["step_scale"] == 0.5 and len(line.details["line_search"]) == 2
    cli = CliRunner().invoke(app, ["adapters", "show", f"{ep}@1", "--home", str(home)])
    assert cli.exit_code == 0, cli.output
    shown = " ".join(cli.output.replace("│", " ").split())  # the table's cells wrap
    assert "0.5 of the trained step (line search: 1 failed length_ratio, 0.5 passed)" in shown, shown
    st = LearningStatus.model_validate_json(client.get(keys.learning(ep)))
    assert st.stage == "published" and st.version == f"{ep}@1" and st.step_scale == 0.5
    assert st.last.step_scale == 0.5 and "step scaled by 0.5" in st.summary()
    assert [(m.check, m.step_scale) for m in st.stages if m.stage == "gate"] == checks
    assert _metric("livelora_live_step_scale", endpoint=ep) == 0.5
    assert _metric("livelora_gate_candidates_total", endpoint=ep, outcome="rejected") == rejected_before + 1

    # the loop keeps learning: a step whose full size fails a cheap check (the probes, against the base model)
    # is measured no further; whatever α passes is published from @1, else training continues from @1
    EndpointStore(home).set_gate(ep, t.model_copy(update={"probe_base_margin": 0.05}), tenant="default", who="test")
    assert "measuring base model: probes for the gate" in details  # the current version of a first step
    checks.clear()
    details.clear()
    v2 = trainer.train(wrong_answers_batch(ep))
    assert not [d for d in details if d.startswith("measuring")]  # @1 was measured as a candidate: reused
    g2 = v2.gate
    assert v2.parent == 1 and g2["against"] == f"{ep}@1"
    first = g2["line_search"][0]
    assert (first["step_scale"], first["failed"], first["skipped"]) == (
        1.0,
        ["probes_base"],
        ["degenerate", "length_ratio"],
    )
    assert checks[:2] == [("probes", 1.0), ("verdict", 1.0)]  # the replies were never generated
    for tried in g2["line_search"]:
        assert tried["passed"] or tried["failed"]
    last = g2["line_search"][-1]
    if last["passed"]:
        assert g2["step_scale"] == last["step_scale"] < 1 and g2["continued_from"] is None
        parent = 2
    else:
        assert [x["step_scale"] for x in g2["line_search"]] == [1.0, 0.5, 0.25, 0.125]
        assert g2["step_scale"] == 1.0 and g2["continued_from"] == f"{ep}@1"  # the full step, written rejected
        skipped = {c["name"] for c in g2["checks"] if c["skipped"]}
        assert skipped == {"degenerate", "length_ratio"}
        parent = 1
    EndpointStore(home).set_gate(ep, t, tenant="default", who="test")
    v3 = trainer.train(rating_batch(trainer, ep))  # normal ratings: a step that passes, at some α
    g3 = v3.gate
    assert v3.parent == parent and g3["continued_from"] is None, g3["line_search"]
    assert g3["line_search"][-1] == {**g3["line_search"][-1], "step_scale": g3["step_scale"], "passed": True}
    assert _metric("livelora_live_step_scale", endpoint=ep) == g3["step_scale"]
