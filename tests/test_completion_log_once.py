"""The completion log keeps a chat's prompt once per request, not once per choice, and every choice stays
rateable by its own id (shared live gateway, open mode, real Redis)."""

from __future__ import annotations

import json
import os

import httpx
import redis
from harness.server import MODEL

from livelora.clients.types.signals import RatingEvent, parse_stream_event
from livelora.core.redis_keys import KeyLayout


def test_a_chat_with_several_choices_stores_its_prompt_once(live_server, tokenizer):
    content = "Name a colour. " * 40
    r = httpx.post(
        live_server.url("/v1/chat/completions"),
        json={"model": MODEL, "n": 4, "max_tokens": 3, "messages": [{"role": "user", "content": content}]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    cid = r.json()["id"]
    client = redis.Redis.from_url(
        os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"), decode_responses=True
    )
    keys = KeyLayout(live_server.services.settings.redis_prefix)
    raws = [client.get(keys.completion(cid))] + [client.get(keys.completion(f"{cid}-{k}")) for k in range(4)]
    assert all(raws)
    assert sum(raw.count("Name a colour.") for raw in raws) == 40  # the text once, in {id}
    shared = json.loads(raws[0])
    assert shared["kind"] == "prompt" and shared["choices"] == 4 and len(shared["prompts"]) == 1
    prompt_ids = shared["prompts"][0]["prompt_token_ids"]
    assert len(prompt_ids) == r.json()["usage"]["prompt_tokens"] > 40
    for k, raw in enumerate(raws[1:]):
        rec = json.loads(raw)
        assert rec["prompt_of"] == cid and rec["prompt_index"] == 0 and rec["prompt_token_ids"] == []
        assert tokenizer.decode(rec["completion_token_ids"]) == r.json()["choices"][k]["message"]["content"]
    for k in (0, 3):  # each choice is rated by its own id; the rating carries the whole prompt
        fb = httpx.post(live_server.url("/v1/feedback"), json={"completion_id": f"{cid}-{k}", "rating": k == 0})
        assert fb.status_code == 200, fb.text
        assert fb.json()["completion_id"] == f"{cid}-{k}"
    events = [parse_stream_event(fields) for _, fields in client.xrange(keys.signals)]
    mine = [e for e in events if isinstance(e, RatingEvent) and e.completion_id.startswith(f"{cid}-")]
    assert sorted(e.completion_id for e in mine) == [f"{cid}-0", f"{cid}-3"]
    assert all(e.prompt_token_ids == prompt_ids for e in mine)
    bare = httpx.post(live_server.url("/v1/feedback"), json={"completion_id": cid, "rating": True})
    assert bare.status_code == 404 and "4 choices" in bare.json()["error"]["message"]
    client.close()
