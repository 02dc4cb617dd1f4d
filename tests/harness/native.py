"""Tests that run llama.cpp: a crash of its native code fails one test (or skips it where the build is known to
crash on this CPU) instead of ending the pytest run.

* :func:`skip_if_native_crashes`: before a test (or a module's engine) loads llama.cpp in this process, the
  canary generation (:mod:`livelora.gateway.engines.llama_cpp.canary`) runs in a child process, once per session
  and weight format; when it crashes, the test is skipped with the canary's reason (signal, CPU flags, version).
* :func:`in_child`: run a function in a spawned child process; a child killed by a signal fails the test with
  the signal named (a skip, with the canary's reason, where the canary crashes too).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import traceback
from pathlib import Path

import pytest

from livelora.core.settings import DEFAULT_MODEL
from livelora.gateway.engines.llama_cpp.canary import native_build, run_canary, signal_name


@functools.cache
def native_crash(weights: str = "f16", crash_at: str | None = None) -> str | None:
    """The canary's message for the built-in model's GGUF served as ``weights`` on this machine, ``None`` when it
    generates (``crash_at``: the crash test hook's value, part of the cache key; the child reads the environment)."""
    home = Path(os.environ.get("LIVELORA_HOME") or Path(__file__).resolve().parents[2] / ".livelora-home")
    failure = run_canary(DEFAULT_MODEL, home, weights, threads=2)
    return failure.message if failure is not None and failure.signal is not None else None


def _crash_here(weights: str) -> str | None:
    from livelora.gateway.engines.llama_cpp.model import CRASH_ENV

    return native_crash(weights, os.environ.get(CRASH_ENV))


def skip_if_native_crashes(weights: str = "f16") -> None:
    """Skip the calling test when llama.cpp's canary with ``weights`` is killed by a signal on this machine (the
    reason names it); a canary that fails otherwise skips nothing (the test shows the error)."""
    message = _crash_here(weights)
    if message is not None:
        pytest.skip(message)


def _child(conn, fn, args) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as exc:  # sent back whole: the parent raises it with the child's traceback
        conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    conn.close()


def in_child(fn, *args, weights: str = "f16", timeout: float = 600):
    """``fn(*args)`` run in a spawned child process (``fn`` importable, arguments and result picklable).

    Raises:
        pytest.fail: the child was killed by a signal (named), or ran past ``timeout`` seconds, or raised (its
            traceback in the message). pytest.skip: killed by a signal where the canary with ``weights`` crashes too.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
    proc.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:  # died before it answered
            pass
    proc.join(30 if result is not None else timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"the child process running {fn.__name__} did not finish in {timeout:.0f} s")
    if result is None:
        code = proc.exitcode
        if code is not None and code < 0:
            canary = _crash_here(weights)
            if canary is not None:
                pytest.skip(f"{fn.__name__} was killed by {signal_name(code)}: {canary}")
            pytest.fail(f"the child process running {fn.__name__} was killed by {signal_name(code)} ({native_build()})")
        pytest.fail(f"the child process running {fn.__name__} exited with status {code} without an answer")
    ok, value = result
    if not ok:
        pytest.fail(f"{fn.__name__} raised in its child process: {value}", pytrace=False)
    return value


def llama_cpp_logits(gguf: str, ids: list[int], lora: str | None = None) -> list[list[float]]:
    """llama-cpp-python's ``Llama`` on ``gguf`` (with the GGUF LoRA ``lora``): the logits after each of ``ids``
    ``(len(ids), vocab)``; for :func:`in_child`."""
    from llama_cpp import Llama

    kw = {"lora_path": lora} if lora else {}
    llm = Llama(gguf, n_ctx=128, logits_all=True, verbose=False, **kw)
    llm.eval(ids)
    got = [list(map(float, row)) for row in llm.scores[: len(ids)]]
    llm.close()
    return got
