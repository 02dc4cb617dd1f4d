"""Logprobs that add up (issue 29): the token that ends a reply has its entry, ``text_offset`` counts characters of
the returned text when a token splits a UTF-8 character, and ``echo`` with ``max_tokens: 0`` returns the prompt's
logprobs only, as vLLM does. lm-eval's ``local-completions`` drops the last entry of ``echo: true, max_tokens: 1``
as the generated token, so a missing end-of-sequence entry made it drop a prompt token. Real SmolLM2, live gateway.
"""

from __future__ import annotations

import json

import httpx
import pytest
from harness.server import MODEL, sse_events

MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
#: The emoji is 4 UTF-8 bytes, split over several byte-level tokens.
EMOJI = "Cats and 🐈 very much"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, "temperature": 0, **body}, timeout=180)


@pytest.fixture(scope="module")
def finished_prompt(live_server) -> list[int]:
    """Token ids of a chat prompt plus its whole greedy reply: the greedy next token is the end of the turn."""
    tok = live_server.engine.tokenizer
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", r.text
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tok.encode(text + choice["message"]["content"], add_special_tokens=False)


def scored(live_server, ids: list[int]) -> list[float | None]:
    """The prompt logprobs of ``ids`` (an echo with ``max_tokens: 0``)."""
    r = post(live_server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_echo_max_tokens_1_ending_on_eos_has_prompt_plus_one_entries(live_server, finished_prompt):
    ids = finished_prompt
    r = post(live_server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert len(lp["text_offset"]) == len(ids) + 1
    assert lp["tokens"][-1] == "" and lp["text_offset"][-1] == len(choice["text"])
    assert "".join(lp["tokens"]) == choice["text"]
    eos = live_server.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    whole = scored(live_server, ids + [eos])
    # the end-of-turn entry is the model's logprob of that token after the prompt (lm-eval drops it, keeps the rest)
    assert lp["token_logprobs"][-1] == pytest.approx(whole[-1], abs=1e-3)
    assert lp["token_logprobs"][-1] > -1.0  # greedy: it was the most likely token
    assert lp["token_logprobs"][:-1] == whole[:-1]


def test_chat_logprobs_end_with_the_end_of_turn_entry_plain_and_streamed(live_server):
    body = {"messages": MESSAGES, "max_tokens": 40, "logprobs": True, "top_logprobs": 2}
    data = post(live_server, "/v1/chat/completions", body).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert data["choices"][0]["finish_reason"] == "stop"
    assert len(content) == data["usage"]["completion_tokens"] + 1  # the end of turn's entry (usage leaves it out)
    last = content[-1]
    assert last["token"] == "" and last["bytes"] == [] and len(last["top_logprobs"]) == 2
    assert last["top_logprobs"][0]["token"] == "<|im_end|>" and last["logprob"] == last["top_logprobs"][0]["logprob"]
    assert "".join(e["token"] for e in content) == data["choices"][0]["message"]["content"]
    r = post(live_server, "/v1/chat/completions", {**body, "stream": True})
    streamed = []
    for event in sse_events(r):
        if event != "[DONE]":
            for c in json.loads(event)["choices"]:
                streamed += (c.get("logprobs") or {}).get("content") or []
    assert [(e["token"], e["logprob"]) for e in streamed] == [(e["token"], e["logprob"]) for e in content]


def test_text_offset_counts_characters_when_a_token_splits_an_emoji(live_server):
    r = post(live_server, "/v1/completions", {"prompt": EMOJI, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    lp = choice["logprobs"]
    n_prompt = len(live_server.engine.tokenizer.encode(EMOJI))
    assert choice["text"] == EMOJI and choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    assert sum("\ufffd" in t for t in lp["tokens"]) >= 2  # the emoji is split over tokens
    very = lp["tokens"].index(" very")
    assert lp["text_offset"][very] == EMOJI.index(" very") == 10
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][lp["tokens"].index(" and")] == EMOJI.index(" and")


def test_emoji_offsets_in_a_generated_reply(live_server):
    body = {"prompt": "Repeat: " + EMOJI + "\nRepeat: " + EMOJI + "\nRepeat:", "max_tokens": 12, "logprobs": 1}
    choice = post(live_server, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert "🐈 very" in text, text
    assert lp["text_offset"][lp["tokens"].index(" very")] == text.index(" very")
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_max_tokens_0_without_echo_is_400_naming_max_tokens(live_server):
    r = post(live_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
