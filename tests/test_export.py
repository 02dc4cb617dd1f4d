"""Merged export: base + adapter written as a plain HF model whose logits match the adapter within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch

from livelora.adapters.export import export_merged
from livelora.adapters.store import AdapterStore
from livelora.clients.errors import ConflictError
from livelora.clients.recipes.datums import supervised_datum
from livelora.clients.recipes.sdk import Sdk
from livelora.clients.types import AdamParams, LoraConfig
from livelora.trainer.model import TrainingModel


def test_merged_export_matches_base_plus_adapter_and_unties_embeddings(base_ref, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from livelora.core.base_models import load_model

    store = AdapterStore(tmp_path / "home")
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=11))  # all linear, lm_head included
    ids = tokenizer("Merging must not change what the model says.")["input_ids"]
    datum = supervised_datum(Sdk.load("livelora"), ids, [1.0] * len(ids))
    for _ in range(2):
        m.forward_backward([datum])
        m.optim_step(AdamParams(learning_rate=5e-3))
    manifest = m.save_weights(store, "exported")
    out = export_merged(store, "exported", manifest.version, base_ref, tmp_path / "merged")

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((out / "livelora_export.json").read_text())["adapter"] == "exported@1"

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = m.peft_model(input_ids=x).logits
        got = merged(input_ids=x).logits
        with m.peft_model.disable_adapter():
            base_logits = m.peft_model(input_ids=x).logits
    assert float((got - expected).abs().max()) < 1e-4
    assert float((expected - base_logits).abs().max()) > 1e-2  # the adapter is not a no-op
    base = load_model(base_ref)
    # the input embedding is the base one; only the output projection carries the LoRA delta
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert not torch.equal(merged.get_output_embeddings().weight, base.get_output_embeddings().weight)

    with pytest.raises(ConflictError, match="already exists"):
        export_merged(store, "exported", manifest.version, base_ref, out)
