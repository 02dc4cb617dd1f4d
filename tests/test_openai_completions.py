"""Legacy ``/v1/completions`` and ``/v1/models`` through a live gateway on the real SmolLM2 model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from harness.server import MODEL, sse_events

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def test_string_prompt_greedy_completion_with_usage(client, live_server):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.system_fingerprint == "livelora-base"
    choice = completion.choices[0]
    assert "Paris" in choice.text and choice.finish_reason == "length"
    n_prompt = len(live_server.engine.tokenizer.encode(PROMPT))
    assert completion.usage.prompt_tokens == n_prompt and completion.usage.completion_tokens == 3
    assert completion.usage.total_tokens == n_prompt + 3


def test_token_id_prompts_match_the_string_prompt(client, live_server):
    ids = live_server.engine.tokenizer.encode(PROMPT)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert from_ids.choices[0].text == text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == len(ids) + 3  # each prompt counted once, not per choice
    assert batch.usage.completion_tokens == 8


def test_list_of_string_prompts_and_echo_with_logprobs(client):
    completion = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Two plus two is"], max_tokens=2, temperature=0, echo=True, logprobs=2
    )
    assert [c.index for c in completion.choices] == [0, 1]
    first = completion.choices[0]
    assert first.text.startswith(PROMPT) and len(first.text) > len(PROMPT)
    lp = first.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == first.text and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_streaming_completion_chunks_share_the_response_shape(live_server):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(live_server.url("/v1/completions"), json=body, timeout=60)
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    *text_chunks, usage_chunk = chunks
    text = "".join(c["choices"][0]["text"] for c in text_chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] == "length"
    assert all(c["usage"] is None for c in text_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    plain = httpx.post(
        live_server.url("/v1/completions"), json={**body, "stream": False, "stream_options": None}, timeout=60
    ).json()
    assert plain["choices"][0]["text"] == text


@pytest.mark.parametrize("field,value", [("max_completion_tokens", 5), ("suffix", "end"), ("best_of", 3)])
def test_unsupported_completion_parameters_are_400_naming_param(live_server, field, value):
    response = httpx.post(
        live_server.url("/v1/completions"), json={"model": MODEL, "prompt": PROMPT, field: value}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_bad_prompts_are_400_naming_prompt(live_server):
    for prompt in ([], [[]], [10**9], ""):
        response = httpx.post(live_server.url("/v1/completions"), json={"model": MODEL, "prompt": prompt}, timeout=60)
        assert response.status_code == 400, (prompt, response.text)
        assert response.json()["error"]["param"] == "prompt"
    response = httpx.post(
        live_server.url("/v1/completions"), json={"model": MODEL, "prompt": PROMPT, "logprobs": 6}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_models_list_with_the_openai_client(client):
    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "livelora"
