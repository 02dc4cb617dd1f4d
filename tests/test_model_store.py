"""The base-model store converts the built-in GGUF once and loads the cache."""

import json

import pytest
import torch

from livelora.clients.errors import BadRequestError, ModelNotFoundError
from livelora.core.base_models import MANIFEST, load_model, resolve_base_model


def test_builtin_model_is_cached_as_safetensors(base_ref, livelora_home):
    path = livelora_home / "models" / "smollm2-135m-instruct"
    assert base_ref.path == str(path) and base_ref.is_local
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", MANIFEST} <= names
    manifest = json.loads((path / MANIFEST).read_text())
    assert len(manifest["weights_sha256"]) == 64
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())


def test_cached_model_answers_sensibly(base_ref, tokenizer):
    model = load_model(base_ref)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


def test_local_directory_and_bad_names(base_ref, tmp_path, livelora_home):
    ref = resolve_base_model(base_ref.path, livelora_home)
    assert ref.is_local and ref.path == base_ref.path
    with pytest.raises(ModelNotFoundError):
        resolve_base_model(str(tmp_path), livelora_home)  # a directory without config.json
    with pytest.raises(BadRequestError):
        resolve_base_model(" ", livelora_home)


def test_models_and_lora_layers_built_by_two_threads_at_once_hold_real_weights(base_ref):
    """`livelora serve` loads the engine's model while the trainer thread builds its own; transformers builds
    models on the meta device by patching torch.nn.Module process-wide, so unserialised builds can leave a
    thread with data-less meta tensors (seen as 'Cannot copy out of meta tensor' at start-up)."""
    import threading

    from livelora.clients.types.tinker import LoraConfig
    from livelora.trainer.model import TrainingModel

    built, errors = [], []

    def build(kind: str) -> None:
        try:
            for _ in range(2):
                if kind == "engine":
                    built.append(load_model(base_ref))
                else:
                    built.append(TrainingModel(base_ref, LoraConfig(rank=4, train_unembed=False)).peft_model)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(kind,)) for kind in ("engine", "trainer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(built) == 4
    for model in built:
        assert not any(p.is_meta for p in model.parameters())
