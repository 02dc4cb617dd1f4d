"""The evaluation gate (docs/rails.md): thresholds and verdicts, per-endpoint settings through the
admin service, and on the real SmolLM2 model a version trained to be much worse on the probes is rejected
(manifest, history, never loaded nor served, training continues from the last passing version) while normal
KTO versions pass and are served by the real transformers engine's registry."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from harness.gate import rating_batch, wrong_answers_batch
from safetensors.torch import load_file
from typer.testing import CliRunner

from livelora.adapters.endpoints import EndpointStore
from livelora.adapters.store import WEIGHTS_FILE, AdapterStore
from livelora.clients.errors import BadRequestError
from livelora.clients.types.signals import RatingEvent
from livelora.core.rails import GateThresholds, bound_of, gate_allows, judge
from livelora.trainer.gate import held_out
from livelora.trainer.gate_measure import Measurement, compare, load_probes, reply_degenerate


def test_judge_applies_each_threshold():
    t = GateThresholds()
    ok = {
        "probes": {"value": 0.80, "current": 0.83},
        "kl_current": {"value": 0.02},
        "kl_base": {"value": 0.2},
        "degenerate": {"value": 0.0},
        "length_ratio": {"value": 0.95},
        "signal": {"value": None, "current": None},
    }
    assert judge(ok, t).passed and judge(ok, t).failed == []
    bad = {
        **ok,
        "probes": {"value": 0.50, "current": 0.83},
        "kl_current": {"value": 0.3},
        "degenerate": {"value": 0.75},
        "length_ratio": {"value": 0.4},
        "signal": {"value": -0.5, "current": 0.1},
    }
    v = judge(bad, t)
    assert not v.passed and v.failed == ["probes", "kl_current", "degenerate", "length_ratio", "signal"]
    loose = GateThresholds(
        probe_margin=0.5, max_kl_current=1.0, max_degenerate=1.0, min_length_ratio=0.1, signal_tolerance=1.0
    )
    assert judge(bad, loose).passed
    assert judge(bad, GateThresholds(enabled=False)).passed  # measured, recorded, not enforced
    gate = {"against": "base", "verdicts": {"*": {"passed": True}, "strict": {"passed": False, "failed": ["x"]}}}
    assert gate_allows(gate, "other") and not gate_allows(gate, "strict") and gate_allows(None, "strict")


def test_probes_base_bounds_the_loss_against_the_base_model():
    """Each step within ``probe_margin`` of the current version, yet the chain below the base model: the
    ``probes_base`` check (``probe_base_margin`` 0.05 against the base model) rejects it."""
    t = GateThresholds()
    base, current = 20 / 24, 19 / 24  # SmolLM2 gets 20 of the 24 probes; the current version lost one
    rest = {
        "kl_current": {"value": 0.02},
        "kl_base": {"value": 0.2},
        "degenerate": {"value": 0.0},
        "length_ratio": {"value": 0.95},
    }

    def checks(new: float, base_acc: float | None = base) -> dict:
        return {
            "probes": {"value": new, "current": current},
            "probes_base": {"value": new, "current": current, "base": base_acc},
            **rest,
        }

    lost_two = judge(checks(18 / 24), t)  # 0.75 >= 0.7917 - 0.10 (probes), 0.75 < 0.8333 - 0.05
    assert not lost_two.passed and lost_two.failed == ["probes_base"]
    assert bound_of("probes", current, t) == pytest.approx(0.691667, abs=1e-6)
    assert bound_of("probes_base", current, t, base) == pytest.approx(0.783333, abs=1e-6)
    assert bound_of("probes_base", current, t) is None  # no base measurement: no bound, the check passes
    assert judge(checks(18 / 24, None), t).passed
    assert judge(checks(19 / 24), t).passed  # one probe lost against the base model: allowed
    assert judge(checks(base - 0.05), t).passed  # exactly at the bound
    assert judge(checks(base - 0.05 - 1e-6), t).failed == ["probes_base"]
    one_probe = GateThresholds(probe_base_margin=1 / 24)  # 20/24 − 1/24 is 19/24 up to rounding
    assert judge(checks(19 / 24), one_probe).passed and not judge(checks(18 / 24), one_probe).passed
    assert judge(checks(18 / 24), GateThresholds(probe_base_margin=0.1)).passed
    disabled = judge(checks(18 / 24), GateThresholds(enabled=False))
    assert disabled.passed and disabled.failed == ["probes_base"]  # measured and named, not enforced
    # a lineage already below the bound (trained before the check, or a tightened margin) is not stalled: its
    # next version may not lose more than it has (bound min(base − margin, current)) and may climb back
    below = 17 / 24
    stalled = {
        "probes": {"value": below, "current": below},
        "probes_base": {"value": below, "current": below, "base": base},
        **rest,
    }
    assert bound_of("probes_base", below, t, base) == pytest.approx(below)
    assert judge(stalled, t).passed
    stalled["probes_base"]["value"] = stalled["probes"]["value"] = 16 / 24
    assert judge(stalled, t).failed == ["probes_base"]


def test_compare_reports_both_probe_checks():
    """compare() on three measurements: ``probes`` against the current version, ``probes_base`` against the base."""
    torch.manual_seed(0)

    def measurement(right: int, logits_M_V: torch.Tensor) -> Measurement:
        return Measurement(
            [True] * right + [False] * (24 - right), torch.log_softmax(logits_M_V, -1), 0.0, 20.0, ["a reply"] * 4
        )

    logits = torch.randn(30, 50)
    base, current = measurement(20, logits), measurement(19, logits + 0.1 * torch.randn(30, 50))
    new = measurement(18, logits + 0.2 * torch.randn(30, 50))
    values = compare(new, current, base, [], 4)
    assert values["probes"] == {"value": 0.75, "current": 19 / 24}
    assert values["probes_base"] == {"value": 0.75, "current": 19 / 24, "base": 20 / 24}
    assert values["kl_base"]["value"] > 0 and values["length_ratio"]["value"] == 1.0
    v = judge(values, GateThresholds())
    assert v.failed == ["probes_base"]


def test_probe_file_and_degeneracy_heuristics():
    probes = load_probes()
    assert len(probes) == 24 and {p.kind for p in probes} == {"fact", "arithmetic", "format"}
    paris = next(p for p in probes if p.id == "fact-capital-france")
    assert paris.right(" Paris") and paris.right(" Par") and not paris.right(" London") and not paris.right(" ")
    assert reply_degenerate("The answer to this question.", 7)
    assert reply_degenerate("", 0)
    assert reply_degenerate("banana banana banana banana banana banana banana", 7)
    assert not reply_degenerate("The sky is blue because air scatters short wavelengths.", 12)
    picked = [held_out(f"feedback-{i}", 10) for i in range(2000)]
    assert 150 < sum(picked) < 250 and not any(held_out("x", 0) for _ in range(3))


def test_endpoint_thresholds_are_validated_stored_and_audited(tmp_path):
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    admin = StoreAdmin(tmp_path, tenant=None)
    admin.create_endpoint("ep", "lin", who="t")
    with pytest.raises(BadRequestError) as exc:
        admin.set_gate("ep", {"probe_margin": 2.0}, who="t")
    assert exc.value.param == "thresholds.probe_margin"
    with pytest.raises(BadRequestError):
        admin.set_gate("ep", {"no_such_check": 1}, who="t")
    assert admin.get_endpoint("ep")["gate"] == GateThresholds().model_dump()  # bad input changed nothing
    entry = admin.set_gate("ep", {"probe_margin": 0.05, "max_kl_current": 0.3}, who="t", reason="strict")
    assert entry.action == "configure" and entry.reason == "strict"
    shown = admin.get_endpoint("ep")["gate"]
    assert shown["probe_margin"] == 0.05 and shown["max_kl_current"] == 0.3 and shown["max_degenerate"] == 0.25
    assert EndpointStore(tmp_path).get("ep").thresholds.probe_margin == 0.05
    assert shown["probe_base_margin"] == 0.05  # not set: the default
    with pytest.raises(BadRequestError) as exc:
        admin.set_gate("ep", {"probe_base_margin": -0.1}, who="t")
    assert exc.value.param == "thresholds.probe_base_margin"
    admin.set_gate("ep", None, who="t")
    assert admin.get_endpoint("ep")["gate"]["probe_margin"] == GateThresholds().probe_margin
    assert [h.action for h in admin.history("ep")] == ["create", "configure", "configure"]

    # the CLI on the store: --set probe_base_margin keeps the other thresholds, the table lists it
    from livelora.cli.main import app

    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "endpoints",
            "gate",
            "ep",
            "--set",
            "probe_base_margin=0.0834",
            "--set",
            "probe_margin=0.2",
            "--reason",
            "two probes",
            "--home",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "probe_base_margin" in res.output and "0.0834" in res.output
    stored = EndpointStore(tmp_path).get("ep").thresholds
    assert stored.probe_base_margin == 0.0834 and stored.probe_margin == 0.2 and stored.max_kl_current == 0.08
    bad = runner.invoke(app, ["endpoints", "gate", "ep", "--set", "probe_base_margin=1.5", "--home", str(tmp_path)])
    assert bad.exit_code != 0 and EndpointStore(tmp_path).get("ep").thresholds.probe_base_margin == 0.0834
    assert admin.history("ep")[-1].reason == "two probes"


# ---------------------------------------------------------------------------------- the real model


@pytest.mark.timeout(1800)
def test_worse_version_is_rejected_never_served_and_training_continues_from_the_last_pass(base_ref, tmp_path):
    from livelora.gateway.engines import create_engine
    from livelora.gateway.services.live.registry import AdapterRegistry
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.settings import GateSection, TrainingSection

    home = tmp_path
    ep = lineage = "gated"
    EndpointStore(home).create(ep, lineage, tenant="default", who="test")
    # on despite conftest's env; no line search (floor 1): a rejected step is held back whole, as it was before
    gate = GateSection(gate_enabled=True, gate_holdout_every=0, gate_gen_tokens=12, gate_min_step_scale=1.0)
    trainer = OnlineTrainer(base_ref, home, TrainingSection(sft_lr=3e-3), gate=gate)

    v1 = trainer.train(rating_batch(trainer, ep))  # a normal live-loop step
    g1 = v1.gate
    assert g1["against"] == "base" and g1["continued_from"] is None and g1["verdicts"][ep]["passed"]
    checks1 = {c["name"]: c for c in g1["checks"]}
    assert checks1["kl_current"]["value"] < GateThresholds().max_kl_current
    base_acc = g1["measures"]["probe_accuracy_base"]
    assert base_acc >= 0.75  # the base model gets most probes right
    assert checks1["probes_base"]["passed"] and checks1["probes_base"]["value"] == g1["measures"]["probe_accuracy"]
    assert checks1["probes_base"]["bound"] == pytest.approx(base_acc - GateThresholds().probe_base_margin)

    # every check but probes_base loosened for this endpoint: the rejection below is probes_base's alone, and
    # training must continue from the version compared with, as after any other check's rejection
    loose = GateThresholds(
        probe_margin=1.0,
        max_kl_current=100.0,
        max_kl_base=100.0,
        max_degenerate=1.0,
        min_length_ratio=0.0,
        signal_tolerance=100.0,
    )
    EndpointStore(home).set_gate(ep, loose, tenant="default", who="test", reason="probes_base only")
    v2 = trainer.train(wrong_answers_batch(ep))  # trained to be much worse on the probes
    g2 = v2.gate
    assert v2.parent == 1 and g2["against"] == f"{lineage}@1"
    assert not g2["verdicts"][ep]["passed"] and g2["verdicts"][ep]["failed"] == ["probes_base"]
    assert "probes" in g2["verdicts"]["*"]["failed"] and "probes_base" in g2["verdicts"]["*"]["failed"]
    checks2 = {c["name"]: c for c in g2["checks"]}
    assert checks2["probes"]["value"] < checks2["probes"]["current"] - GateThresholds().probe_margin
    assert checks2["probes"]["passed"] and not checks2["probes_base"]["passed"]  # under the endpoint's thresholds
    assert (
        checks2["probes_base"]["value"]
        < checks2["probes_base"]["bound"]
        == pytest.approx(base_acc - loose.probe_base_margin)
    )
    assert g2["continued_from"] == f"{lineage}@1"
    # training continues from version 1: the in-memory model holds version 1's weights again
    model = trainer.model_for(lineage)
    saved = load_file(str(AdapterStore(home).version_dir(lineage, 1) / WEIGHTS_FILE))
    assert all(torch.equal(model.lora_params[k].detach(), saved[k]) for k in saved)
    # ... with version 1's second moments and step count, and no first moment: the held-back direction is not
    # stepped again (docs/rails.md, "After a hold-back"); a restarted trainer resumes the same way
    v1_opt = torch.load(AdapterStore(home).version_dir(lineage, 1) / "optimizer.pt", weights_only=True)["state"]
    for restored in (model, OnlineTrainer(base_ref, home, TrainingSection(sft_lr=3e-3), gate=gate).model_for(ep)):
        state = restored.optimizer.state_dict()["state"]
        assert restored.step == 1 and state.keys() == v1_opt.keys()
        assert all(float(s["step"]) == 1.0 and not s["exp_avg"].any() for s in state.values())
        assert all(torch.equal(s["exp_avg_sq"], v1_opt[i]["exp_avg_sq"]) for i, s in state.items())
    assert any(s["exp_avg"].any() for s in v1_opt.values())  # version 1 itself had a first moment
    # so the next step's first moment is (1 − β₁)·g of its own batch alone (g clipped to the global norm 1)
    batch3 = rating_batch(trainer, ep)
    data, loss_fn, cfg, _ = trainer.datums(batch3)
    model.forward_backward(data, loss_fn, cfg, loss_positions_only=True)
    grads = [p.grad.clone() for p in model.lora_params.values()]
    model.zero_grad()
    clip = min(1.0, 1.0 / (float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) + 1e-6))
    v3 = trainer.train(batch3)
    assert v3.parent == 1 and v3.gate["continued_from"] is None
    state = model.optimizer.state_dict()["state"]
    assert all(float(s["step"]) == 2.0 for s in state.values())
    for i, g in enumerate(grads):
        assert torch.allclose(state[i]["exp_avg"], 0.1 * clip * g, rtol=1e-4, atol=1e-10), i
    assert {c["name"]: c for c in v3.gate["checks"]}["probes_base"]["passed"]

    history = [h for h in EndpointStore(home).history(ep) if h.action == "gate"]
    assert [(h.to, h.reason) for h in history] == [
        (f"{lineage}@1", "passed"),
        (f"{lineage}@2", "rejected: probes_base"),
        (f"{lineage}@3", "passed"),
    ]
    assert history[1].details["checks"]["probes"]["value"] == checks2["probes"]["value"]
    assert history[1].details["checks"]["probes_base"] == {
        k: checks2["probes_base"][k] for k in ("value", "current", "bound")
    }

    # what the admin API (GET /admin/adapters/{name}) and the CLI show
    from livelora.cli.main import app
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    shown2 = {
        c["name"]: c for c in StoreAdmin(home, tenant=None).versions.show_adapter(f"{lineage}@2")["gate"]["checks"]
    }
    assert shown2["probes_base"] == checks2["probes_base"]
    cli = CliRunner().invoke(app, ["adapters", "show", f"{lineage}@2", "--home", str(home)])
    assert cli.exit_code == 0, cli.output
    assert "probes_base" in cli.output and "FAILED" in cli.output
    shown = " ".join(cli.output.split())
    assert "base model 0.8333" in shown  # the base accuracy its bound comes from (20 of 24 probes)
    first = CliRunner().invoke(app, ["adapters", "show", f"{lineage}@1", "--home", str(home)])
    shown1, metrics1 = (
        " ".join(first.output.split()),
        StoreAdmin(home, tenant=None).versions.show_adapter(f"{lineage}@1"),
    )
    assert "│ parent │ none: trained from the base model │" in shown1 and "None" not in shown1
    assert metrics1["metrics"] and all(f"│ {k} │ {v:.4g} │" in shown1 for k, v in metrics1["metrics"].items())
    assert "│ signal │ not measured (passes) │" in shown  # no held-out ratings here: the check did not count

    # the gateway never serves version 2: catch-up skips it, its notice does not even load it
    loop = asyncio.new_event_loop()
    engine = create_engine("transformers", model=base_ref.name, max_batch_size=2)
    loop.run_until_complete(engine.start())
    try:
        reg = AdapterRegistry(engine, home, "smollm2-135m-instruct", resync_s=0)
        store = AdapterStore(home)
        import shutil

        shutil.move(str(store.version_dir(lineage, 3)), str(home / "v3-aside"))  # only versions 1 and 2 exist
        loop.run_until_complete(reg.sync_from_store())
        assert reg.current[ep] == f"{lineage}@1"
        notice = {"type": "version_published", "lineage": lineage, "version": 2, "name": f"{lineage}@2"}
        loop.run_until_complete(reg.handle_notice(notice))
        assert reg.current[ep] == f"{lineage}@1" and f"{lineage}@2" not in engine.loaded_adapters()
        lease = reg.acquire(ep)
        assert lease.adapter == f"{lineage}@1"
        lease.release()
        shutil.move(str(home / "v3-aside"), str(store.version_dir(lineage, 3)))
        loop.run_until_complete(reg.sync_from_store())
        assert reg.current[ep] == f"{lineage}@3"  # the next passing version is served
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    shown = json.loads((AdapterStore(home).version_dir(lineage, 2) / "manifest.json").read_text())["gate"]
    assert shown == g2


def test_held_out_examples_are_read_back_after_a_restart(tokenizer, tmp_path):
    import json as _json

    from livelora.trainer.dataset import DatasetOfRecord
    from livelora.trainer.gate import EvaluationGate

    evs = [
        RatingEvent(
            id=f"feedback-{i}",
            endpoint="gated",
            created=1,
            completion_id=f"c{i}",
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[4, 5 + i],
            rating=i % 2 == 0,
            rating_key=f"c{i}:/u",
        )
        for i in range(40)
    ]
    DatasetOfRecord(tmp_path).append(
        "2026-12-01",
        [
            (e.id, {"stream_id": f"{i}-0", "received": 1, "event": _json.loads(e.model_dump_json())})
            for i, e in enumerate(evs)
        ],
    )
    picked = [e for e in evs if held_out(e.id, 4)]
    assert 3 <= len(picked) < 40
    gate = EvaluationGate(tokenizer, tmp_path, None, holdout_every=4, heldout_max=100)
    items = gate.items("gated")  # a fresh process: read back from the dataset
    assert [i.key for i in items] == [e.id for e in picked]
    assert [i.sign for i in items] == [1 if e.rating else -1 for e in picked]
    assert items[0].completion[:2] == picked[0].completion_token_ids
    assert gate.hold_out("gated", picked[0]) and len(gate.items("gated")) == len(picked)  # no duplicate
    assert gate.items("other") == []
