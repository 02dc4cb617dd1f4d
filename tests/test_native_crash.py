"""A crash in native code never ends a test run or a server silently (issue 46), shown with deliberate crashes
(``LIVELORA_NATIVE_CRASH_AT``: a read of address 0 before llama.cpp's first decode, in the start-up canary or in
the serving engine; ``LIVELORA_NATIVE_CRASH_FILE``: at every decode of a serving engine while a file exists): a
test's child process killed by a signal fails that test with the signal named (a skip where the canary crashes
too); the canary names the signal, the build and the alternatives; ``livelora serve`` refuses to start on a
crashing canary; a crash of the engine's own process fails the requests it held with an error naming the signal,
the engine restarts, and a crash loop makes the gateway unhealthy and exit with the cause."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from harness.native import in_child, skip_if_native_crashes
from harness.server import wait_until

from livelora.core.settings import DEFAULT_MODEL
from livelora.gateway.engines.llama_cpp.canary import run_canary
from livelora.gateway.engines.llama_cpp.model import CRASH_ENV, CRASH_FILE_ENV

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed here (pip install -e '.[dev]' builds it)",
)


def _double(x: int) -> int:
    return 2 * x


def _segfault() -> None:
    ctypes.string_at(0)


def _raise() -> None:
    raise ValueError("a plain error")


@needs_llama_cpp
def test_a_child_killed_by_a_signal_fails_that_test_with_the_signal_named(livelora_home, monkeypatch):
    monkeypatch.delenv(CRASH_ENV, raising=False)
    assert in_child(_double, 21) == 42
    with pytest.raises(pytest.fail.Exception, match=r"_segfault was killed by SIGSEGV \(signal 11\).*CPU flags"):
        in_child(_segfault)  # the canary runs on this machine: a crash of the test's own is a failure
    with pytest.raises(pytest.fail.Exception, match="ValueError: a plain error"):
        in_child(_raise)
    monkeypatch.setenv(CRASH_ENV, "canary")  # a machine whose native build crashes: the crash is a skip with why
    with pytest.raises(pytest.skip.Exception, match=r"_segfault was killed by SIGSEGV.*canary generation"):
        in_child(_segfault, weights="gguf")


@needs_llama_cpp
def test_the_canary_names_the_signal_the_build_and_the_alternatives(livelora_home, monkeypatch):
    monkeypatch.delenv(CRASH_ENV, raising=False)
    real = run_canary(DEFAULT_MODEL, livelora_home, "gguf", threads=2)  # None, or this machine's build crashes
    assert real is None or (real.signal is not None and "gguf weights" in real.message), real
    monkeypatch.setenv(CRASH_ENV, "canary")
    failure = run_canary(DEFAULT_MODEL, livelora_home, "gguf", threads=2)
    assert failure is not None and failure.signal == signal.SIGSEGV
    for part in ("gguf weights", "SIGSEGV (signal 11)", "llama-cpp-python 0.", "CPU flags: ", "avx2"):
        assert part in failure.message, (part, failure.message)
    for alternative in ("LIVELORA_ENGINE_WEIGHTS=f16", "-DGGML_NATIVE=OFF", "LIVELORA_ENGINE=transformers"):
        assert alternative in failure.message
    assert "LIVELORA_ENGINE_WEIGHTS=f16" not in run_canary(DEFAULT_MODEL, livelora_home, "f16", threads=2).message
    with pytest.raises(pytest.skip.Exception, match="SIGSEGV"):  # what every llama.cpp test does first
        skip_if_native_crashes("gguf")
    monkeypatch.setenv(CRASH_ENV, "engine")  # the serving engine's hook: the canary is not hit
    assert (run_canary(DEFAULT_MODEL, livelora_home, "gguf", threads=2) is None) == (real is None)


def _serve(home, port: int, crash_at: str, weights: str = "gguf", **env: str) -> subprocess.Popen:
    """``livelora serve`` with llama.cpp on ``home`` and the Redis prefix ``env["LIVELORA_REDIS_PREFIX"]``."""
    env = {**os.environ, CRASH_ENV: crash_at, "LIVELORA_ENGINE_WEIGHTS": weights, "LIVELORA_ENGINE_THREADS": "2", **env}
    argv = ["serve", "--engine", "llama_cpp", "--port", str(port), "--home", str(home), "--max-batch-size", "2"]
    return subprocess.Popen(
        [sys.executable, "-m", "livelora.cli.main", *argv, "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_llama_cpp
def test_serve_refuses_to_start_when_the_canary_crashes(own_store):
    home, prefix = own_store
    port = _free_port()
    proc = _serve(home, port, "canary", LIVELORA_REDIS_PREFIX=prefix)
    output, _ = proc.communicate(timeout=300)
    out = " ".join(output.split())
    assert proc.returncode == 1, out
    assert "canary generation (smollm2-135m-instruct, gguf weights) was killed by SIGSEGV (signal 11)" in out, out
    assert "llama-cpp-python 0." in out and "serve LIVELORA_ENGINE_WEIGHTS=f16" in out and "GGML_NATIVE=OFF" in out
    assert "livelora serving" not in out and "Redis" not in out  # refused before anything started


def _chat(url: str, max_tokens: int, stream: bool = False, timeout: float = 300) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    body["messages"] = [{"role": "user", "content": "Tell me about the sea."}]
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def _crash_while_two_requests_run(url: str, crash_file) -> tuple[httpx.Response, list[dict]]:
    """A non-streamed and a streamed request running in the engine when its process crashes: the first's response
    and the second's SSE events."""
    held: dict = {}
    plain = threading.Thread(target=lambda: held.update(plain=_chat(url, 1000)))
    plain.start()
    events: list[dict] = []
    body = {"model": "smollm2-135m-instruct", "max_tokens": 1000, "temperature": 0, "stream": True}
    body["messages"] = [{"role": "user", "content": "Write a long story."}]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
            if len(events) == 2:  # both rows decode (batch of 2): the next llama_decode crashes
                assert wait_until(lambda: httpx.get(f"{url}/health").json()["sequences"] == 2, 60)
                crash_file.touch()
    plain.join(300)
    return held["plain"], events


