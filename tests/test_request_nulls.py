"""An explicit ``null`` for an optional field means "not given", in every request schema (issue 14, case 3).

The cases are generated from the schemas: every request model (every subclass of
:class:`livelora.clients.types.nulls.NullMeansOmitted`: OpenAI routes, signal routes, admin routes, Tinker
bodies) and every one of its optional fields, so a field or a model added later is covered. A minimal valid body
of each model is generated from its JSON schema (a few models whose validators need more get a hand-written
one). Then the live gateway answers requests whose optional fields are all ``null`` on the chat, completions,
signal and Tinker sampling routes.
"""

from __future__ import annotations

import importlib

import httpx
import pytest
from harness.server import MODEL
from pydantic import BaseModel, ValidationError

from livelora.clients.types.nulls import NullMeansOmitted, optional_keys

MODULES = [
    "livelora.clients.types.openai",
    "livelora.clients.types.anthropic",
    "livelora.clients.types.signals",
    "livelora.clients.types.admin",
    "livelora.clients.types.tinker",
    "livelora.clients.types.tinker_ext",
    "livelora.clients.types.tinker_rest",
]
#: Bodies for models whose validators need more than their schema says (cross-field rules), by (module, class);
#: used for the model itself and wherever it is nested.
HAND_MADE = {
    ("openai", "ChatMessage"): {"role": "user", "content": "hi"},
    ("tinker_data", "TensorData"): {"data": [1.0], "dtype": "float32"},
}


