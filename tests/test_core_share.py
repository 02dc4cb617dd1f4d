"""Cores shared between the engine and training steps on one machine (livelora.adapters.core_share): the
trainer's flag is held exactly while a step runs, a dead holder counts as absent, and the transformers engine
decodes with fewer torch threads while the flag is held and with all of them otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import torch

from livelora.adapters.core_share import TrainingFlag
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


def test_engine_uses_fewer_threads_while_a_step_runs(base_ref, tmp_path):
    full = torch.get_num_threads()
    engine = create_engine("transformers", model=base_ref.name, device="cpu", max_batch_size=2, num_threads=2,
                           share_cores=True, threads_while_training=1)
    flag = TrainingFlag(engine._home)  # the store the engine was built on (the tests' LIVELORA_HOME)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start())
        prompt = engine.tokenizer.encode("Hello")

        async def generate() -> int:
            chunks = [c async for c in engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))]
            return sum(len(c.token_ids) for c in chunks)

        assert loop.run_until_complete(generate()) == 3
        assert engine._worker.threads == 2
        with flag.held():
            assert loop.run_until_complete(generate()) == 3
            assert engine._worker.threads == 1  # read back by the engine's own thread
        assert loop.run_until_complete(generate()) == 3
        assert engine._worker.threads == 2
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
        torch.set_num_threads(full)
