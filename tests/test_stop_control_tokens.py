"""A stop string that is a control token ends generation at that token on every route (issue 14, case 2).

``{"ignore_eos": true, "stop": ["<|im_end|>"]}`` must give ``finish_reason: "stop"`` and the text before the end
of the turn, exactly what the same greedy request gives when it stops on EOS: chat and legacy completions,
streaming and not, ``n > 1``, the Tinker sample path; both engines apply the same rule
(:func:`livelora.gateway.engines.base.resolve_stop_strings`). A stop string mixing a control token with text is
a 400 naming ``stop``. Real SmolLM2, live gateway.
"""

from __future__ import annotations

import json

import httpx
import pytest
from harness.server import MODEL, sse_events

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.base import SamplingParams, resolve_stop_strings

MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
RAW_PROMPT = "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
FORCED = {"ignore_eos": True, "stop": ["<|im_end|>"]}
#: A prompt whose greedy continuation starts with the next turn's ``<|im_start|>`` (a control token, not EOS).
TURN_DONE = "<|im_start|>user\nHi<|im_end|>\n"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, "temperature": 0, "max_tokens": 32, **body}, timeout=180)


def streamed(server, path: str, body: dict) -> tuple[dict[int, str], dict[int, str]]:
    """``({index: text}, {index: finish_reason})`` of a streamed request."""
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for data in sse_events(r):
        if data == "[DONE]":
            break
        for c in json.loads(data)["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return texts, finish


@pytest.fixture(scope="module")
def natural_chat(live_server) -> dict:
    """The greedy reply that ends on EOS by itself (the reference)."""
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 32
    return body


def test_chat_stops_at_the_control_token_with_ignore_eos(live_server, natural_chat):
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, **FORCED})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == natural_chat["choices"][0]["message"]["content"]
    assert r.json()["usage"] == natural_chat["usage"]
    # without the stop string the same request runs past the end of the turn
    longer = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True}).json()
    assert longer["choices"][0]["finish_reason"] == "length" and longer["usage"]["completion_tokens"] == 32


def test_chat_streaming_and_n2_stop_the_same_way(live_server, natural_chat):
    want = natural_chat["choices"][0]["message"]["content"]
    texts, finish = streamed(live_server, "/v1/chat/completions", {"messages": MESSAGES, **FORCED})
    assert texts == {0: want} and finish == {0: "stop"}
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, **FORCED})
    assert r.status_code == 200, r.text
    assert [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]] == [(want, "stop")] * 2
    texts, finish = streamed(live_server, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, **FORCED})
    assert texts == {0: want, 1: want} and finish == {0: "stop", 1: "stop"}


def test_completions_stop_at_the_control_token(live_server):
    natural = post(live_server, "/v1/completions", {"prompt": RAW_PROMPT}).json()["choices"][0]
    assert natural["finish_reason"] == "stop"
    want = natural["text"]
    r = post(live_server, "/v1/completions", {"prompt": RAW_PROMPT, "n": 2, **FORCED})
    assert r.status_code == 200, r.text
    assert [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] == [(want, "stop")] * 2
    texts, finish = streamed(live_server, "/v1/completions", {"prompt": RAW_PROMPT, **FORCED})
    assert texts == {0: want} and finish == {0: "stop"}
    # a control token other than EOS: the turn opener that greedy decoding writes first here
    r = post(live_server, "/v1/completions", {"prompt": TURN_DONE, "stop": "<|im_start|>"})
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == ("", "stop")
    assert r.json()["usage"]["completion_tokens"] == 0


def test_mixed_control_and_text_stop_is_a_400_on_every_route(live_server):
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        for stream in (False, True):
            r = post(live_server, path, {**body, "stop": ["<|im_end|>\n"], "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "stop" and "<|im_end|>" in err["message"]


def test_tinker_sample_path_stops_at_a_control_token_stop_string(live_server, tokenizer):
    """After a finished user turn the model opens the next turn with ``<|im_start|>`` (not EOS): as a stop
    string it ends the sample at once (the Tinker convention keeps the stop token in ``tokens``)."""
    prompt = tokenizer.encode(TURN_DONE)

    def sample(stop) -> dict:
        api = live_server.url("/api/v1")
        r = httpx.post(
            f"{api}/asample",
            timeout=60,
            json={
                "num_samples": 1,
                "base_model": MODEL,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": 6, "temperature": 0.0, "stop": stop},
            },
        )
        assert r.status_code == 200, r.text
        while True:
            got = httpx.post(f"{api}/retrieve_future", json={"request_id": r.json()["request_id"]}, timeout=120)
            if got.status_code != 408:
                assert got.status_code == 200, got.text
                return got.json()["sequences"][0]

    free = sample(None)  # EOS stops only: greedy writes the next turn
    assert free["tokens"][0] == 1 and free["stop_reason"] == "length" and len(free["tokens"]) == 6
    cut = sample(["<|im_start|>"])
    assert cut["tokens"] == [1] and cut["stop_reason"] == "stop" and len(cut["logprobs"]) == 1


def test_engine_rule_is_shared_by_both_engines(tokenizer):
    params = SamplingParams(max_tokens=4, stop=("<|im_end|>", "\n\n"), stop_token_ids=(7,))
    resolved = resolve_stop_strings(params, tokenizer)
    assert resolved.stop == ("\n\n",) and resolved.stop_token_ids == (7, 2)
    assert resolve_stop_strings(SamplingParams(stop=("x",)), tokenizer) == SamplingParams(stop=("x",))
    # the vLLM engine's validation (vLLM itself cannot run here) applies the same rule to its parameters
    from livelora.gateway.engines.transformers.engine import TransformersEngine
    from livelora.gateway.engines.vllm.engine import VLLMEngine

    for cls in (TransformersEngine, VLLMEngine):
        engine = cls.__new__(cls)
        engine._tokenizer, engine.vocab_size, engine.max_model_len = tokenizer, len(tokenizer), 8192
        assert engine._check_params(params, 10) == resolved
        with pytest.raises(BadRequestError) as err:
            engine._check_params(SamplingParams(stop=("a<|im_end|>",)), 10)
        assert err.value.param == "stop"
