"""Supervised fine-tuning through the training-session API, printing metrics per step.

Run a server, then this script::

    livelora serve                                  # http://127.0.0.1:8000
    python clients/examples/sl_loop.py --steps 10   # --base-url, --rank, --lr, --resume tinker://...

The data is a handful of question/answer pairs; the loss is cross-entropy on the answer tokens only
(``weights`` 0 on the prompt, 1 on the answer), summed over tokens (Tinker convention). A checkpoint with
optimizer state is saved at the end; pass it to ``--resume`` to continue exactly where it stopped.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from livelora.clients import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TensorData
from livelora.clients.tokens import encode_text  # text is plain text: no control tokens from it

PAIRS = [
    ("What is the capital of France?", " Paris."),
    ("What colour is the sky?", " Blue."),
    ("How many legs does a spider have?", " Eight."),
    ("What is 2+2?", " Four."),
]


@dataclass
class Config:
    base_url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    rank: int = 8
    lr: float = 1e-3
    steps: int = 10
    resume: str | None = None


def make_datum(tokenizer, prompt: str, answer: str) -> Datum:
    p, a = encode_text(tokenizer, prompt, add_special_tokens=True), encode_text(tokenizer, answer)
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(tokens[1:], "int64"),
            "weights": TensorData.from_list(weights, "float32"),
        },
    )


def main(cfg: Config) -> None:
    with ServiceClient(cfg.base_url) as service:
        if cfg.resume:
            tc = service.create_training_client_from_state_with_optimizer(cfg.resume)
        else:
            tc = service.create_lora_training_client(cfg.model, rank=cfg.rank)
        tokenizer = tc.get_tokenizer()
        batch = [make_datum(tokenizer, q, a) for q, a in PAIRS]
        n_answer = sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
        for _step in range(cfg.steps):
            t0 = time.monotonic()
            fb = tc.forward_backward(batch, "cross_entropy")  # both ops are queued at once and
            opt = tc.optim_step(AdamParams(learning_rate=cfg.lr))  # run in order on the server
            loss, metrics = fb.result().metrics["loss:sum"], opt.result().metrics
            print(
                f"step {int(metrics['step:max']):3d}  loss/token {loss / n_answer:.4f}  "
                f"grad_norm {metrics['grad_norm:mean']:.3f}  {time.monotonic() - t0:.2f}s",
                flush=True,
            )
        path = tc.save_state(f"sl-step-{int(metrics['step:max'])}", overwrite=True).result().path
        print(f"saved {path}")
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = ModelInput.from_ints(encode_text(tokenizer, PAIRS[0][0], add_special_tokens=True))
        out = sampler.sample(prompt, 1, SamplingParams(max_tokens=8, temperature=0.0)).result()
        print(
            f"{PAIRS[0][0]!r} -> {tokenizer.decode(out.sequences[0].tokens)!r} (model {sampler.adapter!r} is "
            "also served at /v1/chat/completions while this session lives)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Config()).items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=type(value) if value is not None else str, default=value
        )
    main(Config(**vars(parser.parse_args())))
