"""Adapter store: immutable numbered versions, crash-safe saves, PEFT-loadable files, bit-exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from livelora.adapters.store import WEIGHTS_FILE, AdapterStore, parse_version_name, validate_lineage
from livelora.clients.errors import BadRequestError, NotFoundError
from livelora.clients.types import AdamParams, Datum, LoraConfig, ModelInput, TensorData
from livelora.trainer.model import TrainingModel


def fake_write(payload: bytes = b"weights"):
    def write(tmp: Path) -> None:
        (tmp / WEIGHTS_FILE).write_bytes(payload)
        (tmp / "adapter_config.json").write_text("{}")

    return write


def visible(store: AdapterStore, lineage: str) -> list[int]:
    return [m.version for m in store.list(lineage)]


def test_versions_are_numbered_immutable_and_never_reused(tmp_path):
    store = AdapterStore(tmp_path)
    a = store.write_version(
        "policy", fake_write(b"a"), base_model="m", step=1, metrics={"loss:sum": 2.5}, data_counts={"datums": 4}
    )
    b = store.write_version("policy", fake_write(b"b"), base_model="m", parent=1, step=2)
    assert (a.version, a.name, b.version, b.parent) == (1, "policy@1", 2, 1)
    assert store.latest("policy").version == 2 and store.resolve("policy@1") == a
    assert store.get("policy", 1).metrics == {"loss:sum": 2.5} and store.get("policy", 1).data_counts == {"datums": 4}
    assert store.verify("policy", 1) and store.verify("policy", 2)
    (store.version_dir("policy", 1) / WEIGHTS_FILE).write_bytes(b"tampered")
    assert not store.verify("policy", 1)
    store.delete("policy", 2)
    assert visible(store, "policy") == [1]
    c = store.write_version("policy", fake_write(b"c"), base_model="m")
    assert c.version == 3  # the deleted number 2 is not reused
    with pytest.raises(NotFoundError):
        store.get("policy", 2)
    with pytest.raises(NotFoundError):
        store.latest("nothing-here")
    assert store.lineages() == ["policy"]


@pytest.mark.parametrize("name", ["", "..", ".", "a/b", "../etc", "Policy", "-x", "x" * 65, "a b", "a\x00"])
def test_bad_lineage_names_are_refused(tmp_path, name):
    with pytest.raises(BadRequestError, match="lineage"):
        AdapterStore(tmp_path).write_version(name, fake_write(), base_model="m")
    assert not (tmp_path / "adapters").exists() or not any((tmp_path / "adapters").iterdir())


def test_version_names_parse():
    assert parse_version_name("policy.v2@17") == ("policy.v2", 17)
    assert validate_lineage("a0._-z") == "a0._-z"
    for bad in ("policy", "policy@0", "policy@x", "@3", "../x@1"):
        with pytest.raises(BadRequestError):
            parse_version_name(bad)


def test_a_save_failing_midway_leaves_nothing_visible_and_burns_its_number(tmp_path):
    store = AdapterStore(tmp_path)
    store.write_version("policy", fake_write(b"one"), base_model="m")

    def crashing(tmp: Path) -> None:
        (tmp / WEIGHTS_FILE).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.write_version("policy", crashing, base_model="m")
    assert visible(store, "policy") == [1]
    assert sorted(p.name for p in store.lineage_dir("policy").iterdir() if not p.name.startswith(".")) == ["1"]
    assert not [p for p in store.lineage_dir("policy").iterdir() if p.name.endswith(".tmp")]
    assert store.verify("policy", 1)
    assert store.write_version("policy", fake_write(b"three"), base_model="m").version == 3


def test_a_process_killed_during_save_leaves_earlier_versions_intact(tmp_path):
    store = AdapterStore(tmp_path)
    store.write_version("policy", fake_write(b"one"), base_model="m")
    marker = tmp_path / "started"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from livelora.adapters.store import AdapterStore
        def write(tmp):
            (tmp / "adapter_model.safetensors").write_bytes(b"partial")
            Path({str(marker)!r}).write_text("x")
            time.sleep(60)
        AdapterStore({str(tmp_path)!r}).write_version("policy", write, base_model="m")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert time.time() < deadline and proc.poll() is None, "child never reached the write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert visible(store, "policy") == [1]
    assert store.verify("policy", 1)
    assert store.write_version("policy", fake_write(b"three"), base_model="m").version == 3


# ---------------------------------------------------------------------------------------------- with the model
def sft_batch(tokenizer) -> list[Datum]:
    out = []
    for s in ["Livelora keeps learning while it serves.", "Adapters are saved as immutable versions."]:
        t = tokenizer(s)["input_ids"]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData.from_list(t[1:], "int64"),
                    "weights": TensorData.from_list([1.0] * (len(t) - 1), "float32"),
                },
            )
        )
    return out


@pytest.fixture(scope="module")
def trained(base_ref, tokenizer, tmp_path_factory):
    """A model after 2 SFT steps, its save_state version, then one more step (3 steps uninterrupted)."""
    store = AdapterStore(tmp_path_factory.mktemp("store"))
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=7, alpha=16))
    data = sft_batch(tokenizer)
    adam = AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=5.0)
    for _ in range(2):
        m.forward_backward(data)
        m.optim_step(adam)
    saved_logprobs = [o["logprobs"].to_torch() for o in m.forward(data).loss_fn_outputs]
    manifest = m.save_state(store, "resume-test", metrics={"loss:sum": 1.0})
    m.forward_backward(data)
    m.optim_step(adam)
    return {
        "store": store,
        "model": m,
        "manifest": manifest,
        "data": data,
        "adam": adam,
        "saved_logprobs": saved_logprobs,
        "final": {k: p.detach().clone() for k, p in m.lora_params.items()},
    }


def test_saved_adapter_is_standard_peft_and_gives_the_same_logprobs(trained, base_ref):
    from peft import PeftModel
    from safetensors.torch import load_file

    from livelora.core.base_models import load_model

    store, manifest = trained["store"], trained["manifest"]
    vdir = store.version_dir("resume-test", manifest.version)
    assert manifest.name == "resume-test@1" and manifest.step == 2 and manifest.has_optimizer
    assert sorted(os.listdir(vdir)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
        "optimizer.pt",
        "trainer_state.json",
    ]
    keys = list(load_file(str(vdir / WEIGHTS_FILE)))
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert not any(".default." in k for k in keys)
    cfg = json.loads((vdir / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16
    assert cfg["base_model_name_or_path"] == base_ref.name
    peft_model = PeftModel.from_pretrained(load_model(base_ref), str(vdir))
    for d, expected in zip(trained["data"], trained["saved_logprobs"]):
        ids = torch.tensor([d.model_input.to_ints()])
        with torch.no_grad():
            logits = peft_model(input_ids=ids).logits[0]
        lp = torch.log_softmax(logits, -1).gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        assert torch.allclose(lp, expected, atol=1e-4)  # batched+padded vs single sequence


def test_resume_with_optimizer_is_bit_identical_and_without_it_is_a_cold_start(trained, base_ref):
    store, data, adam = trained["store"], trained["data"], trained["adam"]
    fresh = TrainingModel.from_version(base_ref, store, "resume-test", 1, with_optimizer=True)
    assert fresh.step == 2 and len(fresh.optimizer.state) == len(fresh.lora_params)
    fresh.forward_backward(data)
    fresh.optim_step(adam)
    for k, p in fresh.lora_params.items():
        assert torch.equal(p.detach(), trained["final"][k]), k
    assert fresh.step == 3
    # Weights-only load: fresh optimizer (no Adam moments), so the next step differs.
    fresh.load_state(store, "resume-test", 1, with_optimizer=False)
    assert len(fresh.optimizer.state) == 0 and not fresh.has_gradients()
    fresh.forward_backward(data)
    fresh.optim_step(adam)
    assert any(not torch.equal(p.detach(), trained["final"][k]) for k, p in fresh.lora_params.items())
    # A later save continues the lineage with a new number and records its parent.
    again = fresh.save_weights(store, "resume-test")
    assert (again.version, again.parent, again.has_optimizer) == (2, 1, False)
    with pytest.raises(NotFoundError, match="without optimizer"):
        fresh.load_state(store, "resume-test", 2, with_optimizer=True)


def test_loading_an_adapter_of_another_shape_is_refused_and_changes_nothing(trained, base_ref):
    other = TrainingModel(base_ref, LoraConfig(rank=2, seed=1, train_unembed=False))
    before = {k: p.detach().clone() for k, p in other.lora_params.items()}
    with pytest.raises(BadRequestError, match="rank, alpha, targets"):
        other.load_state(trained["store"], "resume-test", 1, with_optimizer=True)
    assert all(torch.equal(p.detach(), before[k]) for k, p in other.lora_params.items()) and other.step == 0
