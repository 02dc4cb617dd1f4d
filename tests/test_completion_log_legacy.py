"""The legacy ``/v1/completions`` route records what it serves in the completion log (live gateway, real Redis,
real SmolLM2 model): exact prompt and generated token ids with their logprobs, ``{id}-{k}`` per choice when
a response has several, only the generated part with ``echo``; ``/v1/feedback`` rates them and the trainer
turns the rating into a KTO datum over those exact ids."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import redis
from harness.server import MODEL, sse_events

from livelora.clients.types.signals import RatingEvent, parse_stream_event
from livelora.core.redis_keys import KeyLayout
from livelora.gateway.services.serving.serve import VERSION_HEADER

PROMPT = "The capital of France is"
PROMPT2 = "Two plus two is"


@pytest.fixture(scope="module")
def store():
    """``(redis client, keys)`` of the shared server's session prefix."""
    client = redis.Redis.from_url(
        os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"), decode_responses=True
    )
    yield client, KeyLayout(os.environ["LIVELORA_REDIS_PREFIX"])
    client.close()


def record(store, cid: str) -> dict:
    client, keys = store
    raw = client.get(keys.completion(cid))
    assert raw is not None, f"completion {cid} is not in the completion log"
    rec = json.loads(raw)
    if rec.get("prompt_of") is not None:  # several choices: the prompt is kept once, in the response's record
        assert rec["messages"] is None and rec["prompt"] is None and rec["prompt_token_ids"] == []
        shared = json.loads(client.get(keys.completion(rec["prompt_of"])))
        entry = shared["prompts"][rec["prompt_index"]]
        rec.update(messages=shared["messages"], prompt=entry["prompt"], prompt_token_ids=entry["prompt_token_ids"])
    return rec


def complete(live_server, **body) -> httpx.Response:
    response = httpx.post(
        live_server.url("/v1/completions"), timeout=120, json={"model": MODEL, "temperature": 0, **body}
    )
    assert response.status_code == 200, response.text
    return response


def streamed(response: httpx.Response) -> tuple[str, dict[int, str], dict | None]:
    """``(id, text per choice index, usage)`` of an SSE response."""
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert len({c["id"] for c in chunks}) == 1
    return chunks[0]["id"], texts, chunks[-1]["usage"]


def check_served(rec: dict, response: httpx.Response, tokenizer, prompt: str, text: str, user=None) -> None:
    """The record of a single-prompt response holds what was served, as exact token ids."""
    assert rec["messages"] is None and rec["prompt"] == prompt
    assert rec["prompt_token_ids"] == list(tokenizer.encode(prompt))
    assert rec["completion"] == text and text
    assert tokenizer.decode(rec["completion_token_ids"]) == text
    assert len(rec["logprobs"]) == len(rec["completion_token_ids"]) > 0
    assert all(lp <= 0 for lp in rec["logprobs"])
    assert rec["endpoint"] == MODEL and rec["model"] == MODEL and rec["user"] == user and rec["caller"] is None
    version = response.headers[VERSION_HEADER]
    assert rec["adapter"] == (None if version == "base" else version)


