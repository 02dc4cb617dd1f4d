"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official ``anthropic``
SDK and raw HTTP, against a live gateway in key mode (real SmolLM2, real Redis): replies equal the chat route's
for the same conversation, the stream's events come in Anthropic's documented order, ``stop_reason`` says why a
reply ended, what cannot be honoured is refused by name in Anthropic's error envelope, replies are logged, metered
and rated like chat completions, and (slow) feedback on replies trains a version the next reply is served by.
docs/clients.md's Anthropic example runs here."""

from __future__ import annotations

import contextlib
import io
import json
import re
import uuid

import httpx
import pytest
import redis
from _doc_blocks import REPO, blocks
from harness.bus import new_prefix
from harness.server import MODEL, start_server, wait_until

from livelora.core.api_keys import TENANT_ROLES
from livelora.core.redis_keys import KeyLayout

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (pip install -e '.[dev]')")

PREFIX = new_prefix("msgs")
KEYS = {
    "default": ("default", ["inference", "feedback"]),  # tenant default administers the base endpoint
    "acme": ("acme", TENANT_ROLES),
    "feedback-only": ("acme", ["feedback"]),
}
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": PREFIX}
QUESTION = "What is the capital of France?"
#: the SDK (>= 1.0) has no sampling keywords; extra_body sends them (the route still reads them)
GREEDY = {"temperature": 0}
#: Anthropic's documented event order of one text reply (https://docs.anthropic.com: streaming messages); any
#: number of further ``ping`` events may come between them (keep-alives, every 15 s)
EVENT_ORDER = re.compile(
    r"message_start content_block_start ping (content_block_delta )+content_block_stop message_delta message_stop"
)


def in_documented_order(names: list[str]) -> bool:
    """Whether event ``names`` follow :data:`EVENT_ORDER`, keep-alive pings after the first one aside."""
    first = names.index("ping") if "ping" in names else len(names)
    kept = names[: first + 1] + [n for n in names[first + 1 :] if n != "ping"]
    return EVENT_ORDER.fullmatch(" ".join(kept)) is not None


def sdk(server, key: str):
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def post(server, path: str, body: dict | bytes, *, headers: dict | None = None) -> httpx.Response:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    if headers:
        kw["headers"] = {**kw.get("headers", {}), **headers}
    return httpx.post(server.url(path), timeout=120, **kw)