@needs_llama_cpp
def test_an_engine_crash_fails_the_requests_it_held_restarts_and_a_crash_loop_stops_the_gateway(own_store):
    """``serve`` with llama.cpp in its own process (f16: runs on every build), crashed on demand through the test
    hook: the two requests it held get the error naming the signal (a 503; an SSE error event), the restarted
    engine answers with the same greedy text, and a third crash within the window stops the gateway with the cause."""
    skip_if_native_crashes("f16")
    home, prefix = own_store
    crash_file = home / "crash-now"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(home, port, "", "f16", **{CRASH_FILE_ENV: str(crash_file), "LIVELORA_REDIS_PREFIX": prefix})
    try:
        assert wait_until(lambda: _healthy(url) or proc.poll() is not None, 300) and proc.poll() is None
        before = _chat(url, 12).json()["choices"][0]["message"]["content"]
        plain, events = _crash_while_two_requests_run(url, crash_file)
        crash_file.unlink()
        assert plain.status_code == 503 and plain.headers["retry-after"] == "5", plain.text
        for error in (plain.json()["error"], events[-1]["error"]):
            assert error["code"] == "engine_crashed" and error["type"] == "server_error", error
            assert "llama_cpp engine's process" in error["message"] and "SIGSEGV (signal 11)" in error["message"]
        assert all("choices" in e for e in events[:-1])  # tokens, then the error event, then [DONE]
        assert _chat(url, 12).json()["choices"][0]["message"]["content"] == before  # after the restart
        crash_file.touch()  # crashes 2 and 3 within 5 minutes: the engine gives up, the gateway stops
        second, third = _chat(url, 4), _chat(url, 4)
        assert second.json()["error"]["message"].endswith("the engine restarts, retry"), second.text
        assert third.status_code == 503 and third.json()["error"]["message"].endswith("the gateway stops"), third.text
        output, _ = proc.communicate(timeout=120)
    finally:
        crash_file.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = " ".join(output.split())
    assert proc.returncode == 1, out
    assert out.count("restarts with its 0 adapter versions") == 2, out  # each cause logged once
    assert "Fatal Python error: Segmentation fault" in out and "llama_cpp/model.py" in out  # the child's stacks
    assert "was killed by SIGSEGV (signal 11): 3 crashes within 300 s, so it is not restarted" in out, out
    assert "error: the llama_cpp engine's process" in out and "llama-cpp-python 0." in out, out


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_health_answers_503_with_the_engines_failure(live_server):
    engine = live_server.engine
    engine.failure = "the engine's process crashed 3 times (a test's words)"
    try:
        response = httpx.get(live_server.url("/health"))
    finally:
        del engine.failure
    assert response.status_code == 503
    assert response.json()["status"] == "unhealthy"
    assert response.json()["error"] == "the engine's process crashed 3 times (a test's words)"
    assert httpx.get(live_server.url("/health")).json()["status"] == "ok"


@needs_llama_cpp
def test_llama_cpps_repeated_warnings_are_logged_once(caplog, monkeypatch):
    """llama.cpp's log callback as llama.cpp calls it: an AMX build's warning for each LoRA tensor is one line."""
    from livelora.gateway.engines.llama_cpp import model
    from livelora.gateway.engines.llama_cpp.model import _log_callback

    monkeypatch.setattr(model, "_seen", set())  # once per process: earlier engines in this process logged too
    monkeypatch.setattr(model, "_last_level", [0])
    emit = _log_callback()
    caplog.set_level("WARNING", logger="livelora.gateway.engines.llama_cpp.model")
    warning = "llama_adapter_lora_init_impl: lora for '{}' cannot use buft 'AMX', fallback to CPU"
    for layer in range(30):
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            emit(3, (warning.format(f"blk.{layer}.{proj}.weight") + "\n").encode(), None)
    emit(2, b"an information line\n", None)  # dropped
    emit(4, b"llama_decode: failed to decode, ret = -1\n", None)  # errors are logged every time
    emit(4, b"llama_decode: failed to decode, ret = -1\n", None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "llama.cpp: " + warning.format("blk.0.attn_q.weight"),
        "llama.cpp: llama_decode: failed to decode, ret = -1",
        "llama.cpp: llama_decode: failed to decode, ret = -1",
    ]
