"""Graceful drain of a real ``livelora gateway`` process on SIGTERM (livelora.gateway.middleware.drain).

While draining, new requests get 503 + ``Retry-After`` and ``/health`` says ``draining``; a stream that finishes
within the grace period ends normally; one still open at the deadline ends with an error event and ``[DONE]``;
the process then exits with status 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from harness.cluster import MODEL, Cluster, new_store

pytestmark = pytest.mark.timeout(600)


def _stream(url: str, max_tokens: int, out: dict) -> None:
    """Stream one chat completion, keeping every ``data:`` payload in ``out["events"]``; ``out["first"]`` is set at
    the first token."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[len("data: ") :])
                out["first"].set()


def _drain_run(livelora_home, tmp_path, grace_s: float, max_tokens: int) -> dict:
    home = new_store(tmp_path / "store", livelora_home)
    cluster = Cluster(
        home,
        f"livelora-test-drain-{uuid.uuid4().hex[:8]}:",
        env={"LIVELORA_DRAIN_GRACE_S": str(grace_s), "LIVELORA_MAX_BATCH_SIZE": "2"},
    )
    cluster.start(gateways=1, trainers=0)
    gw = cluster.gateways[0]
    out: dict = {"events": [], "first": threading.Event()}
    reader = threading.Thread(target=_stream, args=(gw.url, max_tokens, out), daemon=True)
    try:
        reader.start()
        assert out["first"].wait(120), gw.tail()
        os.killpg(gw.pid, signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(
            gw.url + "/v1/chat/completions",
            timeout=30,
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        health = httpx.get(gw.url + "/health", timeout=30)
        reader.join(120)
        assert not reader.is_alive()
        out["returncode"] = gw.popen.wait(timeout=60)
        out["refused"], out["health"] = refused, health
        return out
    finally:
        cluster.stop()


def test_sigterm_refuses_new_requests_and_lets_a_running_stream_finish(livelora_home, tmp_path):
    out = _drain_run(livelora_home, tmp_path, grace_s=60, max_tokens=24)
    refused = out["refused"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "service_unavailable"
    assert out["health"].status_code == 503 and out["health"].json()["status"] == "draining"
    events = out["events"]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the whole 24 tokens, not cut
    assert out["returncode"] == 0


def test_a_stream_still_open_at_the_deadline_ends_with_an_error_event_and_done(livelora_home, tmp_path):
    out = _drain_run(livelora_home, tmp_path, grace_s=1, max_tokens=2000)
    events = out["events"]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and "shut down" in error["message"], error
    finished = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2] if '"choices"' in e]
    assert not any(finished), "the stream was cut by the drain, not finished"
    assert out["returncode"] == 0
