"""Cores shared between the engine and training steps on one machine (livelora.core.cpu_share): the
trainer's flag is held exactly while a step runs, a dead holder counts as absent, and the transformers engine
decodes with fewer torch threads while the flag is held and with all of them otherwise; the other way round,
the engine beats a serving flag while it has work, and a trainer process's steps take every core only while
nothing has been served for SERVING_WINDOW_S."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from livelora.core import cpu_share
from livelora.core.cpu_share import SERVING_WINDOW_S, ServingFlag, StepPacer, StepThreads, TrainingFlag
from livelora.gateway.engines import SamplingParams, create_engine


def test_flag_is_held_only_inside_the_block_and_a_dead_holder_counts_as_absent(tmp_path):
    flag = TrainingFlag(tmp_path)
    assert not flag.active()
    with flag.held():
        assert flag.active()
        assert TrainingFlag(tmp_path).active()  # another reader (the engine) sees it
    assert not flag.active() and not flag.path.exists()
    try:
        with flag.held():
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    assert not flag.active()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    flag.path.parent.mkdir(parents=True, exist_ok=True)
    flag.path.write_text(dead.stdout.strip())  # a trainer killed mid-step left its flag behind
    assert not flag.active()


def test_serving_flag_counts_recent_beats_of_a_live_engine_and_steps_take_all_cores_only_when_idle(tmp_path):
    flag = ServingFlag(tmp_path)
    assert not flag.busy()
    flag.beat()
    assert flag.busy() and ServingFlag(tmp_path).busy()  # another process (the trainer) reads it
    first = flag.path.stat().st_mtime_ns
    flag.beat()  # within BEAT_EVERY_S: no write
    assert flag.path.stat().st_mtime_ns == first
    past = time.time() - SERVING_WINDOW_S - 1
    os.utime(flag.path, (past, past))  # the engine has been idle for longer than the window
    assert not flag.busy()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    flag.path.write_text(dead.stdout.strip())  # a killed engine's fresh file
    assert not flag.busy()

    full = torch.get_num_threads()
    try:
        threads = StepThreads(tmp_path, busy=1, idle=2)
        assert threads.apply() == 2 and torch.get_num_threads() == 2  # nothing served: every core
        ServingFlag(tmp_path).beat()
        assert threads.apply() == 1 and torch.get_num_threads() == 1  # serving: the budget
        cpu_share.configure_training_steps(tmp_path, busy=1, idle=1)  # equal: nothing to choose
        assert cpu_share.apply_step_threads() is None
        cpu_share.configure_training_steps(tmp_path, busy=1, idle=2)
        assert cpu_share.apply_step_threads() == 1
    finally:
        cpu_share.configure_training_steps(tmp_path, busy=1, idle=1)
        torch.set_num_threads(full)


def test_pacer_keeps_the_steps_share_of_time_at_its_duty_only_while_serving(tmp_path, monkeypatch):
    clock = {"now": 1000.0}
    slept: list[float] = []  # each pause's total (the pacer sleeps in slices of BEAT_EVERY_S)
    marks: list[bool] = []  # the pause listener's calls
    stop_serving_after = {"slices": None}

    def sleep(seconds: float) -> None:
        assert 0 < seconds <= cpu_share.BEAT_EVERY_S
        slept[-1] += seconds
        clock["now"] += seconds
        left = stop_serving_after["slices"]
        if left is not None:
            stop_serving_after["slices"] = left - 1
            if left - 1 == 0:  # the engine stops beating: its file grows old
                past = time.time() - SERVING_WINDOW_S - 1
                os.utime(ServingFlag(tmp_path).path, (past, past))

    def listener(pausing: bool) -> None:
        marks.append(pausing)
        if pausing:
            slept.append(0.0)

    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(cpu_share.time, "sleep", sleep)
    pacer = StepPacer(tmp_path, duty=0.25, max_pause_s=60.0)
    pacer.listener = listener
    assert pacer.pause_before_step() == 0.0 and pacer.between() == 0.0  # no step yet
    pacer.begin()
    clock["now"] += 1.0
    assert pacer.between() == 0.0 and slept == [] and marks == []  # nothing is served: never a pause
    ServingFlag(tmp_path).beat()  # an engine serves: duty ¼ → 3 s of pause per active second
    clock["now"] += 1.0  # 2 s active since the step began
    assert pacer.between() == pytest.approx(6.0) and slept == [pytest.approx(6.0)] and marks == [True, False]
    clock["now"] += 1.0  # 3 s active: 9 s owed, 6 paid
    assert pacer.between() == pytest.approx(3.0)
    clock["now"] += 2.0  # 5 s active when the step ends: 15 owed, 9 paid
    pacer.end()
    clock["now"] += 4.0  # 4 s idle (waiting for a batch) count as paid
    assert pacer.wait_before_step() == pytest.approx(2.0)  # what a worker defers its next step by
    assert pacer.pause_before_step() == pytest.approx(2.0)
    assert pacer.wait_before_step() == 0.0  # paid
    pacer.begin()
    clock["now"] += 40.0  # a 40 s pass with no yield point in it
    assert pacer.between() == pytest.approx(60.0)  # 120 s owed: capped at max_pause_s
    pacer.end()
    assert pacer.wait_before_step() == pytest.approx(60.0)
    assert pacer.pause_before_step() == pytest.approx(60.0)  # the remaining 60 s before the next step
    assert pacer.paused_s == pytest.approx(131.0)
    assert slept == [pytest.approx(x) for x in (6.0, 3.0, 2.0, 60.0, 60.0)] and marks == [True, False] * 5
    pacer.begin()
    clock["now"] += 10.0  # 30 s owed; serving stops after 2 s of the pause: the step goes on at once
    stop_serving_after["slices"] = 4
    assert pacer.between() == pytest.approx(4 * cpu_share.BEAT_EVERY_S)
    assert pacer.between() == 0.0 and pacer.wait_before_step() == 0.0  # nothing served: no pause, no wait
    assert StepPacer(tmp_path, duty=1.0).between() == 0.0

    assert cpu_share.step_yield() == 0.0 and cpu_share.step_wait() == 0.0  # not configured: no-ops
    assert cpu_share.serving_duty() is None
    ServingFlag(tmp_path).path.unlink()
    ServingFlag(tmp_path).beat()
    cpu_share.configure_training_steps(tmp_path, busy=1, idle=1, duty=0.5)
    cpu_share.on_step_pause(listener)
    try:
        assert cpu_share.serving_duty() == 0.5
        with cpu_share.training_step():  # no step before: no pause before it
            clock["now"] += 3.0  # 3 s of work, then a yield point: 3 s of pause (duty ½)
            assert cpu_share.step_yield() == pytest.approx(3.0)
            clock["now"] += 1.0
        assert cpu_share.step_wait() == pytest.approx(1.0)  # the 1 s after the last yield point is still owed
        with cpu_share.training_step():  # paid before the next step
            pass
        assert slept[-2:] == [pytest.approx(3.0), pytest.approx(1.0)]
        assert cpu_share.step_yield() == 0.0  # outside a step
    finally:
        cpu_share.configure_training_steps(tmp_path, busy=1, idle=1)
    assert cpu_share._pacer is None


def test_engine_uses_fewer_threads_while_a_step_runs(base_ref, tmp_path):
    full = torch.get_num_threads()
    engine = create_engine(
        "transformers",
        model=base_ref.name,
        device="cpu",
        max_batch_size=2,
        num_threads=2,
        share_cores=True,
        threads_while_training=1,
    )
    flag = TrainingFlag(engine._home)  # the store the engine was built on (the tests' LIVELORA_HOME)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        prompt = engine.tokenizer.encode("Hello")

        async def generate() -> int:
            chunks = [c async for c in engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))]
            return sum(len(c.token_ids) for c in chunks)

        assert loop.run_until_complete(generate()) == 3
        assert engine._worker.backend.threads == 2
        with flag.held():
            assert loop.run_until_complete(generate()) == 3
            assert engine._worker.backend.threads == 1  # read back by the engine's own thread
        assert loop.run_until_complete(generate()) == 3
        assert engine._worker.backend.threads == 2
        assert ServingFlag(engine._home).busy()  # it beat while it had sequences to run
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
        torch.set_num_threads(full)
