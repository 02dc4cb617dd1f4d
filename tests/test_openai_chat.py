"""Chat completions through a live gateway on the real SmolLM2 model, with the official openai client and httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from harness.server import MODEL, sse_events


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_greedy_answer_names_paris_and_reports_usage(client, live_server):
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("What is the capital of France?"), temperature=0, max_tokens=12
    )
    assert resp.headers["x-livelora-adapter-version"] == "base"
    completion = resp.parse()
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and len(completion.id) == len("chatcmpl-") + 32
    assert isinstance(completion.created, int) and completion.model == MODEL
    assert completion.system_fingerprint == "livelora-base"
    choice = completion.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt_ids = live_server.engine.tokenizer.apply_chat_template(
        ask("What is the capital of France?"), add_generation_prompt=True, tokenize=False
    )
    n_prompt = len(live_server.engine.tokenizer.encode(prompt_ids, add_special_tokens=False))
    usage = completion.usage
    assert usage.prompt_tokens == n_prompt
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert (
        len(live_server.engine.tokenizer.encode(choice.message.content, add_special_tokens=False))
        <= usage.completion_tokens
    )


def test_streaming_deltas_rebuild_the_same_greedy_text(client):
    kwargs = dict(model=MODEL, messages=ask("Name three fruits."), temperature=0, max_tokens=10)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == plain
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_n2_non_streaming_returns_two_indexed_choices_with_summed_usage(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=ask("Name a color."), n=2, temperature=1.0, seed=11, max_tokens=6
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    assert 2 <= completion.usage.completion_tokens <= 12


def test_same_seed_gives_same_texts_and_choice_i_uses_seed_plus_i(client):
    kwargs = dict(model=MODEL, messages=ask("Write a word."), temperature=1.0, max_tokens=8)
    first = client.chat.completions.create(seed=1234, n=2, **kwargs)
    again = client.chat.completions.create(seed=1234, n=2, **kwargs)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    shifted = client.chat.completions.create(seed=1235, n=1, **kwargs)
    assert shifted.choices[0].message.content == first.choices[1].message.content


def test_temperature_zero_is_greedy_and_repeatable(client):
    kwargs = dict(model=MODEL, messages=ask("Say hello."), temperature=0, max_tokens=8)
    texts = {client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_stop_string_ends_the_text_before_the_match(client):
    kwargs = dict(model=MODEL, messages=ask("What is the capital of France?"), temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert "Paris" in full
    cut = client.chat.completions.create(stop=["Paris", "Berlin"], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index("Paris")]
    streamed = list(client.chat.completions.create(stop="Paris", stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_have_openai_shape_and_match_tokens(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=ask("Hi"), temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = completion.choices[0].logprobs.content
    stopped = completion.choices[0].finish_reason == "stop"  # the end-of-turn token's entry ends the list
    assert len(content) == completion.usage.completion_tokens + stopped
    rebuilt = b"".join(bytes(item.bytes) for item in content).decode("utf-8")
    text = completion.choices[0].message.content
    assert rebuilt.startswith(text) or text.startswith(rebuilt)
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely alternative
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


def test_streamed_logprobs_cover_each_chunks_tokens(live_server):
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 4, "logprobs": True, "messages": ask("Hi")}
    r = httpx.post(live_server.url("/v1/chat/completions"), json=body, timeout=60)
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    with_content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert with_content
    for c in with_content:
        entries = c["choices"][0]["logprobs"]["content"]
        assert entries and all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)
        assert all(e["top_logprobs"] == [] for e in entries)


def test_n2_stream_interleaves_both_indices_each_with_one_finish(live_server):
    body = {
        "model": MODEL,
        "n": 2,
        "stream": True,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 8,
        "stream_options": {"include_usage": True},
        "messages": ask("Name a color."),
    }
    r = httpx.post(live_server.url("/v1/chat/completions"), json=body, timeout=60)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert all(len(f) == 1 and f[0] in ("stop", "length") for f in finishes.values())
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    plain = httpx.post(
        live_server.url("/v1/chat/completions"), json={**body, "stream": False, "stream_options": None}, timeout=60
    ).json()
    assert [c["message"]["content"] for c in plain["choices"]] == [texts[0], texts[1]]
    assert plain["usage"]["completion_tokens"] == usage["completion_tokens"]


def test_concurrent_requests_get_their_own_answers(live_server):
    prompts = {
        "What is the capital of France?": "Paris",
        "What is the capital of Germany?": "Berlin",
        "What is the capital of Japan?": "Tokyo",
    }

    async def run():
        async with openai.AsyncOpenAI(base_url=live_server.url("/v1"), api_key="x", max_retries=0) as aclient:

            async def one(q):
                return await aclient.chat.completions.create(model=MODEL, messages=ask(q), temperature=0, max_tokens=12)

            solo = [await one(q) for q in prompts]
            together = await asyncio.gather(*(one(q) for q in prompts))
            return solo, together

    solo, together = asyncio.run(run())
    assert len({c.id for c in together}) == 3
    for (q, city), a, b in zip(prompts.items(), solo, together, strict=True):
        assert city in a.choices[0].message.content, (q, a.choices[0].message.content)
        assert city in b.choices[0].message.content, (q, b.choices[0].message.content)


def test_developer_role_list_content_and_tool_history_are_rendered(client):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "France"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Paris"},
        {"role": "user", "content": "So?"},
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4, tool_choice="none"
    )
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens > 20
