"""Sampling defaults from the served model's generation_config.json (as vLLM takes them), on live servers with the
real SmolLM2 model: a request that omits temperature / top_p is sampled exactly as one that sends the built-in
model's 0.2 / 0.9, every sampled token lies in that distribution's nucleus, ``LIVELORA_GENERATION_CONFIG=none``
gives OpenAI's 1.0 / 1.0, a value the request gives wins, and ``GET /v1/models/{id}`` says which apply."""

from __future__ import annotations

import json
import math
import shutil

import httpx
import pytest
from harness.server import MODEL, TEST_SETTINGS, start_server
from pydantic import ValidationError

from livelora.core.base_models import BUILTIN_SAMPLING, GENERATION_CONFIG, MANIFEST, resolve_base_model
from livelora.gateway.services.serving.sampling_defaults import read_defaults
from livelora.gateway.settings import GatewaySettings

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BUILT_IN = {"temperature": 0.2, "top_p": 0.9}


def chat(server, **kw) -> dict:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "seed": 3, "logprobs": True, **kw}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def tokens(choice: dict) -> list[tuple[str, float]]:
    return [(e["token"], e["logprob"]) for e in choice["logprobs"]["content"]]


@pytest.fixture(scope="module")
def none_server(livelora_home):
    live = start_server(GatewaySettings(model=MODEL, home=livelora_home, generation_config="none", **TEST_SETTINGS))
    yield live
    live.stop()


def test_the_built_in_model_carries_its_sampling_defaults_and_an_older_store_gets_them(livelora_home, tmp_path):
    converted = livelora_home / "models" / MODEL
    resolve_base_model(MODEL, livelora_home)
    config = json.loads((converted / GENERATION_CONFIG).read_text())
    assert {k: config[k] for k in BUILT_IN} == BUILT_IN and BUILTIN_SAMPLING[MODEL]["temperature"] == 0.2
    assert config["eos_token_id"] == 2  # what the conversion wrote is kept
    # a store converted before the defaults existed: its generation_config.json lacks them until it is resolved
    old = tmp_path / "models" / MODEL
    old.mkdir(parents=True)
    for f in converted.iterdir():
        if f.name != GENERATION_CONFIG:
            (old / f.name).symlink_to(f)
    before = {k: v for k, v in config.items() if k not in ("do_sample", "temperature", "top_p")}
    (old / GENERATION_CONFIG).write_text(json.dumps({**before, "top_p": 0.95}))  # an operator's own top_p stays
    assert (old / MANIFEST).is_file()
    resolve_base_model(MODEL, tmp_path)
    after = json.loads((old / GENERATION_CONFIG).read_text())
    assert after == {**before, "do_sample": True, "temperature": 0.2, "top_p": 0.95}
    shutil.rmtree(tmp_path / "models")


def test_models_route_says_which_defaults_apply(live_server, none_server):
    auto = httpx.get(live_server.url(f"/v1/models/{MODEL}"), timeout=30).json()["sampling_defaults"]
    assert auto == {
        **BUILT_IN,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "from_generation_config": ["temperature", "top_p"],
        "generation_config": "auto",
    }
    off = httpx.get(none_server.url(f"/v1/models/{MODEL}"), timeout=30).json()["sampling_defaults"]
    assert off == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "from_generation_config": [],
        "generation_config": "none",
    }
    listed = httpx.get(live_server.url("/v1/models"), timeout=30).json()["data"]
    assert all("sampling_defaults" not in m for m in listed)  # the list stays OpenAI's shape


def _nucleus(top: list[dict], temperature: float, top_p: float) -> set[str]:
    """Tokens the engine may draw at ``temperature`` / ``top_p`` from one position's top-20 raw logprobs (the mass
    beyond the top 20 is negligible once the logits are divided by 0.2; 0.02 of slack covers it)."""
    weights = [math.exp(e["logprob"] / temperature) for e in top]
    total, seen, keep = sum(weights), 0.0, set()
    for e, w in zip(top, weights):
        if seen >= top_p + 0.02:
            break
        keep.add(e["token"])
        seen += w / total
    return keep


def test_an_omitted_temperature_samples_the_generation_config_distribution(live_server):
    omitted = chat(live_server, top_logprobs=20)
    explicit = chat(live_server, top_logprobs=20, **BUILT_IN)
    assert tokens(omitted) == tokens(explicit)  # the same seed and the same distribution: the same draws
    for entry in omitted["logprobs"]["content"]:  # each token lies in the T=0.2, top_p=0.9 nucleus
        # the token that ended the reply is listed with text "" (docs/clients.md): its alternative of equal logprob
        token = entry["token"] or next(t["token"] for t in entry["top_logprobs"] if t["logprob"] == entry["logprob"])
        assert token in _nucleus(entry["top_logprobs"], **BUILT_IN), entry
    hot = chat(live_server, top_logprobs=20, temperature=1.0, top_p=1.0)
    assert tokens(hot) != tokens(omitted)
    # the defaults change the draws, not what a logprob is: the first position's alternatives (the same prompt, the
    # same weights) have the same raw logprobs at 0.2 / 0.9 and at 1.0 (engines/base.py's convention)
    first = [(e["token"], e["logprob"]) for e in omitted["logprobs"]["content"][0]["top_logprobs"]]
    first_hot = [(e["token"], e["logprob"]) for e in hot["logprobs"]["content"][0]["top_logprobs"]]
    assert [t for t, _ in first] == [t for t, _ in first_hot]
    assert [lp for _, lp in first] == pytest.approx([lp for _, lp in first_hot], abs=1e-4)


def test_legacy_completions_follow_the_same_defaults(live_server):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "seed": 5, "logprobs": 1}

    def complete(**kw):
        r = httpx.post(live_server.url("/v1/completions"), json={**body, **kw}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    assert complete() == complete(**BUILT_IN)


def test_none_gives_openai_defaults_and_an_explicit_value_wins(live_server, none_server):
    # none: an omitted temperature is 1.0, top_p 1.0; the same seed on the same weights draws what the
    # generation-config server draws when the request sends 1.0 / 1.0 ...
    assert tokens(chat(none_server)) == tokens(chat(live_server, temperature=1.0, top_p=1.0))
    # ... and a value the request gives wins on both: 0.2 / 0.9 sent to the none server is the auto server's default
    assert tokens(chat(none_server, **BUILT_IN)) == tokens(chat(live_server))
    # each omitted field on its own: temperature 1.0 alone still gets the model's top_p 0.9
    assert tokens(chat(live_server, temperature=1.0)) == tokens(chat(none_server, temperature=1.0, top_p=0.9))


def test_a_generation_config_the_server_cannot_honour_is_reported_not_applied(tmp_path):
    config = {"temperature": 0.6, "top_k": 20, "top_p": 1.5, "repetition_penalty": 1.05, "min_p": 2}
    config["max_new_tokens"] = 9
    got = read_defaults(config, "directory")
    assert got.values == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05}
    assert set(got.not_applied) == {"top_p", "min_p", "max_new_tokens"}
    assert got.describe()["top_p"] == 1.0 and "not_applied" in got.describe()
    with pytest.raises(ValidationError, match="generation_config"):
        GatewaySettings(generation_config=str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert GatewaySettings(generation_config=str(tmp_path)).inference.generation_config == str(tmp_path)
