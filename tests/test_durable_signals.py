"""Durable acceptance: a signal answered 2xx is trained exactly once whatever Redis does afterwards.

The chaos tests start a Redis of their own (without persistence, then with ``appendfsync always``), a real
``livelora gateway`` and ``livelora trainer`` on it, post ratings the trainer queues, SIGKILL Redis before they are
trained, restart it, post more, and count every accepted rating in ``trained.jsonl`` once. The recovery tests run
:class:`~livelora.trainer.bus_recovery.BusRecovery` on the shared Redis (a prefix of their own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from harness.cluster import MODEL, cluster_on_new_store, free_port, trained_counts
from harness.server import wait_until

from livelora.core.accept_log import AcceptLog, accept_dir, read_accepted
from livelora.core.bus import volatile_warning
from livelora.trainer.bus_recovery import BusRecovery
from livelora.trainer.dataset import DatasetOfRecord

ENV = {
    "LIVELORA_KTO_MIN_BATCH": "50",  # the ratings wait in the trainer's queue until max_wait_s
    "LIVELORA_MAX_WAIT_S": "20",
    "LIVELORA_CLAIM_IDLE_S": "5",
    "LIVELORA_LORA_RANK": "2",
    "LIVELORA_RECONCILE_S": "5",
    "LIVELORA_LONG_POLL_S": "20",  # a future's long poll spans the Redis restart
}


class OwnRedis:
    """A ``redis-server`` on a free port; ``persist``: AOF with ``appendfsync always`` in ``folder``."""

    def __init__(self, folder: Path, persist: bool):
        self.folder, self.port = folder, free_port()
        self.args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(folder),
        ]
        self.args += ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        assert wait_until(lambda: _pings(client), timeout_s=30)
        client.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False


def _retry(fn, *args, **kwargs):
    """``fn(*args)`` until it answers (a gateway's first request after the Redis restart may get 503)."""
    deadline = time.monotonic() + 60
    while True:
        r = fn(*args, **kwargs)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def _chat(url: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0.7, "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/v1/chat/completions", timeout=120, json=body)


def _rate(url: str, completion_id: str, up: bool) -> httpx.Response:
    body = {"completion_id": completion_id, "rating": up, "user": "chaos"}
    return httpx.post(url + "/v1/feedback", timeout=30, json=body)


def _rate_new(url: str, n: int, tag: str) -> list[str]:
    """``n`` chats, then one rating of each (the ratings follow each other closely: none waits ``max_wait_s``)."""
    chats = []
    for i in range(n):
        chat = _retry(_chat, url, f"Name a colour ({tag} {i}).")
        assert chat.status_code == 200, chat.text
        chats.append(chat.json()["id"])
    ids = []
    for i, completion_id in enumerate(chats):
        r = _retry(_rate, url, completion_id, i % 2 == 0)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


@pytest.mark.parametrize("persist", [False, True], ids=["no-persistence", "aof-always"])
def test_redis_killed_between_acceptance_and_training(persist, livelora_home, base_ref, tmp_path_factory):
    own = OwnRedis(tmp_path_factory.mktemp("redis"), persist)
    own.start()
    try:
        with cluster_on_new_store(livelora_home, tmp_path_factory, "chaos", ENV, own.url) as c:
            c.start(gateways=1, trainers=1)
            gw = c.gateways[0]
            r = redis.Redis.from_url(own.url, decode_responses=True)
            accepted = _rate_new(gw.url, 6, "before")
            logged = {rec["event"]["id"] for recs in read_accepted(c.home).values() for rec in recs}
            assert set(accepted) <= logged  # on disk before the 200
            # the trainer holds all six in its queue (read, not trained): the kill comes between the two
            assert wait_until(lambda: r.xpending(c.prefix + "signals", "trainers")["pending"] == 6, timeout_s=60)
            assert trained_counts(c.home) == {}
            # a session op's future being waited on while Redis restarts
            op = "sample:x:0123456789ab"  # an ad-hoc sample's id: its owner is a Redis key (open mode: 'default')
            r.set(c.prefix + "owner:request:" + op, "default", ex=600)
            r.set(c.prefix + "future:" + op, json.dumps({"state": "pending"}), ex=600)
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(
                    httpx.post, gw.url + "/api/v1/retrieve_future", json={"request_id": op}, timeout=120
                )
                time.sleep(1)  # let the long poll start (the assertions below hold whatever the timing)
                r.close()
                own.kill()
                own.start()
                r = redis.Redis.from_url(own.url, decode_responses=True)
                assert (r.xlen(c.prefix + "signals") == 6) is persist  # emptied without persistence
                answer = waiting.result()
            if persist:  # the future survived: still pending (408 after the long poll)
                assert answer.status_code == 408, answer.text
            else:  # gone with Redis: an error naming it, not a hang (503 while Redis was down, else 410)
                assert answer.status_code in (410, 503), answer.text
                again = _retry(httpx.post, gw.url + "/api/v1/retrieve_future", json={"request_id": op}, timeout=60)
                assert again.status_code == 404, again.text  # asked again: gone, at once
                assert "Redis" in answer.json()["error"]["message"]
            accepted += _rate_new(gw.url, 2, "after")
            assert wait_until(lambda: set(trained_counts(c.home)) >= set(accepted), timeout_s=300, interval_s=1)
            counts = trained_counts(c.home)
            assert {e: counts[e] for e in accepted} == dict.fromkeys(accepted, 1)  # each once
            assert set(counts) == set(accepted)  # and nothing else
            status = httpx.get(gw.url + "/v1/learning/" + MODEL, timeout=30).json()
            assert status["recovered_signals"] == (0 if persist else 6)
            assert r.get(c.prefix + "signals:retrained") in (None, "0")
            warned = "runs without append-only persistence" in c.trainers[0].tail(100_000)
            assert warned is not persist
            r.close()
    finally:
        own.kill()


# ------------------------------------------------------------------------------------------- the recovery pass
def _event(eid: str) -> str:
    return json.dumps({"type": "demonstration", "id": eid, "endpoint": MODEL, "created": 1, "messages": []})


def _stream_ids(client, keys) -> list[str]:
    return [json.loads(f["event"])["id"] for _, f in client.xrange(keys.signals)]


def test_state_lost_requeues_what_is_neither_trained_nor_queued(bus, tmp_path):
    client, keys = bus
    log = AcceptLog(tmp_path, keys.prefix)
    for eid in ("demonstration-a", "demonstration-b", "demonstration-c", "demonstration-d"):
        log.append(_event(eid), "")
    client.xadd(keys.signals, {"event": _event("demonstration-a"), "replaces": ""})  # still queued
    trained = tmp_path / "data" / "signals" / "trained.jsonl"
    trained.parent.mkdir(parents=True, exist_ok=True)
    trained.write_text(json.dumps({"version": "x@1", "event_ids": ["demonstration-b"], "stream_ids": []}) + "\n")
    rec = BusRecovery(client, keys, tmp_path)
    assert rec.lost()  # no epoch yet
    assert rec.recover() == 2
    assert _stream_ids(client, keys) == ["demonstration-a", "demonstration-c", "demonstration-d"]
    assert not rec.lost() and rec.recovered == 2
    # a second worker adopts the epoch and re-queues nothing
    other = BusRecovery(client, keys, tmp_path)
    assert other.lost() and other.recover() == 0 and not other.lost()
    # a flush: lost again, and only what is still neither trained nor in the stream comes back (once)
    client.delete(keys.signals, keys.bus_epoch)
    assert rec.lost() and other.lost()
    assert rec.recover() == 3 and other.recover() == 0
    assert sorted(_stream_ids(client, keys)) == ["demonstration-a", "demonstration-c", "demonstration-d"]


def test_neither_a_replaced_rating_nor_another_prefixs_event_is_requeued(bus, tmp_path):
    client, keys = bus
    log = AcceptLog(tmp_path, keys.prefix)
    log.append(_event("feedback-old"), "")
    log.append(_event("feedback-new"), "feedback-old")
    AcceptLog(tmp_path, keys.prefix + "other:").append(_event("feedback-other"), "")  # another install's: not ours
    assert BusRecovery(client, keys, tmp_path).recover() == 1
    assert _stream_ids(client, keys) == ["feedback-new"]
    assert client.xrange(keys.signals)[0][1]["replaces"] == "feedback-old"


def test_entries_lost_are_requeued_and_settled_logs_pruned(bus, tmp_path):
    client, keys = bus
    log = AcceptLog(tmp_path, keys.prefix)
    clock = [time.time()]
    rec = BusRecovery(client, keys, tmp_path, reconcile_s=10, clock=lambda: clock[0])
    assert rec.recover() == 0
    for eid in ("demonstration-x", "demonstration-y"):
        client.xadd(keys.signals, {"event": _event(eid), "replaces": ""})
        log.append(_event(eid), "")
    assert rec.reconcile() == 0  # both queued
    # a failover lost the entry of y, which no trainer had read; x was read and recorded, then acknowledged
    DatasetOfRecord(tmp_path).append(
        "2026-01-01", [("demonstration-x", {"event": json.loads(_event("demonstration-x"))})]
    )
    client.delete(keys.signals)
    assert rec.reconcile() == 0  # not yet due
    clock[0] += 11
    assert rec.reconcile() == 1
    assert _stream_ids(client, keys) == ["demonstration-y"]
    # pruning: a past day's file goes once every event in it is recorded and out of the stream
    (name,) = [p for p in os.listdir(accept_dir(tmp_path)) if p.endswith(".jsonl")]
    os.rename(accept_dir(tmp_path) / name, accept_dir(tmp_path) / ("2020-01-01" + name[10:]))
    clock[0] += 11
    rec.reconcile()
    assert [p for p in os.listdir(accept_dir(tmp_path)) if p.endswith(".jsonl")] == ["2020-01-01" + name[10:]]
    # y's user forgotten (the trainer drops y unrecorded): neither re-queued again nor keeping the file
    client.delete(keys.signals)
    rec.forgotten = lambda ev: ev.id == "demonstration-y"
    clock[0] += 11
    assert rec.reconcile() == 0
    assert [p for p in os.listdir(accept_dir(tmp_path)) if p.endswith(".jsonl")] == []


def test_volatile_redis_is_named():
    assert volatile_warning({"appendonly": "yes", "appendfsync": "always"}, "redis://r") is None
    assert "without append-only persistence" in volatile_warning({"appendonly": "no"}, "redis://r")
    assert "appendfsync everysec" in volatile_warning({"appendonly": "yes", "appendfsync": "everysec"}, "redis://r")