def rate(live_server, store, cid: str, rating: bool) -> RatingEvent:
    """Rate ``cid`` through the gateway and return the signal event it put on the stream."""
    r = httpx.post(live_server.url("/v1/feedback"), json={"completion_id": cid, "rating": rating}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["completion_id"] == cid and r.json()["endpoint"] == MODEL
    client, keys = store
    events = [parse_stream_event(fields) for _, fields in client.xrange(keys.signals)]
    [ev] = [e for e in events if e.id == r.json()["id"]]
    assert isinstance(ev, RatingEvent)
    return ev


def test_non_streaming_completion_is_logged_with_exact_tokens_and_rateable(live_server, store, tokenizer):
    response = complete(live_server, prompt=PROMPT, max_tokens=5, user="alice")
    body = response.json()
    choice = body["choices"][0]
    assert choice["logprobs"] is None  # recorded, not returned unasked
    rec = record(store, body["id"])
    check_served(rec, response, tokenizer, PROMPT, choice["text"], user="alice")
    assert len(rec["completion_token_ids"]) == body["usage"]["completion_tokens"] == 5
    assert rec["finish_reason"] == choice["finish_reason"] == "length"
    assert rec["id"] == body["id"] and rec["created"] == body["created"]

    # with logprobs requested, the response's per-token view matches the record token by token
    response = complete(live_server, prompt=PROMPT, max_tokens=5, logprobs=1)
    body = response.json()
    lp = body["choices"][0]["logprobs"]
    rec = record(store, body["id"])
    assert [tokenizer.decode([t]) for t in rec["completion_token_ids"]] == lp["tokens"]
    assert rec["logprobs"] == lp["token_logprobs"]

    ev = rate(live_server, store, body["id"], True)
    assert ev.completion_id == body["id"] and ev.rating is True
    assert ev.prompt_token_ids == rec["prompt_token_ids"]
    assert ev.completion_token_ids == rec["completion_token_ids"]
    assert ev.logprobs == rec["logprobs"] and ev.finish_reason == "length"


def test_streaming_completion_is_logged_and_its_rating_trains_on_the_exact_ids(
    live_server, store, tokenizer, base_ref, tmp_path
):
    response = complete(
        live_server, prompt=PROMPT, max_tokens=6, stream=True, stream_options={"include_usage": True}, user="bob"
    )
    cid, texts, usage = streamed(response)
    assert list(texts) == [0]
    rec = record(store, cid)
    check_served(rec, response, tokenizer, PROMPT, texts[0], user="bob")
    assert len(rec["completion_token_ids"]) == usage["completion_tokens"] == 6

    ev = rate(live_server, store, cid, False)
    assert ev.prompt_token_ids == rec["prompt_token_ids"]
    assert ev.completion_token_ids == rec["completion_token_ids"] and ev.rating is False

    # the trainer builds its KTO datum from exactly these ids (the record has messages=None)
    from livelora.trainer.online import OnlineTrainer
    from livelora.trainer.scheduler import Batch

    trainer = OnlineTrainer(base_ref, tmp_path)
    data, loss_fn, cfg, _ = trainer.datums(Batch(lineage=MODEL, kind="kto", events=[ev], stream_ids=["0-1"]))
    assert loss_fn == "kto" and cfg["beta"] > 0
    [datum] = data
    completion = trainer.rated_completion(ev)
    assert completion == rec["completion_token_ids"]  # finish_reason "length": nothing appended
    tokens = rec["prompt_token_ids"] + rec["completion_token_ids"]
    assert datum.model_input.to_ints() == tokens[:-1]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
    weights = datum.loss_fn_inputs["weights"].tolist()
    assert weights == [0.0] * (len(rec["prompt_token_ids"]) - 1) + [1.0] * len(completion)
    assert datum.loss_fn_inputs["label"].tolist() == [0.0]


def test_multi_prompt_choices_are_logged_per_choice(live_server, store, tokenizer):
    response = complete(live_server, prompt=[PROMPT, PROMPT2], n=2, max_tokens=3)
    body = response.json()
    cid = body["id"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    client, keys = store
    shared = json.loads(client.get(keys.completion(cid)))  # several choices: {id} keeps each prompt once
    assert shared["kind"] == "prompt" and shared["choices"] == 4
    assert [p["prompt"] for p in shared["prompts"]] == [PROMPT, PROMPT2]
    for k, choice in enumerate(body["choices"]):
        prompt = [PROMPT, PROMPT2][k // 2]
        rec = record(store, f"{cid}-{k}")
        assert rec["id"] == f"{cid}-{k}"
        check_served(rec, response, tokenizer, prompt, choice["text"])
        assert len(rec["completion_token_ids"]) == 3
    assert (
        sum(len(record(store, f"{cid}-{k}")["completion_token_ids"]) for k in range(4))
        == body["usage"]["completion_tokens"]
    )
    ev = rate(live_server, store, f"{cid}-3", True)
    assert ev.completion_id == f"{cid}-3"
    assert ev.prompt_token_ids == list(tokenizer.encode(PROMPT2))
    assert ev.completion_token_ids == record(store, f"{cid}-3")["completion_token_ids"]

    # streamed, from token-id prompts: same scheme; the prompt text is decoded from the ids
    ids = [list(tokenizer.encode(PROMPT)), list(tokenizer.encode(PROMPT2))]
    response = complete(live_server, prompt=ids, max_tokens=3, stream=True)
    sid, texts, _ = streamed(response)
    assert sorted(texts) == [0, 1]
    for k in range(2):
        rec = record(store, f"{sid}-{k}")
        assert rec["prompt_token_ids"] == ids[k] and rec["prompt"] == [PROMPT, PROMPT2][k]
        assert rec["completion"] == texts[k] == tokenizer.decode(rec["completion_token_ids"])
        assert len(rec["completion_token_ids"]) == len(rec["logprobs"]) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_records_only_the_generated_tokens(live_server, store, tokenizer, stream):
    response = complete(live_server, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, stream=stream)
    if stream:
        cid, texts, _ = streamed(response)
        text = texts[0]
    else:
        body = response.json()
        cid, text = body["id"], body["choices"][0]["text"]
        lp = body["choices"][0]["logprobs"]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    plain = text[len(PROMPT) :]
    rec = record(store, cid)
    check_served(rec, response, tokenizer, PROMPT, plain)
    assert len(rec["completion_token_ids"]) == 4
    if not stream:  # the response's logprobs cover prompt + completion; the record only the completion
        n_prompt = len(rec["prompt_token_ids"])
        assert len(lp["token_logprobs"]) == n_prompt + 4
        assert rec["logprobs"] == lp["token_logprobs"][n_prompt:]
    ev = rate(live_server, store, cid, True)
    assert ev.completion_token_ids == rec["completion_token_ids"]
    assert ev.prompt_token_ids == rec["prompt_token_ids"]
