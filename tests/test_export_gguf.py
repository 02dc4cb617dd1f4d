"""GGUF export: a version as a llama.cpp LoRA adapter, checked against the built-in model's own GGUF file (the
rotary row order of ``q``/``k``) and, where llama-cpp-python is installed, by llama.cpp itself."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from harness.native import in_child, llama_cpp_logits

from livelora.adapters.gguf_export import GGUF_FILE, export_gguf, gguf_lora_tensors, rope_permute
from livelora.adapters.store import CONFIG_FILE, WEIGHTS_FILE, AdapterStore
from livelora.clients.errors import BadRequestError, ConflictError
from livelora.clients.recipes.datums import supervised_datum
from livelora.clients.recipes.sdk import Sdk
from livelora.clients.types import AdamParams, LoraConfig
from livelora.core.base_models import DEFAULT_MODEL, gguf_location
from livelora.trainer.model import TrainingModel

TEXT = "A llama.cpp user must get what the gateway serves."


@pytest.fixture(scope="module")
def exported(base_ref, tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    (tmp / "home").mkdir()
    (tmp / "home" / "models").symlink_to(Path(base_ref.path).parent)  # the converted base, not a second conversion
    store = AdapterStore(tmp / "home")
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=5, train_unembed=False))  # attention and MLP
    ids = tokenizer(TEXT)["input_ids"]
    for _ in range(3):
        m.forward_backward([supervised_datum(Sdk.load("livelora"), ids, [1.0] * len(ids))])
        m.optim_step(AdamParams(learning_rate=1e-2))
    version = m.save_weights(store, "ggufed").version
    return m, store, version, export_gguf(store, "ggufed", version, base_ref, tmp / "out"), base_ref


def test_the_adapter_file_applied_to_the_base_gguf_equals_the_merged_weights(exported):
    """Layer by layer: ``W_gguf + lora_b · lora_a`` (what llama.cpp computes) equals the peft-merged weight in the
    GGUF row order, with ``W_gguf`` dequantized from the built-in model's file, not derived from ours."""
    import gguf

    m, _, _, out, _ = exported
    adapter = gguf.GGUFReader(out / GGUF_FILE)
    fields = {f.name: f for f in adapter.fields.values()}
    assert fields["general.type"].contents() == "adapter" and fields["adapter.type"].contents() == "lora"
    assert fields["general.architecture"].contents() == "llama" and fields["adapter.lora.alpha"].contents() == 0.0
    lora = {t.name: torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist()))) for t in adapter.tensors}
    assert len(lora) == 30 * 7 * 2  # every attention and MLP projection of the 30 layers, a and b
    base = {t.name: t for t in gguf.GGUFReader(gguf_location(DEFAULT_MODEL)).tensors}
    cfg = m.peft_model.config
    layers = m.peft_model.base_model.model.model.layers
    for i in (0, 29):
        for name, module, n_head in (
            ("attn_q", layers[i].self_attn.q_proj, cfg.num_attention_heads),
            ("attn_k", layers[i].self_attn.k_proj, cfg.num_key_value_heads),
            ("ffn_down", layers[i].mlp.down_proj, None),
        ):
            t = base[f"blk.{i}.{name}.weight"]
            w_gguf = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
            w_hf = module.base_layer.weight.detach()
            delta = module.get_delta_weight("default").detach()
            order = (lambda w, n=n_head: rope_permute(w, n)) if n_head else (lambda w: w)
            assert torch.allclose(w_gguf, order(w_hf), atol=1e-6), name  # the row order is GGUF's
            applied = w_gguf + lora[f"blk.{i}.{name}.weight.lora_b"] @ lora[f"blk.{i}.{name}.weight.lora_a"]
            assert torch.allclose(applied, order(w_hf + delta), atol=1e-6), name
            assert delta.abs().max() > 1e-4  # trained: the check is not on zeros


def test_refusals(exported, base_ref, tmp_path):
    from livelora.gateway.services.tenants.store_admin import StoreAdmin

    _, store, version, out, _ = exported
    versions = StoreAdmin(store.home, tenant=None).versions  # what the CLI and POST /admin/.../export call
    assert (versions.export(f"ggufed@{version}", "gguf") / GGUF_FILE).read_bytes() == (out / GGUF_FILE).read_bytes()
    with pytest.raises(BadRequestError, match="'peft', 'merged' or 'gguf'"):
        versions.export(f"ggufed@{version}", "onnx")
    with pytest.raises(ConflictError, match="already exists"):
        export_gguf(store, "ggufed", version, base_ref, out)
    # adapters llama.cpp cannot apply: the stored version's files, changed one way each
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    src, config = store.version_dir("ggufed", version), AutoConfig.from_pretrained(base_ref.path)
    weights, cfg = load_file(str(src / WEIGHTS_FILE)), json.loads((src / CONFIG_FILE).read_text())
    lm_head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576)}  # train_unembed: the tied lm_head
    for case, tensors, changed, match in (
        ("head", {**weights, **lm_head}, {}, "attention and MLP projections only"),
        ("dora", weights, {"use_dora": True}, "use_dora"),
        ("pattern", weights, {"rank_pattern": {"q_proj": 8}}, "rank or alpha patterns"),
    ):
        (tmp_path / case).mkdir()
        save_file(tensors, str(tmp_path / case / WEIGHTS_FILE))
        (tmp_path / case / CONFIG_FILE).write_text(json.dumps({**cfg, **changed}))
        with pytest.raises(BadRequestError, match=match) as e:
            gguf_lora_tensors(tmp_path / case, config)
        assert e.value.param == "format"
    config.model_type = "qwen2"
    with pytest.raises(BadRequestError, match="llama-architecture"):
        gguf_lora_tensors(src, config)


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from source)",
)
def test_llama_cpp_with_the_adapter_predicts_what_peft_does(exported, tokenizer):
    """llama.cpp runs in a child process: a native crash fails (or, where the canary crashes too, skips) this
    test with the signal named instead of ending the run."""
    m, _, _, out, _ = exported
    ids = tokenizer(TEXT)["input_ids"]

    def last_logits(lora: str | None) -> torch.Tensor:
        path = str(out / GGUF_FILE) if lora else None
        return torch.tensor(in_child(llama_cpp_logits, str(gguf_location(DEFAULT_MODEL)), ids, path, weights="gguf"))

    with torch.no_grad():
        peft_logits = m.peft_model(input_ids=torch.tensor([ids])).logits[0]
        with m.peft_model.disable_adapter():
            base_logits = m.peft_model(input_ids=torch.tensor([ids])).logits[0]
    adapted, plain = last_logits("lora"), last_logits(None)
    # llama.cpp multiplies Q4_1 weights by 8-bit activations: logits differ by a little from float32 peft, so
    # compare against the adapter's effect, which is much larger
    err = (adapted - peft_logits).abs().max().item()
    assert err < 0.5 * (peft_logits - base_logits).abs().max().item()
    assert (adapted - plain).abs().max().item() > 0.5 * (peft_logits - base_logits).abs().max().item()
    assert (adapted.argmax(-1) == peft_logits.argmax(-1)).float().mean().item() >= 0.9


def test_the_cli_refuses_an_unknown_format_before_it_starts(tmp_path):
    from typer.testing import CliRunner

    from livelora.cli.main import app

    result = CliRunner().invoke(
        app, ["adapters", "export", "x@1", "--format", "onnx", "--out", str(tmp_path / "o"), "--home", str(tmp_path)]
    )
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "'onnx' is not one of peft, merged, gguf" in out, out
    assert "exporting" not in out and not (tmp_path / "o").exists()
