"""The base-model store converts the built-in GGUF once and loads the cache."""

import json

import pytest
import torch

from livelora.adapters.models import MANIFEST, load_model, resolve_base_model
from livelora.clients.errors import BadRequestError, ModelNotFoundError


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
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_local_directory_and_bad_names(base_ref, tmp_path, livelora_home):
    ref = resolve_base_model(base_ref.path, livelora_home)
    assert ref.is_local and ref.path == base_ref.path
    with pytest.raises(ModelNotFoundError):
        resolve_base_model(str(tmp_path), livelora_home)  # a directory without config.json
    with pytest.raises(BadRequestError):
        resolve_base_model(" ", livelora_home)
