"""Cheap limits before expensive work, on the shared live gateway (open mode, real SmolLM2).

A 7 MB chat message is refused from its size alone (no tokenization); a prompt just under that bound is tokenized
in a worker thread, and ``/health`` is answered while it is; zstd bodies inflate only up to the body limit (a
6 KB body that would inflate to 64 MB is refused with 413, with or without a declared frame size). ``/health``
answers throughout.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zstandard
from harness.server import MODEL

CHAT = "/v1/chat/completions"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class HealthProbe:
    """Calls ``/health`` in a loop on its own thread; records each answer as ``(sent, answered, status)``."""

    def __init__(self, url: str):
        self.url, self.answers, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                sent = time.monotonic()
                status = c.get(self.url).status_code
                self.answers.append((sent, time.monotonic(), status))
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def answered_within(self, start: float, end: float) -> list[int]:
        """Statuses of the probes sent and answered inside ``[start, end]``."""
        return [s for sent, done, s in self.answers if start <= sent and done <= end]


def _post(url: str, out: dict, **kw) -> None:
    out["start"] = time.monotonic()
    out["response"] = httpx.post(url, timeout=120, **kw)
    out["end"] = time.monotonic()


def test_a_huge_chat_is_refused_before_tokenizing_and_a_large_one_off_the_loop(live_server):
    huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a " * 3_500_000}]}
    large = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a " * 300_000}]}
    with HealthProbe(live_server.url("/health")) as probe:
        time.sleep(0.2)
        for body, bound in ((huge, True), (large, False)):
            out: dict = {}
            _post(live_server.url(CHAT), out, json=body)
            r = out["response"]
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
            # the huge one is refused from its byte size; the large one was tokenized (its real count)
            assert ("at least" in err["message"]) is bound, err["message"]
            if not bound:  # tokenized in a worker thread: /health was answered while it was
                assert 200 in probe.answered_within(out["start"], out["end"])
        time.sleep(0.2)
    assert probe.answers and all(s == 200 for _, _, s in probe.answers)
    assert live_server.admission.active == 0


def test_zstd_bodies_inflate_only_up_to_the_body_limit(live_server):
    sid = httpx.post(live_server.url("/api/v1/create_session"), json={}, timeout=30).json()["session_id"]
    model_id = f"{sid}:train:0".encode()
    head = b"\x0a" + _varint(len(model_id)) + model_id + b"\x10\x01"
    size = 64 * 1024 * 1024
    plain = head + b"\x1a" + _varint(size) + bytes(size)  # one 64 MB field after the ids
    declared = zstandard.ZstdCompressor(write_content_size=True).compress(plain)
    c = zstandard.ZstdCompressor().compressobj()
    undeclared = c.compress(plain) + c.flush()
    assert zstandard.frame_content_size(undeclared) == -1
    headers = {"content-type": "application/x-protobuf", "content-encoding": "zstd"}
    with HealthProbe(live_server.url("/health")) as probe:
        for body in (declared, undeclared):
            assert len(body) < 16 * 1024
            out: dict = {}
            _post(live_server.url("/api/v1/forward_backward"), out, content=body, headers=headers)
            r = out["response"]
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "payload_too_large" and err["type"] == "invalid_request_error", err
            assert f"{live_server.services.settings.server.max_body_bytes}" in err["message"]
        time.sleep(0.2)
    assert probe.answers and all(s == 200 for _, _, s in probe.answers)


def test_a_stop_list_beyond_the_bound_is_400_on_every_route_and_health_answers(live_server, tokenizer):
    """200,000 stop strings (2.4 MB) once took the event loop for minutes (deduplicating them was quadratic)."""
    stops = [f"zz{i}" for i in range(200_000)]
    hi = [{"role": "user", "content": "Hi"}]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("Hi")}]}
    cases = [
        (CHAT, {"model": MODEL, "max_tokens": 1, "messages": hi, "stop": stops}),
        ("/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": "Hi", "stop": stops}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": hi, "stop_sequences": stops}),
        (
            "/api/v1/asample",
            {"base_model": MODEL, "prompt": prompt, "sampling_params": {"max_tokens": 1, "stop": stops}},
        ),
        ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": hi, "stop_sequences": ["x" * 1025]}),
    ]
    with HealthProbe(live_server.url("/health")) as probe:
        for path, body in cases:
            r = httpx.post(live_server.url(path), json=body, timeout=120)
            assert r.status_code == 400 and "stop" in r.text, (path, r.text[:300])
        allowed = {"model": MODEL, "max_tokens": 1, "messages": hi, "stop_sequences": [f"zz{i}" for i in range(64)]}
        assert httpx.post(live_server.url("/v1/messages"), json=allowed, timeout=120).status_code == 200
    assert probe.answers and all(s == 200 for _, _, s in probe.answers)
    assert live_server.admission.active == 0


def test_count_tokens_refuses_messages_that_cannot_fit_from_their_size(live_server):
    """``/v1/messages/count_tokens`` of a 7 MB text is refused from its size, as ``/v1/messages`` is."""
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "a " * 3_500_000}]}
    with HealthProbe(live_server.url("/health")) as probe:
        r = httpx.post(live_server.url("/v1/messages/count_tokens"), json=huge, timeout=120)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "at least" in r.json()["error"]["message"]  # from the byte size, not tokenized
    assert probe.answers and all(s == 200 for _, _, s in probe.answers)
    small = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(live_server.url("/v1/messages/count_tokens"), json=small, timeout=60).json()["input_tokens"] > 1


def test_the_engines_refuse_more_stop_strings_than_the_bound():
    from livelora.clients.errors import BadRequestError
    from livelora.clients.types.limits import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
    from livelora.gateway.engines.base import SamplingParams, check_sampling_params

    limits = {"vocab_size": 100, "max_model_len": 64}
    check_sampling_params(SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOP_SEQUENCES))), 4, **limits)
    for bad, param in (
        (SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1))), "stop"),
        (SamplingParams(stop_token_ids=tuple(range(MAX_STOP_SEQUENCES + 1))), "stop_token_ids"),
        (SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),)), "stop"),
    ):
        with pytest.raises(BadRequestError) as err:
            check_sampling_params(bad, 4, **limits)
        assert err.value.param == param
