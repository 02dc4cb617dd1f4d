"""Errors through a live gateway: every failure is an OpenAI envelope with the right status, never a 422 or 500."""

from __future__ import annotations

import httpx
import openai
import pytest
from harness.server import MODEL

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        yield client


def envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_json_is_400_envelope(http):
    response = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    error = envelope(response, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def test_missing_and_mistyped_fields_are_400_naming_param_not_422(http):
    assert envelope(http.post(CHAT, json={"model": MODEL}), 400)["param"] == "messages"
    assert envelope(http.post(CHAT, json={"messages": HI}), 400)["param"] == "model"
    assert envelope(http.post(CHAT, json={"model": MODEL, "messages": []}), 400)["param"] == "messages"
    assert (
        envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "temperature": 3}), 400)["param"]
        == "temperature"
    )
    assert envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "n": "two"}), 400)["param"] == "n"
    assert (
        envelope(http.post(CHAT, json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400)["param"]
        == "messages[0].role"
    )
    assert (
        envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "stop": ["a", "b", "c", "d", "e"]}), 400)[
            "param"
        ]
        == "stop"
    )
    assert envelope(http.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize(
    "extra,param,code",
    [
        ({"temperature": -1}, "temperature", "decimal_below_min_value"),
        ({"temperature": 5}, "temperature", "decimal_above_max_value"),
        ({"top_p": 2}, "top_p", "decimal_above_max_value"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": 500}, "n", "integer_above_max_value"),  # above the schema's bound
        ({"n": 100}, "n", "integer_above_max_value"),  # within it, above what this server admits at once (16)
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "invalid_parameter_combination"),
    ],
)
def test_out_of_range_values_have_openais_codes(http, extra, param, code):
    """Range errors say the bound's side and whether the field is an integer or a decimal, as OpenAI's codes do."""
    error = envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 1, **extra}), 400)
    assert (error["param"], error["code"]) == (param, code), error


def test_unknown_route_is_404_envelope_and_wrong_method_405(http):
    error = envelope(http.get("/v1/nothing-here"), 404)
    assert error["code"] == "unknown_url"
    assert envelope(http.get(CHAT), 405)["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=str(http.base_url) + "/v2", api_key="x", max_retries=0).models.list()


def test_both_max_token_fields_is_invalid_parameter_combination(http):
    error = envelope(
        http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 4, "max_completion_tokens": 4}), 400
    )
    assert error["code"] == "invalid_parameter_combination" and error["param"] == "max_tokens"


@pytest.mark.parametrize("field,value", [("logit_bias", {"42": 5})])
def test_unsupported_sampling_values_are_400_naming_param(http, field, value):
    error = envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 1, field: value}), 400)
    assert error["param"] == field and error["code"] == "unsupported_parameter"


def test_default_values_of_unsupported_parameters_are_accepted(http):
    body = {
        "model": MODEL,
        "messages": HI,
        "max_tokens": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "top_logprobs": 0,
        "stream": False,
        "stream_options": None,
        "seed": None,
        "stop": None,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text


def test_image_content_part_is_400_naming_the_part(http):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
            ],
        }
    ]
    error = envelope(http.post(CHAT, json={"model": MODEL, "messages": messages}), 400)
    assert error["param"] == "messages[0].content[1]" and "image_url" in error["message"]


def test_audio_output_and_functions_are_rejected_naming_param(http):
    assert (
        envelope(http.post(CHAT, json={"model": MODEL, "messages": HI, "modalities": ["text", "audio"]}), 400)["param"]
        == "modalities"
    )
    assert (
        envelope(
            http.post(CHAT, json={"model": MODEL, "messages": HI, "functions": [{"name": "f", "parameters": {}}]}), 400
        )["param"]
        == "functions"
    )


def test_errors_leave_no_sequences_admitted(http, live_server):
    for body in (
        {"model": MODEL, "messages": HI, "max_tokens": 0},
        {"model": "nope", "messages": HI},
        {"model": MODEL, "messages": HI, "max_tokens": 10**9, "stream": True},
    ):
        assert http.post(CHAT, json=body).status_code in (400, 404)
    assert live_server.admission.active == 0
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["sequences"] == 0 and health["model"] == MODEL
    assert isinstance(health["adapters_loaded"], int) and "adapters" not in health  # no names without a key
