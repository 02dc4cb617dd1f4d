"""Contract cases A01-A15 (shared/reference/openai_contract.md §2), replayed against a live gateway.

Each test sends the case's body (``MODEL`` = the served base model) and checks
the expected behaviour, for the whole kind of failure where it is cheap to do so.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest
from harness.server import MODEL, sse_events, wait_until

from livelora.clients.errors import InternalError

CHAT = "/v1/chat/completions"
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def chunks_of(response: httpx.Response) -> list[dict]:
    events = sse_events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and error["message"]
    return error


def test_a01_no_usage_chunk_unless_include_usage(http):
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Count to three."}],
    }
    chunks = chunks_of(http.post(CHAT, json=body))
    assert chunks and all(c["choices"] for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    with_usage = chunks_of(http.post(CHAT, json={**body, "stream_options": {"include_usage": True}}))
    assert [c["usage"] is not None for c in with_usage] == [False] * (len(with_usage) - 1) + [True]
    assert with_usage[-1]["choices"] == []


def test_a02_finish_reason_null_until_each_choices_final_chunk_and_role_only_first(http):
    body = {"model": MODEL, "stream": True, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hi"}]}
    response = http.post(CHAT, json=body)
    assert '"finish_reason":""' not in response.text
    chunks = chunks_of(response)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in FINISH_REASONS
    roles = [c["choices"][0]["delta"].get("role") for c in chunks]
    assert roles[0] == "assistant" and all(r is None for r in roles[1:])
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_a03_max_tokens_below_one_is_400_naming_the_field(http, client):
    error = assert_error(
        http.post(CHAT, json={"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}),
        400,
        "integer_below_min_value",
        "max_tokens",
    )
    assert "at least 1" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, max_completion_tokens=-5, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "integer_below_min_value" and info.value.param == "max_completion_tokens"


def test_a04_over_long_prompt_is_400_context_length_exceeded_with_real_numbers(http, live_server):
    content = "lorem " * 20000
    tok = live_server.engine.tokenizer
    n_prompt = len(
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
    )
    limit = live_server.engine.max_model_len
    for extra, asked in (({"max_tokens": 16}, "16 in the completion"), ({}, "at least 1 in the completion")):
        error = assert_error(
            http.post(CHAT, json={"model": MODEL, **extra, "messages": [{"role": "user", "content": content}]}),
            400,
            "context_length_exceeded",
            "messages",
        )
        message = error["message"]
        assert f"maximum context length is {limit} tokens" in message
        assert f"{n_prompt} in the messages" in message and asked in message
        assert not re.search(r"-\d", message), "no negative numbers leak into the message"


def test_a05_n2_stream_has_both_indices_own_finish_and_usage_counts_both(http):
    body = {
        "model": MODEL,
        "n": 2,
        "stream": True,
        "temperature": 1.0,
        "max_tokens": 16,
        "logprobs": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Name a color."}],
    }
    chunks = chunks_of(http.post(CHAT, json=body))
    tokens = {0: 0, 1: 0}
    finishes = {0: 0, 1: 0}
    stopped = 0  # a choice ended by the end-of-turn token has its entry, which usage does not count
    roles = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        roles[i] += choice["delta"].get("role") == "assistant"
        finishes[i] += choice["finish_reason"] is not None
        stopped += choice["finish_reason"] == "stop"
        if choice["logprobs"]:
            tokens[i] += len(choice["logprobs"]["content"])
    assert roles == {0: 1, 1: 1} and finishes == {0: 1, 1: 1}
    assert tokens[0] >= 1 and tokens[1] >= 1
    assert chunks[-1]["usage"]["completion_tokens"] == tokens[0] + tokens[1] - stopped


def test_a06_sse_data_is_ascii_safe_and_charset_is_utf8(http):
    body = {
        "model": MODEL,
        "stream": True,
        "temperature": 0,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Repeat exactly: A\u2028B\u2029C\u0085D"}],
    }
    response = http.post(CHAT, json=body)
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    raw = response.content
    assert all(b < 128 for b in raw), "SSE body must be ASCII (non-ASCII escaped in JSON)"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks_of(response))
    assert any(ch in text for ch in "\u2028\u2029\u0085"), text  # the model does echo the separators
    # the line splitter of openai-python < 1.16.2 (str.splitlines) sees whole events
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            json.loads(line[len("data: ") :])


def test_a07_unknown_and_unimplemented_fields_are_accepted(http):
    body = {
        "model": MODEL,
        "user": "u-1",
        "metadata": {"team": "qa"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s1",
        "prompt_cache_key": "k1",
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "max_tokens": 8,
        "messages": [{"role": "user", "name": "alice", "content": "hi", "id": "m1", "opts": {"x": 1}}],
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_a08_empty_or_null_with_tool_calls_assistant_content_is_accepted(http):
    empty = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "A"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "B"},
        ],
    }
    response = http.post(CHAT, json=empty)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)
    null = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": "And?"},
        ],
    }
    response = http.post(CHAT, json=null)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)
    bad = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": None}]}
    assert_error(http.post(CHAT, json=bad), 400, "invalid_value", "messages[0]")


def test_a09_logprobs_without_top_logprobs_and_limits(http):
    body = {"model": MODEL, "logprobs": True, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    content = data["choices"][0]["logprobs"]["content"]
    stopped = data["choices"][0]["finish_reason"] == "stop"  # then the end-of-turn token's entry ends the list
    assert len(content) == data["usage"]["completion_tokens"] + stopped
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["top_logprobs"] == [] for e in content)
    two = http.post(CHAT, json={**body, "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in two)
    assert_error(http.post(CHAT, json={**body, "top_logprobs": 21}), 400, "integer_above_max_value", "top_logprobs")
    assert_error(
        http.post(CHAT, json={**body, "logprobs": False, "top_logprobs": 2}),
        400,
        "invalid_parameter_combination",
        "top_logprobs",
    )


def test_a10_tools_are_rejected_before_the_stream_with_param_tools(http):
    body = {
        "model": MODEL,
        "stream": True,
        "tool_choice": "required",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
            }
        ],
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    assert_error(http.post(CHAT, json=body), 400, "unsupported_parameter", "tools")
    no_tools = {k: v for k, v in body.items() if k != "tools"}
    assert_error(http.post(CHAT, json=no_tools), 400, "unsupported_parameter", "tool_choice")
    ok = http.post(CHAT, json={**no_tools, "stream": False, "tool_choice": "none", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a11_errors_before_first_byte_are_plain_http_errors(http):
    body = {"model": MODEL, "stream": True, "max_tokens": 100000000, "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(http.post(CHAT, json=body), 400, "context_length_exceeded", "max_tokens")
    assert "100000000" in error["message"]


def test_a11_failure_after_headers_is_one_error_event_then_close(http, live_server, monkeypatch):
    engine = live_server.engine
    real_generate = type(engine).generate

    async def crashing_generate(prompt_ids, params, adapter=None, request_id=None):
        # the real engine's first two chunks, then an injected engine fault
        gen = real_generate(engine, prompt_ids, params, adapter=adapter, request_id=request_id)
        try:
            for _ in range(2):
                yield await anext(gen)
        finally:
            await gen.aclose()
        raise InternalError("simulated engine crash")

    monkeypatch.setattr(engine, "generate", crashing_generate)
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    }
    response = http.post(CHAT, json=body)
    monkeypatch.undo()
    assert response.status_code == 200
    events = sse_events(response)
    assert "[DONE]" not in events
    *chunks, last = [json.loads(e) for e in events]
    assert all(c["choices"] for c in chunks) and len(chunks) >= 2
    assert last == {
        "error": {"message": "simulated engine crash", "type": "server_error", "param": None, "code": "internal_error"}
    }
    with pytest.raises(openai.APIError, match="simulated engine crash"):
        monkeypatch.setattr(engine, "generate", crashing_generate)
        sdk = openai.OpenAI(base_url=live_server.url("/v1"), api_key="x", max_retries=0)
        list(
            sdk.chat.completions.create(
                stream=True, **{k: v for k, v in body.items() if k not in ("stream", "ignore_eos")}
            )
        )
    monkeypatch.undo()
    assert wait_until(lambda: live_server.admission.active == 0, 30)


def test_a12_client_disconnect_aborts_generation(http, live_server):
    engine = live_server.engine
    assert wait_until(lambda: engine.num_unfinished_requests() == 0, 30)
    steps_before = engine.decode_steps
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }
    with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        data_lines = 0
        # keep the line iterator referenced: a dropped httpx iterator is finalised at once and closes the
        # connection, which races the next assertion (the server may have aborted already)
        lines = response.iter_lines()
        for line in lines:
            data_lines += line.startswith("data: ")
            if data_lines == 3:  # the role chunk and two content chunks
                break
        assert engine.num_unfinished_requests() == 1
    # leaving the block closes the socket mid-stream
    assert wait_until(lambda: engine.num_unfinished_requests() == 0, 30), "generation kept running"
    assert wait_until(lambda: live_server.admission.active == 0, 10)
    assert engine.decode_steps - steps_before < 1000, "generation was not aborted well before max_tokens"
    follow = http.post(CHAT, json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert follow.status_code == 200 and follow.json()["usage"]["completion_tokens"] == 1


def test_a13_parallel_requests_keep_their_own_budget_prompt_and_id(live_server):
    results: dict[int, dict] = {}
    prompts = {
        1: "Reply with the word APPLE.",
        2: "What is the capital of France?",
        3: "What is the capital of Japan?",
        4: "What is 2+2?",
    }

    def one(limit: int) -> None:
        body = {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": limit,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": prompts[limit]}],
        }
        results[limit] = httpx.post(live_server.url(CHAT), json=body, timeout=120).json()

    threads = [threading.Thread(target=one, args=(limit,)) for limit in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tok = live_server.engine.tokenizer
    for limit, data in results.items():
        expected_prompt = len(
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": prompts[limit]}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
        )
        assert data["usage"]["completion_tokens"] == limit  # ignore_eos: exactly its own budget
        assert data["usage"]["prompt_tokens"] == expected_prompt
    assert len({d["id"] for d in results.values()}) == 4


def test_a13_queue_full_answers_429_with_retry_after(http, live_server):
    limit = live_server.admission.limit
    body = {
        "model": MODEL,
        "stream": True,
        "n": limit,
        "max_tokens": 200,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a story."}],
    }
    with http.stream("POST", CHAT, json=body) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()  # keep a reference: a collected line iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        refused = http.post(
            CHAT, json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        )
        error = assert_error(refused, 429, "rate_limit_exceeded", None)
        assert error["type"] == "rate_limit_error"
        assert int(refused.headers["retry-after"]) >= 1
    assert_error(http.post(CHAT, json={**body, "n": limit + 1}), 400, "integer_above_max_value", "n")
    assert wait_until(lambda: live_server.engine.num_unfinished_requests() == 0, 60)
    # the disconnect cancelled choices still waiting for a batch slot: every slot and admission comes back
    assert wait_until(lambda: live_server.admission.active == 0, 30)
    assert live_server.admission.running.pool.total == 0 and not live_server.admission.running.waiters


def test_a14_unknown_model_is_404_and_listed_ids_are_usable(http, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-adapter", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found" and info.value.param == "model"
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list" and listed["data"]
    for entry in listed["data"]:
        assert entry["object"] == "model" and isinstance(entry["created"], int) and entry["owned_by"]
        one = http.get(f"/v1/models/{entry['id']}").json()
        assert one.pop("sampling_defaults")["generation_config"] == "auto"  # livelora's extension of the object
        assert one == entry
        answer = http.post(
            CHAT, json={"model": entry["id"], "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert answer.status_code == 200 and answer.json()["model"] == entry["id"]
    assert_error(http.get("/v1/models/no-such-adapter"), 404, "model_not_found", "model")


def test_a15_response_format_json_is_rejected_naming_response_format(http):
    schema = {
        "name": "person",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
    }
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": schema},
        "messages": [{"role": "user", "content": "Invent a person."}],
    }
    assert_error(http.post(CHAT, json=body), 400, "unsupported_parameter", "response_format")
    assert_error(
        http.post(CHAT, json={**body, "response_format": {"type": "json_object"}}),
        400,
        "unsupported_parameter",
        "response_format",
    )
    text = http.post(CHAT, json={**body, "max_tokens": 2, "response_format": {"type": "text"}})
    assert text.status_code == 200, text.text
