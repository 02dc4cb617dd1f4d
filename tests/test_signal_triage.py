"""One bad signal never takes good ones with it (issue 14, case 4).

At the door: a demonstration, preference or rating the trainer could not fit in its context is a 400
``context_length_exceeded`` naming the limit (tokenized as the trainer will), and nothing is queued; good ones
sent alongside are accepted. In the trainer: a bad event that still reaches it is dead-lettered alone
(``rejected.jsonl``) while the rest of its batch trains, for every signal kind. Real SmolLM2, real Redis.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis
from harness.server import MODEL

from livelora.adapters.store import AdapterStore
from livelora.clients.types.signals import (
    ChatMessage,
    CompletionRecord,
    DemonstrationEvent,
    PreferenceEvent,
    RatingEvent,
)
from livelora.core.chat_tokens import model_context_length
from livelora.core.redis_keys import TRAINERS_GROUP
from livelora.trainer.online import OnlineTrainer
from livelora.trainer.scheduler import BatchScheduler
from livelora.trainer.settings import TrainingSection
from livelora.trainer.worker import TRAINED_FILE, TrainerWorker, dataset_dir

LONG = "lorem " * 9000  # about 9,000 tokens: more than SmolLM2's 8,192-token context


def test_trainer_context_is_the_models(base_ref):
    assert model_context_length(base_ref) == 8192


# ------------------------------------------------------------------------------------------ at the door


@pytest.fixture
def door(live_server):
    signals = live_server.services.signals
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    yield live_server, client, signals.keys
    client.close()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def assert_too_long(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "maximum context length is 8192 tokens" in err["message"], err


def test_door_refuses_a_too_long_demonstration_and_accepts_the_good_ones(door):
    server, client, keys = door
    before = client.xlen(keys.signals)
    good = [
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}."},
            ],
        }
        for i in range(3)
    ]
    assert [post(server, "/v1/demonstrations", g).status_code for g in good] == [200, 200, 200]
    bad = {"model": MODEL, "messages": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Ok."}]}
    assert_too_long(post(server, "/v1/demonstrations", bad), "messages")
    assert client.xlen(keys.signals) == before + 3  # the bad one was not queued


def test_door_refuses_too_long_inline_preferences(door):
    server, client, keys = door
    before = client.xlen(keys.signals)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "chosen": "Hello!", "rejected": "Bye."}
    assert post(server, "/v1/preferences", base).status_code == 200
    assert_too_long(post(server, "/v1/preferences", {**base, "chosen": LONG}), "chosen")
    assert_too_long(post(server, "/v1/preferences", {**base, "rejected": LONG}), "rejected")
    assert_too_long(
        post(server, "/v1/preferences", {**base, "messages": [{"role": "user", "content": LONG}]}), "chosen"
    )
    assert client.xlen(keys.signals) == before + 1


def record(client, keys, prompt_len: int, completion_len: int) -> str:
    """A completion record as a gateway with a longer context than the trainer's would log it."""
    rec = CompletionRecord(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        endpoint=MODEL,
        model=MODEL,
        prompt_token_ids=[28] * prompt_len,
        completion_token_ids=[30] * completion_len,
        completion="x",
        finish_reason="stop",
        created=int(time.time()),
    )
    client.set(keys.completion(rec.id), rec.model_dump_json(), ex=600)
    return rec.id


def test_door_refuses_ratings_and_completion_preferences_beyond_the_trainer_context(door):
    server, client, keys = door
    before = client.xlen(keys.signals)
    fits = record(client, keys, 8000, 191)  # 8000 + 191 + EOS − 1 = 8191 tokens: fits
    edge = record(client, keys, 8000, 192)  # 8192 + 1 (the EOS a stop reply trains with) − 1 = 8192: fits
    over = record(client, keys, 8000, 194)  # 8194: does not
    assert post(server, "/v1/feedback", {"completion_id": fits, "rating": True}).status_code == 200
    assert post(server, "/v1/feedback", {"completion_id": edge, "rating": False}).status_code == 200
    assert_too_long(post(server, "/v1/feedback", {"completion_id": over, "rating": True}), "completion_id")
    other = record(client, keys, 8000, 100)
    r = post(server, "/v1/preferences", {"chosen_completion_id": other, "rejected_completion_id": over})
    assert_too_long(r, "rejected_completion_id")
    assert client.xlen(keys.signals) == before + 2


# ------------------------------------------------------------------------------------------ in the trainer


@pytest.fixture(scope="module")
def chats(tokenizer):
    """Four short real chat prompts and replies (token ids of SmolLM2's template)."""
    out = []
    for q, a in (
        ("What is 2+2?", " 4."),
        ("Name a colour.", " Blue"),
        ("Say hi.", " Hi!"),
        ("Capital of Peru?", " Lima"),
    ):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append((q, tokenizer.encode(text, add_special_tokens=False), tokenizer.encode(a, add_special_tokens=False)))
    return out


def run(client, keys, home, backend, events) -> tuple[list, list[str]]:
    """Queue ``events`` (the bad one last), poll once with batches of 4; returns (notices, stream ids)."""
    sids = [client.xadd(keys.signals, {"event": ev.model_dump_json(), "replaces": ""}) for ev in events]
    worker = TrainerWorker(
        client,
        keys,
        home,
        backend,
        BatchScheduler(TrainingSection(kto_min_batch=4, sft_min_batch=4, dpo_min_batch=4)),
        consumer="triage",
        block_ms=100,
    )
    return worker.poll(), sids


