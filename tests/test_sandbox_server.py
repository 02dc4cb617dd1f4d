"""``livelora sandbox`` as a live process: SandboxFusion's ``POST /run_code`` over HTTP, its 400s, and
tinker-cookbook's ``SandboxFusionClient`` grading through it (in the SDK venv of .ci/setup-tinker-sdks)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from harness.cluster import free_port
from harness.sdks import sdk_python
from harness.server import wait_until

from livelora.clients.sandbox import IsolationUnavailableError, Sandbox
from livelora.clients.sandbox.fusion import FusionClient

pytestmark = pytest.mark.live  # a real server process (no Redis, no model)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def url():
    try:
        Sandbox(require_isolation=True)
    except IsolationUnavailableError as exc:
        pytest.skip(f"no isolation here: {exc}")
    port = free_port()
    cmd = [sys.executable, "-m", "livelora.cli.main", "sandbox", "--port", str(port), "--wall-s", "5"]
    proc = subprocess.Popen([*cmd, "--require-isolation", "--log-level", "warning"], stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/v1/ping").json() == "pong"
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(up, 60), proc.stderr.read1().decode() if proc.poll() is not None else "not up"
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_run_code_success_failure_timeout_and_files(url):
    body = {
        "code": "import sys, helper\nprint(helper.double(int(sys.stdin.read())))\nopen('o.txt','w').write('done')",
        "language": "python",
        "stdin": "21",
        "files": {"helper.py": b64("def double(x):\n    return 2 * x\n")},
        "fetch_files": ["o.txt"],
    }
    r = httpx.post(f"{url}/run_code", json=body, timeout=30).json()
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == ("Success", "Finished", 0)
    assert r["run_result"]["stdout"] == "42\n" and r["files"] == {"o.txt": b64("done")}
    assert r["compile_result"] is None and r["run_result"]["execution_time"] > 0
    failed = httpx.post(f"{url}/run_code", json={"code": "assert 1 == 2", "language": "python"}, timeout=30).json()
    assert (failed["status"], failed["run_result"]["return_code"]) == ("Failed", 1)
    assert "AssertionError" in failed["run_result"]["stderr"]
    slow = {"code": "import time; time.sleep(60)", "language": "python", "run_timeout": 1}
    timed = httpx.post(f"{url}/run_code", json=slow, timeout=30).json()
    assert (timed["status"], timed["run_result"]["status"], timed["run_result"]["return_code"]) == (
        "Failed",
        "TimeLimitExceeded",
        None,
    )
    client = FusionClient(url)
    assert client.run("print(6 * 7)").run_result.stdout == "42\n"
    client.close()


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"code": "print(1)", "language": "cpp"}, "language", "language 'cpp' is not supported"),
        ({"language": "python"}, "code", "Field required"),
        ({"code": "1", "files": {"a.py": "***"}}, "files", "files['a.py'] is not valid base64"),
        ({"code": "1", "files": {"../a.py": b64("x")}}, "files", "must be a relative path"),
    ],
)
def test_bad_requests_are_400_in_the_openai_envelope(url, body, param, message):
    r = httpx.post(f"{url}/run_code", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, None)
    assert message in err["message"]


COOKBOOK_SCRIPT = textwrap.dedent(
    """
    import asyncio, json
    from tinker_cookbook.recipes.code_rl.code_grading import sandbox_check_correctness

    tests = [{"input": "2 3\\n", "output": "5\\n", "testtype": "stdin"},
             {"input": "10 -4\\n", "output": "6\\n", "testtype": "stdin"}]
    solutions = {"right": "a, b = map(int, input().split())\\nprint(a + b)\\n",
                 "wrong": "a, b = map(int, input().split())\\nprint(a - b)\\n"}

    async def main():
        out = {}
        for name, code in solutions.items():
            ok, details = await sandbox_check_correctness(tests, code, timeout=6)
            out[name] = {"ok": ok, "status": details.get("status"), "stdout": details["run_result"]["stdout"]}
        return out

    print(json.dumps(asyncio.run(main())))
    """
)


def test_cookbook_sandboxfusion_client_grades_through_livelora_sandbox(url):
    python = sdk_python("038")
    if python is None:
        pytest.skip("no tinker-cookbook venv (.venv-tinker038): run .ci/setup-tinker-sdks 038")
    if not Sandbox().run("import numpy").ok:
        pytest.skip(
            "the sandbox's python3 has no numpy (the cookbook's test runner imports it): apt install python3-numpy"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "PYTHON"))}
    env.update(SANDBOX_URL=f"{url}/run_code", TINKER_TELEMETRY="0")
    done = subprocess.run([python, "-c", COOKBOOK_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    graded = json.loads(done.stdout.strip().splitlines()[-1])
    # the cookbook's own code_rl grader (its test runner + testing_util.py as files, SandboxFusionClient)
    assert graded["right"] == {"ok": True, "status": "Success", "stdout": ""}, graded
    assert (graded["wrong"]["ok"], graded["wrong"]["status"]) == (False, "Failed")
    assert "Wrong Answer" in graded["wrong"]["stdout"] and "'expected': '5\\n'" in graded["wrong"]["stdout"]
