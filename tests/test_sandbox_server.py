"""``livelora sandbox`` as a live process: SandboxFusion's ``POST /run_code`` over HTTP, its 400s, the API key
and Host checks, hostile programs filling its size-limited mounts, and tinker-cookbook's ``SandboxFusionClient``
grading through it (in the SDK venv of .ci/setup-tinker-sdks)."""

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


KEY = "sk-sandbox-test-0123456789"
SANDBOX = [sys.executable, "-m", "livelora.cli.main", "sandbox"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LIVELORA_SANDBOX_API_KEY"}
    return {**env, **extra}


def _start(args: list[str], env: dict[str, str], log) -> tuple[subprocess.Popen, str]:
    try:
        Sandbox(require_isolation=True)
    except IsolationUnavailableError as exc:
        pytest.skip(f"no isolation here: {exc}")
    port = free_port()
    cmd = [*SANDBOX, "--port", str(port), *args, "--require-isolation", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/v1/ping").json() == "pong"
        except httpx.HTTPError:
            return False

    if not wait_until(up, 60):
        proc.kill()
        log.seek(0)
        pytest.fail(f"livelora sandbox did not come up: {log.read().decode()[-2000:]}")
    return proc, base


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with open(tmp_path_factory.mktemp("sandbox") / "stderr", "w+b") as log:
        proc, base = _start(["--wall-s", "5"], _env(), log)
        try:
            yield base
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server on every interface (0.0.0.0) with an API key from the environment: ``(url, its stderr file)``."""
    with open(tmp_path_factory.mktemp("keyed") / "stderr", "w+b") as log:
        args = ["--host", "0.0.0.0", "--allow-host", "sandbox.test", "--wall-s", "30"]
        proc, base = _start(args, _env(LIVELORA_SANDBOX_API_KEY=KEY), log)
        try:
            yield base, log
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


def _runs(base: str) -> int:
    return httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {KEY}"}).json()["runs"]


def test_binding_beyond_loopback_without_a_key_is_refused_at_start():
    cmd = [*SANDBOX, "--host", "0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--host 0.0.0.0 is not a loopback interface" in done.stderr and "LIVELORA_SANDBOX_API_KEY" in done.stderr


def test_the_api_key_is_required_checked_and_accepted(keyed, monkeypatch):
    base, log = keyed
    program = {"code": "print(6 * 7)", "language": "python"}
    before = _runs(base)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}, {"X-API-Key": KEY}):
        r = httpx.post(f"{base}/run_code", json=program, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json() == {
            "error": {
                "message": "missing or wrong API key (Authorization: Bearer KEY)",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    two = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer sk-wrong")]
    r = httpx.post(f"{base}/run_code", json=program, headers=two, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "authorization")
    assert httpx.get(f"{base}/health").status_code == 401
    assert _runs(base) == before  # none of them ran
    r = httpx.post(f"{base}/run_code", json=program, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert (r.status_code, r.json()["run_result"]["stdout"]) == (200, "42\n")
    assert httpx.get(f"{base}/v1/ping").json() == "pong"  # readiness probes need no key
    monkeypatch.delenv("LIVELORA_SANDBOX_API_KEY", raising=False)
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        FusionClient(base).run("print(1)")
    monkeypatch.setenv("LIVELORA_SANDBOX_API_KEY", KEY)  # FusionClient (and the code-rl recipe through it) sends it
    assert FusionClient(base).run("print(6 * 7)").run_result.stdout == "42\n"
    assert FusionClient(base, api_key=KEY).run("print(1)").status == "Success"
    log.seek(0)
    assert "binds 0.0.0.0, beyond loopback" in log.read().decode()  # the warning at start


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.", ""])
def test_a_host_off_the_allow_list_is_refused_and_runs_nothing(keyed, url, host):
    base, _ = keyed
    before = _runs(base)
    headers = {"Authorization": f"Bearer {KEY}", "Host": host}
    r = httpx.post(f"{base}/run_code", json={"code": "print(1)"}, headers=headers, timeout=30)
    assert r.status_code == 421, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "host_not_allowed", None)
    assert "--allow-host" in err["message"]
    assert _runs(base) == before
    r = httpx.post(f"{url}/run_code", json={"code": "print(1)"}, headers={"Host": host}, timeout=30)
    assert r.status_code == 421  # without a key too (a DNS-rebinding page has none to send)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1", "[::1]:80", "sandbox.test"])
def test_allowed_hosts_are_served(keyed, host):
    base, _ = keyed
    headers = {"Authorization": f"Bearer {KEY}", "Host": host}
    r = httpx.post(f"{base}/run_code", json={"code": "print(1)"}, headers=headers, timeout=30)
    assert (r.status_code, r.json()["status"]) == (200, "Success"), r.text


def test_hostile_programs_fill_only_their_own_mounts(keyed):
    base, _ = keyed
    fill = textwrap.dedent(
        """
        import errno, os
        for d in ["/dev/shm", ".", "/tmp"]:
            n = 0
            try:
                for i in range(64):
                    with open(os.path.join(d, f"fill{i}"), "wb") as f:
                        f.write(b"x" * (16 << 20))
                    n += 1
            except OSError as exc:
                print(d, n, errno.errorcode[exc.errno])
        """
    )
    r = httpx.post(f"{base}/run_code", json={"code": fill}, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    body = r.json()
    assert (body["status"], body["run_result"]["return_code"]) == ("Success", 0), body
    assert body["run_result"]["stdout"].splitlines() == ["/dev/shm 4 ENOSPC", ". 15 ENOSPC", "/tmp 4 ENOSPC"]
    assert body["message"] == (
        "work directory full (work_mb 256 MiB), /tmp full (tmp_mb 64 MiB), /dev/shm full (shm_mb 64 MiB)"
    )
    big = {"code": "pass", "files": {"big.bin": b64("x" * ((16 << 20) + 1))}}
    r = httpx.post(f"{base}/run_code", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "files")
    assert "over max_file_mb 16 MiB" in r.json()["error"]["message"]
