"""``livelora serve`` runs its trainer in a supervised child process with lower CPU priority
(:mod:`livelora.cli.trainer_process`): a real ``livelora serve`` learns from ratings through the child, the child
runs at nice +10, a killed child is restarted and still trains, and a SIGINT stops both with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from harness.cluster import MODEL, free_port, new_store
from harness.server import wait_until
from prometheus_client.parser import text_string_to_metric_families

from livelora.cli.trainer_process import available_cores, default_trainer_threads

pytestmark = pytest.mark.timeout(900)


def test_default_trainer_threads_is_half_the_cores_at_least_one():
    assert [default_trainer_threads(n) for n in (1, 2, 3, 8)] == [1, 1, 1, 4]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def _trainer_child(pid: int) -> int | None:
    """The serve process's child that runs ``_trainer_main`` (not multiprocessing's resource tracker)."""
    for kid in _children(pid):
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            continue
        if "spawn_main" in cmd:
            return kid
    return None


def _rate_two(url: str) -> None:
    for rating in (True, False):
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=300,
            json={
                "model": MODEL,
                "max_tokens": 6,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Say a word ({uuid.uuid4().hex[:6]})"}],
            },
        )
        assert r.status_code == 200, r.text
        fb = httpx.post(url + "/v1/feedback", timeout=60, json={"completion_id": r.json()["id"], "rating": rating})
        assert fb.status_code == 200, fb.text


def _served_version(url: str) -> str:
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=300,
        json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    )
    return r.json()["system_fingerprint"].removeprefix("livelora-")


def test_serve_trains_in_a_lower_priority_child_that_is_restarted_after_a_kill(livelora_home, tmp_path):
    home = new_store(tmp_path / "store", livelora_home)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "LIVELORA_HOME": str(home),
        "LIVELORA_REDIS_PREFIX": f"livelora-test-tp-{uuid.uuid4().hex[:8]}:",
        "LIVELORA_KTO_MIN_BATCH": "2",
        "LIVELORA_MAX_WAIT_S": "1",
        "LIVELORA_TRAINER_NICE": "10",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "livelora.cli.main",
                "serve",
                "--port",
                str(port),
                "--max-batch-size",
                "2",
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def health() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(health, timeout_s=300, interval_s=0.3), log.read_text()[-3000:]
        assert wait_until(lambda: _trainer_child(proc.pid) is not None, timeout_s=60), log.read_text()[-3000:]
        child = _trainer_child(proc.pid)
        assert os.getpriority(os.PRIO_PROCESS, child) == os.getpriority(os.PRIO_PROCESS, proc.pid) + 10
        banner = " ".join(log.read_text().split())
        idle = available_cores()  # a step that starts while nothing is served takes every core
        extra = f", {idle} while nothing is served" if idle != default_trainer_threads() else ""
        duty = "; in steps at most 50% of the time while serving"  # the default duty while serving
        assert f"in process {child} (nice +10, {default_trainer_threads()} threads{extra}{duty})" in banner

        # the child trains: two ratings become the lineage's first version, which serving then uses
        _rate_two(url)
        assert wait_until(lambda: _served_version(url) == f"{MODEL}@1", timeout_s=400, interval_s=1), log.read_text()[
            -3000:
        ]

        # the child's metrics reach the gateway's /metrics (serve shares a PROMETHEUS_MULTIPROC_DIR with it)
        samples = [
            x for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text) for x in f.samples
        ]

        def total(name: str, **labels: str) -> float:
            return sum(x.value for x in samples if x.name == name and labels.items() <= x.labels.items())

        assert total("livelora_train_step_seconds_count", endpoint=MODEL) == 1.0  # observed in the child
        assert total("livelora_signals_total", stage="recorded") == 2.0  # the child's dataset of record
        assert total("livelora_signals_total", stage="trained") == 2.0
        assert total("livelora_signals_total", stage="accepted") == 2.0  # the gateway's own

        # killed: restarted (a new child) and it still trains
        os.kill(child, signal.SIGKILL)
        assert wait_until(lambda: _trainer_child(proc.pid) not in (None, child), timeout_s=60), log.read_text()[-3000:]
        assert "exited with -9; restarting" in log.read_text()
        _rate_two(url)
        assert wait_until(lambda: _served_version(url) == f"{MODEL}@2", timeout_s=400, interval_s=1), log.read_text()[
            -3000:
        ]
        second = _trainer_child(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert not Path(f"/proc/{second}").exists() or "zombie" in Path(f"/proc/{second}/status").read_text().lower()
