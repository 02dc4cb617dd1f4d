"""Running the docs as a user does: ``livelora serve`` on a fresh store, Python blocks in one namespace, shell
blocks in bash, and recorded terminal transcripts (``$ command`` lines and their output) replayed and compared.

A transcript's output is compared by content, not layout: each expected line, with what changes from run to run
(keys, key ids, times, sizes, training counts) masked, must have every word in the command's real output.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.bus import REDIS_URL, delete_prefix
from harness.environ import LOOP_MECHANICS

DOCS_URL = "http://127.0.0.1:8000"
#: what a recorded output line may differ in from a new run, masked before comparing (pattern, mask)
VOLATILE = [
    (re.compile(r"tml-[A-Za-z0-9_-]+…?"), "<KEY>"),
    (re.compile(r"\b[0-9a-f]{12}\b"), "<ID>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2})?)?|\b\d{2}:\d{2}:\d{2}\b"), "<TIME>"),
    (re.compile(r"\b(datums|tokens)=\d+"), r"\1=<N>"),
    (re.compile(r"\d+(?:\.\d+)? ?(?:[kMG]?B)(?:/s)?"), "<SIZE>"),
]
_BOX = re.compile(r"[\s┃│┏┳┓┡╇┩└┴┘━─┌┬┐├┼┤╭╮╰╯]+")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Serve:
    """A ``livelora serve`` process: ``url`` (``http://127.0.0.1:<port>``), ``store`` (its ``--home``), ``env``
    (its environment, for CLI calls against it)."""

    url: str
    store: Path
    env: dict[str, str]


@contextlib.contextmanager
def serve_process(
    tmp: Path, extra_env: dict[str, str] | None = None, *, installed: bool = False, converted_from: Path | None = None
) -> Iterator[Serve]:
    """``livelora serve`` on an empty store under ``tmp`` with a Redis prefix of its own, the evaluation gate on;
    with ``installed`` every update and gate setting as installed (the free-form check and the rehearsal KL too,
    which the suite turns off elsewhere: ``harness.environ.LOOP_MECHANICS``); stopped with SIGINT and its prefix
    deleted at the end. ``converted_from``: a store whose converted built-in model the new store links
    (``models/<name>``) instead of converting it again (about 30 s); nothing else of it is shared (the gate's base
    measurement is still taken on the new store).

    Raises:
        RuntimeError: it did not answer ``/health`` within 600 s (the log's tail in the message).
    """
    from livelora.core.settings import DEFAULT_MODEL

    port, prefix = free_port(), f"{os.environ['LIVELORA_REDIS_PREFIX']}serve-{uuid.uuid4().hex[:8]}:"
    env = dict(os.environ, LIVELORA_REDIS_PREFIX=prefix, LIVELORA_GATE_ENABLED="true", LIVELORA_HOME=str(tmp))
    for name in LOOP_MECHANICS if installed else ():
        del env[name]
    env.update(extra_env or {})
    store, log_path = tmp / "store", tmp / "serve.log"
    if converted_from is not None:
        (store / "models").mkdir(parents=True)
        (store / "models" / DEFAULT_MODEL).symlink_to(Path(converted_from) / "models" / DEFAULT_MODEL)
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "livelora.cli.main", "serve", "--port", str(port), "--home", str(store)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("livelora serve did not start:\n" + log_path.read_text()[-3000:])
        cli_env = dict(env, LIVELORA_URL=url, COLUMNS="200", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        yield Serve(url, store, cli_env)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        delete_prefix(os.environ.get("LIVELORA_REDIS_URL", REDIS_URL), prefix)


def localize(code: str, url: str) -> str:
    """``code`` with the docs' server address (``http://127.0.0.1:8000``, ``localhost:8000``) replaced by ``url``."""
    return code.replace(DOCS_URL, url).replace("localhost:8000", url.removeprefix("http://"))


def run_python(code: str, url: str, ns: dict, name: str = "docs") -> str:
    """Execute a Python block in namespace ``ns`` against ``url``; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(localize(code, url), name, "exec"), ns)
    return out.getvalue()


def run_bash(code: str, url: str, env: dict[str, str], cwd: Path, timeout_s: float = 600) -> str:
    """Run a shell block in one ``bash -e`` against ``url``; returns its stdout.

    Raises:
        AssertionError: it exited non-zero (its output in the message).
    """
    done = subprocess.run(
        ["bash", "-e", "-c", localize(code, url)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{code}\n{done.stdout}{done.stderr}"
    return done.stdout


def mask(text: str) -> list[str]:
    """The words of ``text`` with :data:`VOLATILE` parts masked (table borders and spaces are separators)."""
    for pattern, repl in VOLATILE:
        text = pattern.sub(repl, text)
    return [w for w in _BOX.split(text) if w]


@dataclass
class Step:
    command: str
    expected: list[str]
    output: str
    returncode: int


def transcript(text: str) -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of each ``$ `` line of a recorded transcript."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return steps


def replay(
    text: str, url: str, env: dict[str, str], cwd: Path, rewrite: Callable[[str, list[Step]], str] | None = None
) -> list[Step]:
    """Run each command of transcript ``text`` (``NAME=value`` and ``export NAME=value`` lines set ``env``;
    ``rewrite(command, steps so far)`` may fill in what the transcript elides) and check its output and exit
    status against the recording.

    Raises:
        AssertionError: a command's exit status differs (an ``error (...)`` output means non-zero), or an expected
            word is missing from its output.
    """
    steps: list[Step] = []
    for command, expected in transcript(text):
        command = localize(rewrite(command, steps) if rewrite else command, url)
        assign = re.fullmatch(r"(?:export )?([A-Z_][A-Z0-9_]*)=(\S+)(?:\s+#.*)?", command)
        if assign:
            name, value = assign.groups()
            env[name] = os.path.expanduser(re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), value))
            steps.append(Step(command, expected, "", 0))
            continue
        done = subprocess.run(command, shell=True, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        step = Step(command, expected, output, done.returncode)
        failed = bool(expected) and expected[0].startswith("error (")
        assert (done.returncode != 0) == failed, f"$ {command}\nexit {done.returncode}\n{output}"
        words = set(mask(output))
        for line in expected:
            if "downloading" in line:  # a progress bar: its speed and timing are not the output's content
                continue
            missing = [w for w in mask(line) if w not in words]
            assert not missing, f"$ {command}\nexpected {line!r}, missing {missing}\ngot:\n{output}"
        steps.append(step)
    return steps
