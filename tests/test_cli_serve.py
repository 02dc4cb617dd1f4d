"""``livelora serve`` (the README's first command) starts a working OpenAI-compatible server."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from harness.native import skip_if_native_crashes
from typer.testing import CliRunner

from livelora.cli.main import app


def test_help_lists_serve_and_its_flags():
    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in ("--model", "--host", "--port", "--home", "--engine"):
        assert flag in result.output


def _command_paths(group, path=()):
    import typer

    cmd = typer.main.get_command(group) if isinstance(group, typer.Typer) else group
    yield path
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _command_paths(sub, (*path, name))


def test_every_help_page_tags_no_flag_and_wraps_whole_paragraphs():
    paths = list(_command_paths(app))
    assert ("serve",) in paths and ("adapters", "list") in paths and ("recipe", "gsm8k-rl") in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, (path, result.output)  # a flag takes no value
        lines = result.output.splitlines()
        assert all(len(line) <= 100 for line in lines), path
        # a group lists each command's first sentence whole, never cut off with "..."
        assert not [line for line in lines[1:] if line.endswith("...")], (path, result.output)
        # a description's line is broken by the wrapper, not where the docstring's source line ended
        panels = [i for i, line in enumerate(lines) if line in ("Arguments:", "Options:", "Commands:")]
        prose = [line.strip() for line in lines[1 : min(panels, default=len(lines))] if line.strip()]
        short = [line for line in prose[:-1] if len(line) < 40 and not line.endswith((".", ":", ")"))]
        assert not short, (path, short)


def test_invalid_flag_value_exits_with_a_message(monkeypatch):
    result = CliRunner().invoke(app, ["serve", "--port", "70000"])
    assert result.exit_code == 2
    assert "LIVELORA_PORT" in result.output and "port" in result.output
    # a bad environment variable is named as the user wrote it, with the field it sets
    monkeypatch.setenv("LIVELORA_ENGINE_MERGE_LORA", "maybe")
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2
    assert "LIVELORA_ENGINE_MERGE_LORA (engine_merge_lora)" in " ".join(result.output.split())


@pytest.mark.parametrize("engine", ["transformers", "llama_cpp"])
def test_serve_answers_chat_completions_on_the_given_port(own_store, engine):
    """On a store and Redis prefix of its own (``own_store``)."""
    if engine == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed here (pip install -e '.[dev]' builds it)")
    if engine == "llama_cpp":  # a build that crashes here: serve refuses to start (tests/test_native_crash.py)
        skip_if_native_crashes()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home, prefix = own_store
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "livelora.cli.main",
            "serve",
            "--port",
            str(port),
            "--home",
            str(home),
            "--max-batch-size",
            "2",
            "--engine",
            engine,
            "--log-level",
            "warning",
        ],
        env={**os.environ, "LIVELORA_REDIS_PREFIX": prefix},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                ready = health.status_code == 200 and health.json()["engine"] == engine
            except httpx.HTTPError:
                pass
            if ready:
                break
            time.sleep(0.3)
        assert ready, "server did not start"
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=120,
            json={
                "model": "smollm2-135m-instruct",
                "temperature": 0,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            },
        )
        assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert f"http://127.0.0.1:{port}/v1" in output  # the start-up message names the URL
    assert proc.returncode == 0


def test_settings_lists_every_variable_of_a_process_kind_as_the_environment_reads_it(monkeypatch):
    """`livelora settings` is generated from the settings classes: every section field of every process kind is
    listed once, and each listed variable really sets its field (checked by setting each number/bool one to a
    changed value)."""
    from pydantic import ValidationError

    from livelora.cli.settings import PROCESS_SETTINGS
    from livelora.cli.settings_table import setting_rows

    for cls, kind in zip(PROCESS_SETTINGS, ("gateway", "trainer", "serve")):
        rows = list(setting_rows(kind))
        names = [r[0] for r in rows]
        assert len(names) == len(set(names))
        fields = {(sec, name) for sec, sc in cls.section_types().items() for name in sc.model_fields}
        listed = {(sec, env) for env, sec, _d, _t in rows}
        for sec, name in fields:
            prefix = cls.section_types()[sec].model_config.get("env_prefix", "LIVELORA_")
            assert any(env == f"{prefix}{name}".upper() for _s, env in listed), (kind, sec, name)
        for env, sec, default, _text in rows:
            if sec == "common" or default in ("-", "(computed)"):
                continue
            field = env.removeprefix(
                cls.section_types()[sec].model_config.get("env_prefix", "LIVELORA_").upper()
            ).lower()
            current = getattr(getattr(cls(), sec), field)
            if isinstance(current, bool):
                value, expect = ("false" if current else "true"), not current
            elif isinstance(current, int) and field not in ("port",):
                value, expect = str(current + 1), current + 1
            else:
                continue
            with monkeypatch.context() as m:
                m.setenv(env, value)
                try:
                    got = getattr(getattr(cls(), sec), field)
                except ValidationError as exc:  # a bound (e.g. le=19) refuses default + 1: it was still read
                    assert any(err["loc"][-1] == field for err in exc.errors()), (kind, env, exc)
                    continue
                assert got == expect, (kind, env, value, got)
    result = CliRunner().invoke(app, ["settings", "serve", "--grep", "merge_lora"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "LIVELORA_ENGINE_MERGE_LORA" in result.output
    assert CliRunner().invoke(app, ["settings", "nope"]).exit_code == 2


def test_a_taken_port_fails_at_once_before_anything_loads(livelora_home, monkeypatch):
    monkeypatch.setenv("LIVELORA_REDIS_URL", "redis://127.0.0.1:1/0")  # never reached: the port is checked first
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in ("serve", "gateway"):
            result = CliRunner().invoke(app, [command, "--port", str(port), "--home", str(livelora_home)])
            assert result.exit_code == 1, result.output
            out = " ".join(result.output.split())
            assert f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out, out
            assert "serving" not in out and "Redis" not in out  # nothing was started or loaded