def check_alone(client, keys, home, events, notices, lineage: str) -> str:
    bad, good = events[-1], events[:-1]
    [notice] = notices
    assert notice.name == f"{lineage}@1"
    assert AdapterStore(home).get(lineage, 1).metrics["events:sum"] == len(good)
    trained = [json.loads(x) for x in (dataset_dir(home) / TRAINED_FILE).read_text().splitlines()]
    assert trained[-1]["event_ids"] == [e.id for e in good]
    rejected = [json.loads(x) for x in (dataset_dir(home) / "rejected.jsonl").read_text().splitlines()]
    assert [r["event_id"] for r in rejected] == [bad.id]
    assert client.xpending(keys.signals, TRAINERS_GROUP)["pending"] == 0  # every entry acknowledged
    return rejected[0]["reason"]


def test_one_bad_rating_among_good_ones(bus, base_ref, chats, tmp_path):
    client, keys = bus
    now = int(time.time())
    events = [
        RatingEvent(
            id=f"feedback-{i}",
            endpoint="kto-tri",
            created=now,
            completion_id=f"c{i}",
            prompt_token_ids=p,
            completion_token_ids=c,
            rating=i % 2 == 0,
            rating_key=f"c{i}:/u",
            finish_reason="stop",
        )
        for i, (_, p, c) in enumerate(chats[:3])
    ]
    events.append(
        RatingEvent(
            id="feedback-bad",
            endpoint="kto-tri",
            created=now,
            completion_id="cbad",
            prompt_token_ids=chats[3][1],
            completion_token_ids=[10**6],
            rating=False,
            rating_key="cbad:/u",
        )
    )
    notices, _ = run(client, keys, tmp_path, OnlineTrainer(base_ref, tmp_path), events)
    reason = check_alone(client, keys, tmp_path, events, notices, "kto-tri")
    assert "token id 1000000 is outside the vocabulary" in reason and "data[" not in reason  # found by the screen
    # the KTO class weights are those of the three trained ratings (2 up, 1 down)
    m = AdapterStore(tmp_path).get("kto-tri", 1)
    assert (m.metrics["desirable_weight:mean"], m.metrics["undesirable_weight:mean"]) == (0.5, 1.0)


def test_one_bad_demonstration_among_good_ones(bus, base_ref, chats, tmp_path):
    client, keys = bus
    events = [
        DemonstrationEvent(
            id=f"demonstration-{i}",
            endpoint="sft-tri",
            created=0,
            messages=[ChatMessage(role="user", content=q), ChatMessage(role="assistant", content="Fine.")],
        )
        for i, (q, _, _) in enumerate(chats[:3])
    ]
    events.append(
        DemonstrationEvent(
            id="demonstration-bad",
            endpoint="sft-tri",
            created=0,
            messages=[ChatMessage(role="user", content=LONG), ChatMessage(role="assistant", content="Ok.")],
        )
    )
    notices, _ = run(client, keys, tmp_path, OnlineTrainer(base_ref, tmp_path), events)
    reason = check_alone(client, keys, tmp_path, events, notices, "sft-tri")
    assert reason.startswith("context_length_exceeded") and "8192" in reason


def test_one_bad_preference_among_good_ones(bus, base_ref, chats, tmp_path):
    client, keys = bus
    events = [
        PreferenceEvent(
            id=f"preference-{i}",
            endpoint="dpo-tri",
            created=0,
            prompt_token_ids=p,
            chosen_token_ids=c,
            rejected_token_ids=chats[(i + 1) % 4][2],
        )
        for i, (_, p, c) in enumerate(chats[:2])
    ]
    events.append(
        PreferenceEvent(
            id="preference-2",
            endpoint="dpo-tri",
            created=0,
            messages=[ChatMessage(role="user", content="Hi")],
            chosen="Hello!",
            rejected="No.",
        )
    )
    events.append(
        PreferenceEvent(
            id="preference-bad",
            endpoint="dpo-tri",
            created=0,
            messages=[ChatMessage(role="user", content="Hi")],
            chosen=LONG,
            rejected="No.",
        )
    )
    notices, _ = run(client, keys, tmp_path, OnlineTrainer(base_ref, tmp_path), events)
    reason = check_alone(client, keys, tmp_path, events, notices, "dpo-tri")
    assert reason.startswith("context_length_exceeded")


class _Unscreened(OnlineTrainer):
    """The trainer without its per-event screen: the bad event reaches the training step itself."""

    screen = None


def test_an_event_the_step_refuses_is_dead_lettered_alone(bus, base_ref, chats, tmp_path):
    """The step's own validation names the datum (``data[3].model_input``); the worker drops that event and
    trains the other three."""
    client, keys = bus
    events = [
        DemonstrationEvent(
            id=f"demonstration-{i}",
            endpoint="sft-late",
            created=0,
            messages=[ChatMessage(role="user", content=q), ChatMessage(role="assistant", content="Fine.")],
        )
        for i, (q, _, _) in enumerate(chats[:3])
    ]
    events.append(
        DemonstrationEvent(
            id="demonstration-bad",
            endpoint="sft-late",
            created=0,
            messages=[ChatMessage(role="user", content=LONG), ChatMessage(role="assistant", content="Ok.")],
        )
    )
    notices, _ = run(client, keys, tmp_path, _Unscreened(base_ref, tmp_path), events)
    reason = check_alone(client, keys, tmp_path, events, notices, "sft-late")
    assert "data[3].model_input" in reason and "8192" in reason
