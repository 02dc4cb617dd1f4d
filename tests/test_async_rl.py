"""Asynchronous RL building blocks: sampler versions and the staleness bound (dropping), and a step's gradient
accumulated over mini-batches equal to the full batch's (live session server, real SmolLM2)."""

from __future__ import annotations

import threading

import pytest

from livelora.clients.recipes.async_rl import AsyncSampler, Batch, forward_backward_minibatches, fresh_enough
from livelora.clients.recipes.datums import rl_datum
from livelora.clients.recipes.sdk import Sdk, tolist


def test_the_staleness_rule_drops_batches_older_than_the_bound():
    assert fresh_enough(Batch(0, 3, None), 5, 2) and fresh_enough(Batch(0, 5, None), 5, 0)
    assert not fresh_enough(Batch(0, 2, None), 5, 2)


def test_async_sampler_records_versions_and_drops_stale_batches():
    release = threading.Event()

    def sample(index: int, sampler: str) -> str:
        if index == 0:
            release.wait(10)  # batch 0 is slow: the trainer moves on without it
        return f"{index}@{sampler}"

    pool = AsyncSampler(sample, "w0", 0, workers=2, queue_size=1)
    try:
        first, dropped = pool.next_fresh(0, 1)
        assert (first.index, first.sampler_version, first.data, dropped) == (1, 0, "1@w0", 0)
        pool.update("w1", 1)
        pool.update("w2", 2)
        pool.update("w3", 3)
        release.set()  # batch 0 (version 0) arrives at trainer version 3: staleness 3 > 1, dropped
        seen = []
        while len(seen) < 2:
            batch, dropped = pool.next_fresh(3, 1)
            seen.append((batch.sampler_version, dropped))
            assert 3 - batch.sampler_version <= 1
        assert sum(d for _, d in seen) >= 1  # batch 0, and any other batch drawn before "w3", were dropped
    finally:
        pool.close()


def test_async_sampler_draws_no_batch_past_the_last_unless_one_was_dropped():
    drawn, started1, gate = [], threading.Event(), threading.Event()

    def sample(index: int, sampler: str) -> int:
        drawn.append(index)
        if index == 1:
            started1.set()
            gate.wait(10)
        return index

    pool = AsyncSampler(sample, "w0", 0, queue_size=5, last_index=2)
    try:
        assert pool.next_fresh(0, 0)[0].data == 0
        assert started1.wait(10)
        pool.update("w5", 5)  # batch 1 was drawn at version 0: staleness 5 at trainer version 5
        gate.set()
        assert [(b.index, b.sampler_version, d) for b, d in [pool.next_fresh(5, 0)]] == [(2, 5, 1)]
        assert [(b.index, b.sampler_version, d) for b, d in [pool.next_fresh(5, 0)]] == [(3, 5, 0)]  # replaces 1
    finally:
        pool.close()
    for t in pool._threads:
        t.join(10)
    assert drawn == [0, 1, 2, 3]  # never 4: batches 0, 2 and 3 train, batch 1 was dropped


def test_a_sampler_error_reaches_the_trainer():
    def sample(index, sampler):
        raise RuntimeError(f"sampling {index} failed")

    pool = AsyncSampler(sample, None, 0)
    with pytest.raises(RuntimeError, match="sampling 0 failed"):
        pool.next_fresh(0, 0)
    pool.close()


def test_minibatch_accumulation_equals_the_full_batch_gradient(sessions_server, tokenizer):
    sdk = Sdk.load("livelora", sessions_server.base_url)
    texts = [
        "def add(a, b):\n    return a + b",
        "print(sorted([3, 1, 2]))",
        "x = [i * i for i in range(4)]",
        "y = 1 + 2 + 3",
    ]
    data = []
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        prompt, completion = ids[:2], ids[2:]
        data.append(rl_datum(sdk, prompt, completion, [-1.5 - 0.1 * i] * len(completion), 1.0 if i % 2 else -0.5))
    adam = sdk.adam(1e-3)
    service = sdk.service()
    figures = []
    for minibatches in (1, 3):
        tc = service.create_lora_training_client(base_model="smollm2-135m-instruct", rank=4, seed=7)
        outputs, loss_sum = forward_backward_minibatches(tc, data, "cispo", minibatches)
        step = tc.optim_step(adam).result().metrics
        after = tc.forward(data, "cispo").result()
        figures.append((loss_sum, step, [tolist(o["logprobs"]) for o in outputs], after.metrics["loss:sum"]))
    (full_loss, full_step, full_lps, full_after), (mini_loss, mini_step, mini_lps, mini_after) = figures
    assert full_step["grad_norm:mean"] > 0
    assert mini_step["grad_norm:mean"] == pytest.approx(full_step["grad_norm:mean"], rel=1e-4)
    assert mini_step["update_norm:mean"] == pytest.approx(full_step["update_norm:mean"], rel=1e-4)
    assert mini_loss == pytest.approx(full_loss, rel=1e-5)
    flat = lambda lps: [x for lp in lps for x in lp]  # noqa: E731
    assert flat(mini_lps) == pytest.approx(flat(full_lps), abs=1e-4)
    assert mini_after == pytest.approx(full_after, rel=1e-4)  # the same update: the same weights after it
