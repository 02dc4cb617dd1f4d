"""Reinforcement learning (GRPO-style) on two-digit addition through the training-session API.

Run a server, then this script::

    livelora serve
    python clients/examples/rl_loop.py --steps 5 --group-size 4

Each step: snapshot the weights for sampling, sample ``group_size`` answers per problem, score them
(fraction of answer digits right), centre rewards within each group (advantages), and train with the
``importance_sampling`` loss on the sampled tokens with the sampler's logprobs. Prints mean reward and loss.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.clients.tokens import encode_text  # text is plain text: no control tokens from it


@dataclass
class Config:
    base_url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    rank: int = 8
    lr: float = 5e-4
    steps: int = 5
    problems: int = 4
    group_size: int = 4
    max_tokens: int = 4
    seed: int = 0


def reward(text: str, answer: str) -> float:
    got = text.strip()
    return sum(a == b for a, b in zip(got, answer)) / len(answer)


def advantages(rewards: list[float]) -> list[float]:
    """GRPO group baseline (no std normalisation, as tinker-cookbook ``compute_advantages``)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def main(cfg: Config) -> None:
    rng = random.Random(cfg.seed)
    with ServiceClient(cfg.base_url) as service:
        tc = service.create_lora_training_client(cfg.model, rank=cfg.rank)
        tokenizer = tc.get_tokenizer()
        for step in range(cfg.steps):
            sampler = tc.save_weights_and_get_sampling_client()
            problems = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(cfg.problems)]
            prompts = [encode_text(tokenizer, f"{a}+{b}=", add_special_tokens=True) for a, b in problems]
            params = SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0)
            futures = [sampler.sample(ModelInput.from_ints(p), cfg.group_size, params) for p in prompts]
            data, all_rewards = [], []
            for (a, b), prompt, fut in zip(problems, prompts, futures):
                seqs = fut.result().sequences
                rewards = [reward(tokenizer.decode(s.tokens), str(a + b)) for s in seqs]
                all_rewards += rewards
                for s, adv in zip(seqs, advantages(rewards)):
                    full, n_prompt = prompt + s.tokens, len(prompt) - 1
                    data.append(
                        Datum(
                            model_input=ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={
                                "target_tokens": TensorData.from_list(full[1:], "int64"),
                                "logprobs": TensorData.from_list([0.0] * n_prompt + list(s.logprobs), "float32"),
                                "advantages": TensorData.from_list([0.0] * n_prompt + [adv] * len(s.tokens), "float32"),
                            },
                        )
                    )
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(AdamParams(learning_rate=cfg.lr))
            loss, metrics = fb.result().metrics["loss:sum"], opt.result().metrics
            print(
                f"step {step + 1:3d}  mean reward {sum(all_rewards) / len(all_rewards):.3f}  loss {loss:+.4f}  "
                f"grad_norm {metrics['grad_norm:mean']:.3f}  sampler {sampler.adapter}",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    main(Config(**vars(parser.parse_args())))
