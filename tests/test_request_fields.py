"""Request fields honoured or refused (issue 29): one policy, generated from the request types and the field table
of ``gateway/services/serving/request_fields.py``, so a new field fails here until it is classified.

Every declared field of the chat and legacy completion requests is in the table; every OpenAI field without
effect is accepted, every refused field is a 400 naming it, an unknown field is a 400 ``unknown_parameter`` (or,
with ``LIVELORA_UNKNOWN_FIELDS=ignore``, served and named in a header). The vLLM extensions are honoured:
``continue_final_message`` / ``add_generation_prompt`` against the template rendered by hand, ``min_tokens``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``stop_token_ids``. Real SmolLM2, live gateway.
"""

from __future__ import annotations

import httpx
import pytest
from harness.server import MODEL

from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest
from livelora.gateway.services.serving.request_fields import HONOURED, IGNORED_HEADER, NEUTRAL_ONLY, NO_EFFECT, REFUSED

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
LIST = [{"role": "user", "content": "List three fruits."}, {"role": "assistant", "content": "1. Apple\n2."}]
#: A value each refused / neutral-only field cannot be served with (any other refused field: ``1``).
REFUSED_VALUES = {
    "modalities": ["text", "audio"],
    "echo": True,
}
BODIES = {
    CHAT: {"messages": MESSAGES, "max_tokens": 4},
    COMPLETIONS: {"prompt": "The capital of France is", "max_tokens": 4},
}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, "temperature": 0, **body}, timeout=180)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.unit
@pytest.mark.parametrize("route,model", [("chat", ChatCompletionRequest), ("completions", CompletionRequest)])
def test_every_declared_field_is_classified(route, model):
    declared = set(model.model_fields)
    classified = HONOURED[route] | set(NO_EFFECT) | set(NEUTRAL_ONLY)
    assert declared <= classified, f"classify {sorted(declared - classified)} in request_fields.py"
    assert not set(REFUSED) & declared - {"echo", "response_format", "max_completion_tokens", "top_logprobs"}
    assert HONOURED[route] <= declared


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_fields_without_effect_are_accepted(live_server, path):
    body = {name: "x" if name != "store" else False for name in NO_EFFECT if name != "parallel_tool_calls"}
    if path == CHAT:
        body["parallel_tool_calls"] = True
    r = post(live_server, path, {**BODIES[path], **body})
    assert r.status_code == 200, r.text
    assert IGNORED_HEADER.lower() not in r.headers


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_each_refused_field_is_400_naming_it(live_server, path):
    declared = set((ChatCompletionRequest if path == CHAT else CompletionRequest).model_fields)
    names = [n for n in (*REFUSED, *NEUTRAL_ONLY) if n not in declared or n in NEUTRAL_ONLY]
    for name in names:
        error = error_of(post(live_server, path, {**BODIES[path], name: REFUSED_VALUES.get(name, 1)}))
        assert error["param"] == name and error["code"] == "unsupported_parameter", (name, error)
    for name, (served, _why) in NEUTRAL_ONLY.items():  # the one value served is accepted
        assert post(live_server, path, {**BODIES[path], name: served[0]}).status_code == 200, name


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_field_is_400_unless_the_setting_ignores_it(live_server, path, monkeypatch):
    error = error_of(post(live_server, path, {**BODIES[path], "foo_bar": 1}))
    assert error == {
        "message": "Unrecognized request argument supplied: foo_bar",
        "type": "invalid_request_error",
        "param": "foo_bar",
        "code": "unknown_parameter",
    }
    monkeypatch.setattr(live_server.services.settings.inference, "unknown_fields", "ignore")
    r = post(live_server, path, {**BODIES[path], "foo_bar": 1, "zz": None})
    assert r.status_code == 200 and r.headers[IGNORED_HEADER] == "foo_bar, zz"


def template(live_server, messages, **kw) -> str:
    return live_server.engine.tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def test_continue_final_message_continues_the_assistant_prefix(live_server):
    body = {"messages": LIST, "max_tokens": 12}
    new_turn = post(live_server, CHAT, body).json()
    cont = post(live_server, CHAT, {**body, "continue_final_message": True, "add_generation_prompt": False}).json()
    prefix = template(live_server, LIST, continue_final_message=True)
    assert prefix.endswith("1. Apple\n2.")
    raw = post(live_server, COMPLETIONS, {"prompt": prefix, "max_tokens": 12}).json()
    assert cont["choices"][0]["message"]["content"] == raw["choices"][0]["text"]
    assert cont["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    assert cont["choices"][0]["message"]["content"] != new_turn["choices"][0]["message"]["content"]
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    assert error_of(post(live_server, CHAT, both))["param"] == "continue_final_message"
    last_user = {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False}
    assert error_of(post(live_server, CHAT, last_user))["param"] == "continue_final_message"


def test_add_generation_prompt_false_and_chat_template_kwargs(live_server):
    no_header = post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": False})
    text = template(live_server, MESSAGES, add_generation_prompt=False)
    n = len(live_server.engine.tokenizer.encode(text, add_special_tokens=False))
    assert no_header.json()["usage"]["prompt_tokens"] == n
    with_kwargs = post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"x": 1}})
    assert with_kwargs.status_code == 200, with_kwargs.text
    clash = {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}
    assert error_of(post(live_server, CHAT, clash))["param"] == "chat_template_kwargs"


def test_min_tokens_stop_strings_special_tokens_and_stop_token_ids(live_server):
    natural = post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 40}).json()
    k = natural["usage"]["completion_tokens"]
    assert natural["choices"][0]["finish_reason"] == "stop" and k < 30
    longer = post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 40, "min_tokens": k + 5}).json()
    assert longer["usage"]["completion_tokens"] >= k + 5
    assert error_of(post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 4, "min_tokens": 5}))["param"] == (
        "min_tokens"
    )
    cut = post(live_server, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8, "stop": ["Paris"]})
    kept = post(
        live_server,
        COMPLETIONS,
        {"prompt": "The capital of France is", "max_tokens": 8, "stop": ["Paris"], "include_stop_str_in_output": True},
    )
    assert kept.json()["choices"][0]["text"] == cut.json()["choices"][0]["text"] + "Paris"
    forced = {"messages": MESSAGES, "max_tokens": k + 3, "ignore_eos": True}
    assert "<|im_end|>" not in post(live_server, CHAT, forced).json()["choices"][0]["message"]["content"]
    raw = post(live_server, CHAT, {**forced, "skip_special_tokens": False}).json()["choices"][0]["message"]["content"]
    assert "<|im_end|>" in raw
    text = natural["choices"][0]["message"]["content"]
    second = live_server.engine.tokenizer.encode(text, add_special_tokens=False)[1]  # the first token, then it
    stopped = post(live_server, CHAT, {"messages": MESSAGES, "max_tokens": 40, "stop_token_ids": [second]}).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