def request_models() -> list[type[BaseModel]]:
    for name in MODULES:
        importlib.import_module(name)
    out, todo = [], list(NullMeansOmitted.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.model_fields and not cls.__name__.startswith("_"):
            out.append(cls)
    return sorted(set(out), key=lambda c: f"{c.__module__}.{c.__qualname__}")


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def example(schema: dict, defs: dict, hand: dict) -> object:
    """A small value that satisfies ``schema`` (required properties only); ``hand``: bodies by model name."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return dict(hand[name]) if name in hand else example(defs[name], defs, hand)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [s for s in schema[key] if s.get("type") != "null"]
            return example(options[0], defs, hand)
    kind = schema.get("type")
    if kind == "object":
        return {k: example(schema["properties"][k], defs, hand) for k in schema.get("required", [])}
    if kind == "array":
        return [example(schema.get("items", {}), defs, hand) for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        return "x" * max(1, schema.get("minLength", 1))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + (1 if "exclusiveMinimum" in schema else 0))
        value = max(1, low)
        value = min(value, schema.get("maximum", value))
        return value if kind == "integer" else float(value)
    if kind == "boolean":
        return True
    return "x"


def minimal(cls: type[BaseModel]) -> dict:
    module = cls.__module__.rsplit(".", 1)[-1]
    hand = {name: body for (mod, name), body in HAND_MADE.items() if mod == module}
    if cls.__name__ in hand:
        return dict(hand[cls.__name__])
    schema = cls.model_json_schema()
    return example(schema, schema.get("$defs", {}), hand)


MODELS = request_models()


def test_every_wire_module_is_covered_and_bodies_validate():
    names = {qualname(c) for c in MODELS}
    for expected in (
        "openai.ChatCompletionRequest",
        "openai.CompletionRequest",
        "anthropic.MessagesRequest",
        "anthropic.CountTokensRequest",
        "signals.FeedbackRequest",
        "signals.PreferenceRequest",
        "signals.DemonstrationRequest",
        "admin.CreateEndpointRequest",
        "admin.PromoteRequest",
        "tinker_sampling.SampleRequest",
        "tinker_sampling.SamplingParams",
        "tinker_training.ForwardBackwardRequest",
        "tinker_training.CreateModelRequest",
    ):
        assert f"livelora.clients.types.{expected}" in names
    for cls in MODELS:
        try:
            cls.model_validate(minimal(cls))
        except ValidationError as exc:  # pragma: no cover - the message says which body to hand-write
            pytest.fail(f"{qualname(cls)}: the generated body does not validate; add one to HAND_MADE: {exc}")


def test_every_request_body_of_the_app_is_a_null_tolerant_model(live_server):
    """Each JSON body in the app's OpenAPI is one of the models above (the Tinker routes decode their bodies with
    the ``tinker`` models, all ``StrictModel`` subclasses, also above)."""
    by_name = {c.__name__: c for c in MODELS}
    bodies = []
    for path, operations in live_server.app.openapi()["paths"].items():
        for method, op in operations.items():
            schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if schema is not None:
                # a component reference, or (Tinker routes: openapi_extra) the model's schema inlined, titled by it
                bodies.append(
                    (method, path, schema["$ref"].rsplit("/", 1)[-1] if "$ref" in schema else schema["title"])
                )
    assert len(bodies) >= 10  # chat, completions, 3 signal routes, 5 admin bodies
    for method, path, name in bodies:
        assert name in by_name and issubclass(by_name[name], NullMeansOmitted), f"{method} {path}: {name}"


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}")
def test_null_for_each_optional_field_is_the_default(cls):
    body = minimal(cls)
    cls.model_validate(body)
    optional = [name for name, info in cls.model_fields.items() if not info.is_required()]
    assert set(optional) <= optional_keys(cls)
    for name in optional:
        key = cls.model_fields[name].alias or name
        omitted = {k: v for k, v in body.items() if k != key}
        try:
            want = cls.model_validate(omitted)
        except ValidationError:  # leaving it out is refused (a cross-field rule): so is null
            with pytest.raises(ValidationError):
                cls.model_validate({**body, key: None})
            continue
        got = cls.model_validate({**body, key: None})
        assert got == want, f"{cls.__name__}.{name}: null gave {getattr(got, name)!r}, omitted {getattr(want, name)!r}"
        assert getattr(got, name) == cls.model_fields[name].get_default(call_default_factory=True)
    required = [name for name, info in cls.model_fields.items() if info.is_required()]
    for name in required:  # null for a required field stays an error
        with pytest.raises(ValidationError):
            cls.model_validate({**body, cls.model_fields[name].alias or name: None})


def test_issue_example_n_null_on_the_models():
    from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": None}
    )
    assert chat.n == 1
    legacy = CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": None, "max_tokens": None})
    assert legacy.n == 1 and legacy.max_tokens == 16


# ------------------------------------------------------------------------------------------ through the gateway


def all_null(cls: type[BaseModel], keep: dict) -> dict:
    """``keep`` plus ``null`` for every other optional field of ``cls``."""
    return {**{name: None for name, info in cls.model_fields.items() if not info.is_required()}, **keep}


def test_generation_routes_take_null_for_every_optional_field(live_server):
    from livelora.clients.types.openai import ChatCompletionRequest, CompletionRequest

    # the budget stays set: a null budget is the default (the rest of the context / 16 tokens), slow on a CPU
    chat = all_null(
        ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    r = httpx.post(live_server.url("/v1/chat/completions"), json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    legacy = all_null(CompletionRequest, {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    r = httpx.post(live_server.url("/v1/completions"), json=legacy, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 2
    from livelora.clients.types.anthropic import MessagesRequest

    messages = all_null(
        MessagesRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    r = httpx.post(live_server.url("/v1/messages"), json=messages, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 2, r.text
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):  # the issue's case
        r = httpx.post(live_server.url(path), json={"model": MODEL, "n": None, "max_tokens": 1, **body}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_signal_routes_take_null_for_every_optional_field(live_server):
    from livelora.clients.types.signals import DemonstrationRequest, FeedbackRequest, PreferenceRequest

    served = httpx.post(
        live_server.url("/v1/chat/completions"),
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ).json()
    bodies = {
        "/v1/feedback": all_null(FeedbackRequest, {"completion_id": served["id"], "rating": True}),
        "/v1/preferences": all_null(
            PreferenceRequest,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "chosen": "Hello!",
                "rejected": "Go away.",
            },
        ),
        "/v1/demonstrations": all_null(
            DemonstrationRequest,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            },
        ),
    }
    for path, body in bodies.items():
        r = httpx.post(live_server.url(path), json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert r.json()["user"] is None


def test_tinker_sampling_takes_null_for_every_optional_field(live_server, tokenizer):
    from livelora.clients.types.tinker import SampleRequest, SamplingParams

    params = all_null(SamplingParams, {"max_tokens": 2})
    body = all_null(
        SampleRequest,
        {
            "base_model": MODEL,
            "sampling_params": params,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("Hi")}]},
        },
    )
    r = httpx.post(live_server.url("/api/v1/asample"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    while True:
        got = httpx.post(
            live_server.url("/api/v1/retrieve_future"), json={"request_id": r.json()["request_id"]}, timeout=120
        )
        if got.status_code != 408:
            break
    assert got.status_code == 200, got.text
    (seq,) = got.json()["sequences"]  # num_samples null = 1
    assert 1 <= len(seq["tokens"]) <= 2
