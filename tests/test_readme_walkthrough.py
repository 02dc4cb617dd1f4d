"""The README's five-minute walkthrough runs verbatim, in order, as a new user runs it: ``livelora serve`` on a
fresh store (no keys, the evaluation gate on, as installed), the Python blocks in one interpreter session, the
shell lines in a shell with ``livelora`` on PATH. Only the URL changes (the server listens on a free port). The
chat example of docs/serving.md runs first against the same server. Slow: the first learned version takes a
minute or several on 2 CPU cores (``-m 'not slow'`` skips it)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _doc_blocks import REPO, blocks, section_blocks
from _sessions_server import delete_prefix

pytestmark = pytest.mark.slow
README_URL = "http://127.0.0.1:8000"
WALKTHROUGH = ("## Five minutes: chat, rate, watch a new version being served", "## Documentation")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fresh_serve(tmp_path):
    """``livelora serve`` on an empty store and a Redis prefix of its own; yields its base URL."""
    port, prefix = _free_port(), f"{os.environ['LIVELORA_REDIS_PREFIX']}walk-{uuid.uuid4().hex[:8]}:"
    env = dict(os.environ, LIVELORA_REDIS_PREFIX=prefix, LIVELORA_GATE_ENABLED="true", LIVELORA_HOME=str(tmp_path))
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "livelora.cli.main", "serve", "--port", str(port), "--home", str(tmp_path / "store")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("livelora serve did not start:\n" + (tmp_path / "serve.log").read_text()[-3000:])
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        delete_prefix(os.environ.get("LIVELORA_REDIS_URL", "redis://127.0.0.1:6379/0"), prefix)


def _run_python(code: str, url: str, ns: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(README_URL, url), "README.md", "exec"), ns)
    return out.getvalue()


@pytest.mark.timeout(1800)
def test_readme_walkthrough_runs_in_order_on_a_fresh_store(fresh_serve):
    url = fresh_serve
    serving_chat = blocks(REPO / "docs" / "serving.md")[2]
    assert serving_chat.lang == "python" and "with_raw_response" in serving_chat.code
    printed = _run_python(serving_chat.code, url, {}).splitlines()
    assert "Paris" in printed[0] and printed[1] == "base livelora-base"

    steps = section_blocks(REPO / "README.md", *WALKTHROUGH)
    assert [b.lang for b in steps] == ["python", "python", "python", "bash", "python"]
    ns: dict = {}
    chat, rate, watch, cli, session = steps

    printed = _run_python(chat.code, url, ns).splitlines()
    assert printed[0].strip() and printed[1] == "base livelora-base"

    printed = _run_python(rate.code, url, ns).splitlines()
    assert len(printed) == 8 and all(line.startswith("200 smollm2-135m-instruct ") for line in printed)

    printed = _run_python(watch.code, url, ns).splitlines()
    assert ns["version"] == "smollm2-135m-instruct@1", "no learned version within the loop's 15 minutes"
    assert printed[0].startswith("smollm2-135m-instruct@1 -> ")
    assert ns["reply"].system_fingerprint == "livelora-smollm2-135m-instruct@1"

    env = dict(os.environ, LIVELORA_URL=url, COLUMNS="200", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    outputs = []
    for line in cli.code.strip().splitlines():
        done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        outputs.append(" ".join(done.stdout.split()))
    assert "created endpoint prod → smollm2-135m-instruct (pinned), serving base" in outputs[0]
    assert outputs[1].startswith("prod: base → smollm2-135m-instruct@1 (promote")
    assert outputs[2].startswith("prod: smollm2-135m-instruct@1 → base (rollback")
    assert all(word in outputs[3] for word in ("create", "promote", "rollback"))
    assert "smollm2-135m-instruct@1" in outputs[4]

    printed = _run_python(session.code, url, ns).splitlines()
    losses = [float(line.split()[1]) for line in printed[:4]]
    assert losses[-1] < losses[0]
    assert "Paris" in printed[-1]
