"""Redis key names never hold raw user text (issue 46, item 9): after a live exercise with a ``user`` field, an
``Idempotency-Key`` and session metadata full of quotes, spaces, newlines, colons and non-ASCII text, every key
of the gateway's prefix is printable ASCII with no quote, backslash or whitespace; keys of the layout before
(``rating:``, ``idem:`` with the raw text) are renamed at start with their values and TTLs."""

from __future__ import annotations

import asyncio
import re

import httpx
import redis

from livelora.core.bus import connect_async
from livelora.core.key_migration import migrate_user_text_keys
from livelora.core.redis_keys import text_digest

WEIRD = 'ann "the rater" o\'neil:\n\tx y :: ünï 😀 \\ `z`'
#: printable ASCII less whitespace, quotes, backquote and backslash
CLEAN = re.compile(r"[!#-&(-\[\]-_a-~]+")


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, (r.request.method, str(r.request.url), r.status_code, r.text)
    return r.json()


def test_every_key_written_by_a_live_exercise_is_clean_ascii(sessions_server):
    server = sessions_server
    settings = server.services.settings
    model = settings.model_id
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "user": WEIRD}
        cid = ok(c.post("/v1/chat/completions", json=chat))["id"]
        ok(c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, "user": WEIRD}))
        idem = {"Idempotency-Key": "key \"1\": with spaces, colons and quotes 'x'"}
        rated = {"completion_id": cid, "rating": True, "user": WEIRD, "comment": WEIRD}
        ok(c.post("/v1/feedback", json=rated, headers=idem))
        assert ok(c.post("/v1/feedback", json=rated, headers=idem))["id"]  # the replay finds its record
        ok(c.post("/v1/feedback", json={**rated, "rating": False}))  # a re-rate by the same rater replaces it
        prompt = [{"role": "user", "content": "hi"}]
        prefs = {"model": model, "messages": prompt, "chosen": "hello", "rejected": "go away", "user": WEIRD}
        ok(c.post("/v1/preferences", json=prefs, headers={"Idempotency-Key": "p\tq r"}))
        demo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        ok(c.post("/v1/demonstrations", json={"model": model, "messages": demo, "user": WEIRD}))
        created = {"user_metadata": {WEIRD: WEIRD}, "tags": [WEIRD], "display_name": WEIRD, "project_id": WEIRD}
        sid = ok(c.post("/api/v1/create_session", json=created))["session_id"]
        assert ok(c.get(f"/api/v1/sessions/{sid}"))
        ok(c.post("/api/v1/sessions/search", json={}))
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    names = list(client.scan_iter(match=settings.redis_prefix + "*", count=1000))
    assert any(n.startswith(settings.redis_prefix + "rated:") for n in names), names
    assert any(n.startswith(settings.redis_prefix + "idemkey:") for n in names), names
    dirty = [n for n in names if not CLEAN.fullmatch(n)]
    assert not dirty, dirty


def test_keys_of_the_old_layout_are_renamed_with_their_values_and_ttls(bus):
    client, keys = bus
    p = keys.prefix
    rater, idem_key = "acme/" + WEIRD, 'retry "1": x'
    client.set(f"{p}rating:chatcmpl-1:{rater}", "feedback-old", ex=600)
    client.set(f"{p}idem:feedback/acme:{idem_key}", '{"fingerprint": "f"}', ex=300)
    client.set(f"{p}rating:chatcmpl-2:/bob", "feedback-older", ex=600)  # a newer record under the new name wins
    client.set(keys.rating("chatcmpl-2", "/bob"), "feedback-new", ex=600)

    async def migrate() -> int:
        aclient = connect_async("redis://127.0.0.1:6379/0")
        try:
            return await migrate_user_text_keys(aclient, keys)
        finally:
            await aclient.aclose()

    assert asyncio.run(migrate()) == 3
    assert keys.rating("chatcmpl-1", rater) == f"{p}rated:chatcmpl-1:{text_digest(rater)}"
    assert client.get(keys.rating("chatcmpl-1", rater)) == "feedback-old"
    assert 0 < client.ttl(keys.rating("chatcmpl-1", rater)) <= 600
    assert client.get(keys.idem("feedback/acme", idem_key)) == '{"fingerprint": "f"}'
    assert 0 < client.ttl(keys.idem("feedback/acme", idem_key)) <= 300
    assert client.get(keys.rating("chatcmpl-2", "/bob")) == "feedback-new"
    left = sorted(client.scan_iter(match=f"{p}*", count=1000))
    assert not [k for k in left if k.startswith((f"{p}rating:", f"{p}idem:"))], left
    assert client.get(keys.layout_version) == "2"
    assert asyncio.run(migrate()) == 0  # once per prefix
    client.set(f"{p}rating:chatcmpl-3:/x", "f", ex=60)
    client.delete(keys.layout_version)
    assert asyncio.run(migrate()) == 1 and client.get(keys.rating("chatcmpl-3", "/x")) == "f"  # run again on demand