def anthropic_error(r: httpx.Response, status: int) -> dict:
    """The ``error`` object of an Anthropic envelope, checked to be exactly ``{"type", "message"}``."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return body["error"]


def sse(text: str) -> list[tuple[str, dict]]:
    """``(event name, data)`` of every SSE event of a body (comments skipped)."""
    out = []
    for frame in text.split("\n\n"):
        lines = [x for x in frame.split("\n") if x and not x.startswith(":")]
        if not lines:
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def chat(server, key: str, messages: list[dict], **kw) -> dict:
    r = httpx.post(
        server.url("/v1/chat/completions"),
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": messages, "temperature": 0, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------- replies


def test_a_reply_is_the_chat_routes_answer_to_the_same_conversation(server, keys):
    client = sdk(server, keys["acme"])
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        system="Answer in one sentence.",
        messages=[{"role": "user", "content": QUESTION}],
    )
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert re.fullmatch(r"msg_[0-9a-f]{32}", msg.id) and raw.headers["x-livelora-completion-id"] == msg.id
    assert raw.headers["x-livelora-adapter-version"] == "base"
    [block] = msg.content
    assert block.type == "text" and "Paris" in block.text
    same = chat(
        server,
        keys["acme"],
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}],
        max_tokens=16,
    )
    assert block.text == same["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == same["usage"]["completion_tokens"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[same["choices"][0]["finish_reason"]]
    assert msg.stop_sequence is None and msg.usage.cache_read_input_tokens == 0
    counted = client.messages.count_tokens(
        model=MODEL, system="Answer in one sentence.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == msg.usage.input_tokens


def test_text_blocks_and_consecutive_turns_of_one_role_render_as_one_message(server, keys):
    """Blocks of a turn and consecutive turns of a role are one message, their texts joined by a newline."""
    client = sdk(server, keys["acme"])
    joined = chat(server, keys["acme"], [{"role": "user", "content": "What is the capital\nof France?"}], max_tokens=8)
    for messages in (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}],
            }
        ],
        [{"role": "user", "content": "What is the capital"}, {"role": "user", "content": "of France?"}],
    ):
        msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages)
        assert msg.content[0].text == joined["choices"][0]["message"]["content"]
        assert msg.usage.input_tokens == joined["usage"]["prompt_tokens"]
        assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == msg.usage.input_tokens
    # a system prompt given as text blocks, with a prompt-cache mark (accepted, changes nothing)
    system = [{"type": "text", "text": "Answer in one sentence.", "cache_control": {"type": "ephemeral"}}]
    a = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, system=system, messages=[{"role": "user", "content": QUESTION}]
    )
    b = client.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body=GREEDY,
        system="Answer in one sentence.",
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert a.content[0].text == b.content[0].text and a.usage.input_tokens == b.usage.input_tokens


def test_the_stream_follows_anthropics_event_sequence(server, keys):
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]}
    whole = post(server, "/v1/messages", body, headers={"x-api-key": keys["acme"]}).json()
    r = post(server, "/v1/messages", {**body, "stream": True}, headers={"x-api-key": keys["acme"]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-livelora-adapter-version"] == "base"
    events = sse(r.text)
    names = [name for name, _ in events]
    assert in_documented_order(names), names
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"] == r.headers["x-livelora-completion-id"] and start["content"] == []
    assert start["stop_reason"] is None and start["model"] == MODEL
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    [end] = [data for name, data in events if name == "message_delta"]
    assert end["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert end["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}
    # the SDK's stream helper reads the same reply (it drops ping events)
    sdk_body = {k: v for k, v in body.items() if k != "temperature"}
    with sdk(server, keys["acme"]).messages.stream(**sdk_body, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    documented = [k for k in kinds if k != "text"]  # "text" events are the helper's own, one per delta
    assert in_documented_order([*documented[:2], "ping", *documented[2:]]), kinds
    assert final.content[0].text == whole["content"][0]["text"] and final.stop_reason == whole["stop_reason"]
    assert final.usage.output_tokens == whole["usage"]["output_tokens"]


def test_stop_reason_says_why_a_reply_ended(server, keys):
    client = sdk(server, keys["acme"])
    question = [{"role": "user", "content": QUESTION}]
    full = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=question)
    assert full.stop_reason == "end_turn" and "Paris" in full.content[0].text
    cut = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=question)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2 and cut.stop_sequence is None
    assert full.content[0].text.startswith(cut.content[0].text)
    stopped = client.messages.create(
        model=MODEL,
        max_tokens=24,
        extra_body=GREEDY,
        messages=question,
        stop_sequences=["zzz", "Paris", "Rome", "Berlin", "Madrid"],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == full.content[0].text.split("Paris")[0]  # the sequence is not in the text
    with client.messages.stream(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=question, stop_sequences=["Paris"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence",
        "Paris",
        stopped.content[0].text,
    )
    # a control token as a stop sequence: the model's end of turn, reported as the sequence asked for
    im_end = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=question, stop_sequences=["<|im_end|>"]
    )
    assert (im_end.stop_reason, im_end.stop_sequence) == ("stop_sequence", "<|im_end|>")
    assert im_end.content[0].text == full.content[0].text


# ---------------------------------------------------------------------------------------------- refusals, errors

BASE_BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
REFUSED = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]}, "images"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "documents"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]},
        "tool",
    ),
    ({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}, "tool use"),
    ({"tool_choice": {"type": "auto"}}, "tool use"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "extended thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "MCP servers"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
        "citations",
    ),
    ({"system": [{"type": "image", "source": {}}]}, "system[0]"),
    ({"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
]


@pytest.mark.parametrize("change,named", REFUSED, ids=[n for _, n in REFUSED])
def test_what_cannot_be_honoured_is_refused_by_name(server, keys, change, named):
    h = {"x-api-key": keys["acme"]}
    err = anthropic_error(post(server, "/v1/messages", {**BASE_BODY, **change}, headers=h), 400)
    assert err["type"] == "invalid_request_error" and named in err["message"], err
    if named not in ("max_tokens", "temperature", "stop_sequences"):  # count_tokens has no such fields
        counted = post(server, "/v1/messages/count_tokens", {**BASE_BODY, **change}, headers=h)
        assert anthropic_error(counted, 400)["message"] == err["message"]


def test_errors_are_anthropics_envelope_and_the_sdk_raises_its_exceptions(server, keys):
    client = sdk(server, keys["acme"])
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and missing.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                        },
                    ],
                }
            ],
        )
    assert "messages[0].content[1]" in refused.value.message and "images" in refused.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    # raw: what the SDK would not send
    h = {"x-api-key": keys["acme"]}
    err = anthropic_error(
        post(server, "/v1/messages", {"model": MODEL, "messages": BASE_BODY["messages"]}, headers=h), 400
    )
    assert err == {"type": "invalid_request_error", "message": "invalid request: max_tokens: Field required"}
    assert "not valid JSON" in anthropic_error(post(server, "/v1/messages", b'{"model": [', headers=h), 400)["message"]
    plain = httpx.post(server.url("/v1/messages"), content="model=x", headers={**h, "content-type": "text/plain"})
    assert "content-type: application/json" in anthropic_error(plain, 400)["message"]
    # the OpenAI routes keep theirs
    openai_err = post(server, "/v1/chat/completions", {"model": "no-such-model", "messages": []}, headers=h).json()
    assert set(openai_err["error"]) == {"message", "type", "param", "code"}


def test_keys_in_either_header_and_the_inference_role(server, keys):
    for headers in ({"x-api-key": keys["acme"]}, {"Authorization": f"Bearer {keys['acme']}"}):
        assert (
            post(
                server,
                "/v1/messages/count_tokens",
                {"model": MODEL, "messages": BASE_BODY["messages"]},
                headers=headers,
            ).status_code
            == 200
        )
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert anthropic_error(post(server, path, BASE_BODY), 401)["type"] == "authentication_error"
        bad = post(server, path, BASE_BODY, headers={"x-api-key": "tml-000000000000-not-a-key"})
        assert anthropic_error(bad, 401)["type"] == "authentication_error"
        denied = post(server, path, BASE_BODY, headers={"x-api-key": keys["feedback-only"]})
        err = anthropic_error(denied, 403)
        assert err["type"] == "permission_error" and "'inference' role" in err["message"]
    with pytest.raises(anthropic.AuthenticationError):
        sdk(server, "tml-000000000000-not-a-key").messages.create(**BASE_BODY)
    with pytest.raises(anthropic.PermissionDeniedError):
        sdk(server, keys["feedback-only"]).messages.create(**BASE_BODY)


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event():
    """After ``message_start`` a failure is one ``error`` event in Anthropic's envelope (the SDK raises it)."""
    from livelora.clients.errors import RateLimitError
    from livelora.gateway.api.messages import error_event

    for exc, kind in ((RuntimeError("engine died"), "api_error"), (RateLimitError("busy"), "rate_limit_error")):
        event = error_event(exc)
        assert event["event"] == "error"
        data = json.loads(event["data"])
        assert data["type"] == "error" and data["error"]["type"] == kind and set(data["error"]) == {"type", "message"}


