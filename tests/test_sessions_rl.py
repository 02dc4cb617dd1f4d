"""A GRPO-style RL loop (group advantages, importance_sampling) on two-digit addition through the SDK."""

from __future__ import annotations

import random

import pytest
import torch
from harness.server import MODEL

from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.trainer.losses import group_advantages

GROUP = 4
STEPS = 3


def reward(text: str, answer: str) -> float:
    """Fraction of the answer's digits the completion gets right, position by position."""
    got = text.strip()
    return sum(a == b for a, b in zip(got, answer)) / len(answer)


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> Datum:
    n_prompt = len(prompt) - 1
    full = prompt + tokens
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(full[1:], "int64"),
            "logprobs": TensorData.from_list([0.0] * n_prompt + logprobs, "float32"),
            "advantages": TensorData.from_list([0.0] * n_prompt + [advantage] * len(tokens), "float32"),
        },
    )


def test_grpo_loop_on_addition(sessions_server, tokenizer):
    rng = random.Random(0)
    with ServiceClient(sessions_server.base_url, heartbeat_s=2.0) as service:
        tc = service.create_lora_training_client(MODEL, rank=4, alpha=8, seed=0)
        adapters = set()
        for step in range(STEPS):
            sampler = tc.save_weights_and_get_sampling_client()
            adapters.add(sampler.adapter)
            problems = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(2)]
            prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in problems]
            futs = [
                sampler.sample(
                    ModelInput.from_ints(p), GROUP, SamplingParams(max_tokens=3, temperature=1.0, seed=step * 10 + i)
                )
                for i, p in enumerate(prompts)
            ]
            data, expected = [], 0.0
            rewards_all = []
            for (a, b), prompt, fut in zip(problems, prompts, futs):
                seqs = fut.result(timeout=300).sequences
                assert len(seqs) == GROUP and all(len(s.tokens) == len(s.logprobs) > 0 for s in seqs)
                rewards = torch.tensor([reward(tokenizer.decode(s.tokens), str(a + b)) for s in seqs])
                rewards_all += rewards.tolist()
                advs = group_advantages(rewards.unsqueeze(0))[0]
                for s, adv in zip(seqs, advs.tolist()):
                    data.append(rl_datum(prompt, s.tokens, s.logprobs, adv))
                    expected -= adv * len(s.tokens)  # IS loss at ratio 1: -sum(A) over sampled tokens
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(AdamParams(learning_rate=5e-4))
            loss = fb.result(timeout=300).metrics["loss:sum"]
            # on-policy: the trainer's logprobs equal the sampler's, so the ratio is 1 up to float noise
            scale = sum(abs(float(d.loss_fn_inputs["advantages"].data[-1])) * 3 for d in data) + 1e-6
            assert loss == pytest.approx(expected, abs=1e-2 * scale + 1e-4), (loss, expected)
            assert opt.result(timeout=300).metrics["step:max"] == step + 1
            print(f"step {step}: mean reward {sum(rewards_all) / len(rewards_all):.3f} loss {loss:.4f}")
        assert len(adapters) == STEPS  # each step sampled a fresh snapshot of the weights
