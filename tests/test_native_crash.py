"""A crash in native code never ends a test run or a server silently (issue 46), shown with a deliberate crash
(``LIVELORA_NATIVE_CRASH_AT``: a read of address 0 before llama.cpp's first decode, in the start-up canary or in
the serving engine): a test's child process killed by a signal fails that test with the signal named (a skip where
the canary crashes too); the canary names the signal, the build and the alternatives; ``livelora serve`` refuses to
start on a crashing canary, and reports a crash of its serving process and exits 128 + signal."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from harness.native import in_child, skip_if_native_crashes

from livelora.core.settings import DEFAULT_MODEL
from livelora.gateway.engines.llama_cpp.canary import run_canary
from livelora.gateway.engines.llama_cpp.model import CRASH_ENV

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


def _serve(home, port: int, crash_at: str) -> subprocess.Popen:
    env = {**os.environ, CRASH_ENV: crash_at, "LIVELORA_ENGINE_WEIGHTS": "gguf", "LIVELORA_ENGINE_THREADS": "2"}
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
def test_serve_refuses_to_start_when_the_canary_crashes(livelora_home):
    port = _free_port()
    proc = _serve(livelora_home, port, "canary")
    output, _ = proc.communicate(timeout=300)
    out = " ".join(output.split())
    assert proc.returncode == 1, out
    assert "canary generation (smollm2-135m-instruct, gguf weights) was killed by SIGSEGV (signal 11)" in out, out
    assert "llama-cpp-python 0." in out and "serve LIVELORA_ENGINE_WEIGHTS=f16" in out and "GGML_NATIVE=OFF" in out
    assert "livelora serving" not in out and "Redis" not in out  # refused before anything started


@needs_llama_cpp
def test_a_crash_of_the_serving_process_is_reported_and_exits_128_plus_the_signal(livelora_home):
    skip_if_native_crashes("gguf")  # the real canary would refuse the start before the engine's crash
    port = _free_port()
    proc = _serve(livelora_home, port, "engine")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"model": "smollm2-135m-instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        with pytest.raises(httpx.HTTPError):  # the serving process dies under the request: no answer
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = " ".join(output.split())
    assert proc.returncode == 128 + signal.SIGSEGV, out
    assert "Fatal Python error: Segmentation fault" in out and "llama_cpp/model.py" in out  # faulthandler's stacks
    assert "the serving process (pid " in out and "llama_cpp engine, gguf weights) was killed by SIGSEGV" in out, out
    assert "llama-cpp-python 0." in out and "LIVELORA_ENGINE_WEIGHTS=f16" in out


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