# ---------------------------------------------------------------------------------------------- logged, rated


def test_replies_are_logged_metered_and_rated_like_chat_completions(server, keys):
    h = {"Authorization": f"Bearer {keys['acme']}"}
    assert post(server, "/admin/endpoints", {"name": "acme.bot", "lineage": "acme.bot"}, headers=h).status_code == 201

    def metered() -> dict[str, int]:
        rows = httpx.get(server.url("/admin/usage"), params={"group_by": "kind"}, headers=h, timeout=30).json()["data"]
        return {row["kind"]: row["tokens"] for row in rows}

    before = metered()
    msg = sdk(server, keys["acme"]).messages.create(
        model="acme.bot",
        max_tokens=6,
        extra_body=GREEDY,
        system="Be brief.",
        metadata={"user_id": "carol"},
        messages=[{"role": "user", "content": QUESTION}],
    )
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    record = json.loads(client.get(KeyLayout(PREFIX).completion(msg.id)))
    client.close()
    assert record["endpoint"] == "acme.bot" and record["user"] == "carol" and record["caller"] == "acme"
    assert record["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert record["completion"] == msg.content[0].text
    assert len(record["prompt_token_ids"]) == msg.usage.input_tokens
    assert len(record["completion_token_ids"]) == msg.usage.output_tokens
    assert wait_until(
        lambda: metered().get("completion", 0) - before.get("completion", 0) == msg.usage.output_tokens, timeout_s=30
    )
    assert metered().get("prompt", 0) - before.get("prompt", 0) == msg.usage.input_tokens
    rated = post(server, "/v1/feedback", {"completion_id": msg.id, "rating": True, "user": "carol"}, headers=h)
    assert rated.status_code == 200 and rated.json()["endpoint"] == "acme.bot", rated.text


def test_the_docs_example_runs(server, keys, monkeypatch):
    """docs/clients.md's Anthropic block, verbatim but for the URL, with a key of tenant default (whose ratings train
    the base endpoint)."""
    [block] = [b for b in blocks(REPO / "docs" / "clients.md") if "import anthropic" in b.code]
    monkeypatch.setenv("LIVELORA_API_KEY", keys["default"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code.replace("http://127.0.0.1:8000", server.base_url), "docs/clients.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert "Paris" in lines[0] and "end_turn" in lines[0], lines
    assert lines[1] == "True" and lines[2].strip()  # the completion id header; the streamed colour
    assert int(lines[3]) > 10 and lines[4].startswith("200 {") and f"'endpoint': '{MODEL}'" in lines[4]


# ---------------------------------------------------------------------------------------------- the live loop


def test_feedback_on_replies_trains_the_version_the_next_reply_is_served_by(base_ref, tmp_path):
    """Eight rated ``/v1/messages`` replies make one KTO step (the default ``kto_min_batch``); the endpoint moves to
    the new version and the next ``/v1/messages`` reply is served by it."""
    from livelora.core.bus import connect_sync
    from livelora.gateway.settings import GatewaySettings
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.scheduler import BatchScheduler
    from livelora.trainer.settings import TrainingSection
    from livelora.trainer.signal_governor import FeedbackGovernor
    from livelora.trainer.worker import TrainerWorker

    endpoint = "messages-e2e"
    layout = KeyLayout(f"livelora-test-{uuid.uuid4().hex}:")
    settings = GatewaySettings(
        model=str(base_ref.path),
        served_model_name=endpoint,
        home=tmp_path,
        redis_prefix=layout.prefix,
        max_batch_size=4,
        device="cpu",
    )
    live = start_server(settings)
    client = anthropic.Anthropic(base_url=live.base_url, api_key="unused", max_retries=0)
    bus = connect_sync("redis://127.0.0.1:6379/0")
    try:
        prompts = ["Name a colour.", "Say hello.", "What is 2+2?", "Name a fruit.", "Count to three.", "Name a city."]
        replies = [
            client.messages.with_raw_response.create(
                model=endpoint, max_tokens=6, messages=[{"role": "user", "content": prompts[i % len(prompts)]}]
            )
            for i in range(8)
        ]
        assert {r.headers["x-livelora-adapter-version"] for r in replies} == {"base"}
        for i, raw in enumerate(replies):
            rated = httpx.post(
                live.url("/v1/feedback"), json={"completion_id": raw.parse().id, "rating": i % 2 == 0}, timeout=30
            )
            assert rated.status_code == 200 and rated.json()["endpoint"] == endpoint, rated.text
        worker = TrainerWorker(
            bus,
            layout,
            tmp_path,
            OnlineTrainer(base_ref, tmp_path, TrainingSection()),
            BatchScheduler(TrainingSection()),
            consumer="messages-e2e",
            block_ms=200,
            governor=FeedbackGovernor(bus, layout, tmp_path, max_events=0, window_s=60),
        )
        [notice] = worker.poll()
        assert notice.name == f"{endpoint}@1" and notice.endpoint == endpoint
        assert wait_until(lambda: live.services.registry.current.get(endpoint) == f"{endpoint}@1", timeout_s=300)
        after = client.messages.with_raw_response.create(
            model=endpoint, max_tokens=6, messages=[{"role": "user", "content": "Name a colour."}]
        )
        assert after.headers["x-livelora-adapter-version"] == f"{endpoint}@1"
        record = json.loads(bus.get(layout.completion(after.parse().id)))
        assert record["adapter"] == f"{endpoint}@1" and record["endpoint"] == endpoint
    finally:
        live.stop()
        for k in bus.scan_iter(match=layout.prefix + "*"):
            bus.delete(k)
        bus.close()
