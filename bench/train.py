"""Training-step throughput: livelora's TrainingModel vs TRL's SFTTrainer and KTOTrainer on one identical batch.

Batch: 8 sequences x 256 trained positions built from GSM8K (``../shared/data/gsm8k/train.jsonl`` beside the
repository), LoRA rank 16 on every linear layer of the decoder, float32, no gradient checkpointing on either
side, AdamW lr 1e-4. Prints time per step (forward + backward + optimizer step, after a warm-up step), tokens/s
and the first step's losses (which must agree) for SFT and KTO. Figures only. The setup in detail:
``docs/internals/bench.md``.

Usage: ``python bench/train.py [--steps 1] [--batch 8] [--seq-len 256] [--rank 16] [--skip-trl]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_TOKENS = 64


def gsm8k_texts(n: int) -> list[str]:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[: 20 * n]]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def sft_sequences(tokenizer, batch: int, seq_len: int) -> list[list[int]]:
    """``batch`` token sequences of exactly ``seq_len + 1`` tokens (GSM8K rows concatenated)."""
    texts, seqs, buf = iter(gsm8k_texts(batch * 8)), [], []
    while len(seqs) < batch:
        buf += tokenizer(next(texts) + "\n\n")["input_ids"]
        if len(buf) >= seq_len + 1:
            seqs.append(buf[: seq_len + 1])
            buf = []
    return seqs


def kto_examples(tokenizer, seqs: list[list[int]]) -> tuple[list[str], list[str], list[list[int]], list[list[int]]]:
    """Prompt/completion strings and the token ids TRL's KTO tokenisation gives them."""
    prompts = [tokenizer.decode(s[:PROMPT_TOKENS]) for s in seqs]
    completions = [tokenizer.decode(s[PROMPT_TOKENS:]) for s in seqs]
    p_ids, c_ids = [], []
    for p, c in zip(prompts, completions):
        pi = tokenizer(p)["input_ids"]
        pc = tokenizer(p + c + tokenizer.eos_token)["input_ids"]
        k = next((i for i, (a, b) in enumerate(zip(pi, pc)) if a != b), min(len(pi), len(pc)))
        p_ids.append(pi[:k])
        c_ids.append(pc[k:])
    return prompts, completions, p_ids, c_ids


def datum(tokens: list[int], first_trained: int, label: float | None = None):
    from livelora.clients.types import Datum, ModelInput, TensorData

    n = len(tokens) - 1
    inputs = {
        "target_tokens": TensorData.from_list(tokens[1:], "int64"),
        "weights": TensorData.from_list([0.0 if j < first_trained else 1.0 for j in range(n)], "float32"),
    }
    if label is not None:
        inputs["label"] = TensorData.from_list([label], "float32")
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def run_ours(ref, data, loss_fn: str, steps: int, rank: int) -> tuple[float, float]:
    """Seconds per step (mean over ``steps``) and the first step's loss."""
    from livelora.clients.types import AdamParams, LoraConfig
    from livelora.trainer.model import TrainingModel

    model = TrainingModel(ref, LoraConfig(rank=rank, alpha=2.0 * rank, seed=0, train_unembed=False))
    adam = AdamParams(learning_rate=1e-4, beta2=0.95)
    times, first_loss = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model.forward_backward(data, loss_fn, {"beta": 0.1} if loss_fn == "kto" else None)
        model.optim_step(adam)
        times.append(time.perf_counter() - t0)
        first_loss = out.metrics["loss:sum"] if first_loss is None else first_loss
    del model
    timed = times[1:] if len(times) > 1 else times  # the first step warms up allocators and thread pools
    return sum(timed) / len(timed), float(first_loss)


def _trl_common(tmp: str, batch: int, steps: int) -> dict:
    return dict(
        output_dir=tmp,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-12,
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )


def run_trl(ref, tokenizer, kind: str, steps: int, rank: int, batch: int, seqs=None, kto=None) -> tuple[float, float]:
    """TRL's trainer on the same batch: seconds per step and the first step's logged loss."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from livelora.core.base_models import load_model

    class Timer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    peft_config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
    )
    model = load_model(ref)
    timer = Timer()
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "sft":
            from trl import SFTConfig, SFTTrainer

            args = SFTConfig(**_trl_common(tmp, batch, steps), max_length=None, packing=False)
            trainer = SFTTrainer(
                model=model,
                args=args,
                train_dataset=Dataset.from_dict({"input_ids": seqs}),
                processing_class=tokenizer,
                peft_config=peft_config,
                callbacks=[timer],
            )
        else:
            from trl import KTOConfig, KTOTrainer

            prompts, completions, labels = kto
            args = KTOConfig(**_trl_common(tmp, batch, steps), beta=0.1, max_length=None)
            ds = Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})
            trainer = KTOTrainer(
                model=model,
                args=args,
                train_dataset=ds,
                processing_class=tokenizer,
                peft_config=peft_config,
                callbacks=[timer],
            )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = timer.times[1:] if len(timer.times) > 1 else timer.times
    return sum(timed) / len(timed), float(losses[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="steps run per configuration; with more than one, the first (warm-up) is not timed",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="trained positions per sequence")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from livelora.core.base_models import load_tokenizer, resolve_base_model
    from livelora.core.settings import CommonSettings

    settings = CommonSettings()
    ref = resolve_base_model(settings.model, settings.home)
    tokenizer = load_tokenizer(ref)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}, model {ref.name}, "
        f"batch {args.batch} x {args.seq_len}, LoRA rank {args.rank} on {','.join(TARGETS)}"
    )

    seqs = sft_sequences(tokenizer, args.batch, args.seq_len)
    sft_data = [datum(s, 0) for s in seqs]
    sft_tokens = args.batch * args.seq_len
    prompts, completions, p_ids, c_ids = kto_examples(tokenizer, seqs)
    labels = [i % 2 == 0 for i in range(args.batch)]
    kto_data = [datum(p + c, len(p) - 1, 1.0 if lab else 0.0) for p, c, lab in zip(p_ids, c_ids, labels)]
    kto_tokens = sum(len(p) + len(c) - 1 for p, c in zip(p_ids, c_ids))

    rows = []
    t, loss = run_ours(ref, sft_data, "cross_entropy", args.steps, args.rank)
    rows.append(("SFT", "livelora", t, sft_tokens / t, loss / sft_tokens, loss))
    if not args.skip_trl:
        t, loss = run_trl(ref, tokenizer, "sft", args.steps, args.rank, args.batch, seqs=seqs)
        rows.append(("SFT", "TRL SFTTrainer", t, sft_tokens / t, loss, loss * sft_tokens))
    t, loss = run_ours(ref, kto_data, "kto", args.steps, args.rank)
    rows.append(("KTO", "livelora", t, kto_tokens / t, loss, None))
    if not args.skip_trl:
        t, loss = run_trl(ref, tokenizer, "kto", args.steps, args.rank, args.batch, kto=(prompts, completions, labels))
        rows.append(("KTO", "TRL KTOTrainer", t, kto_tokens / t, loss, None))

    print(f"\n{'step':<5}{'implementation':<17}{'s/step':>9}{'tokens/s':>11}{'loss (mean)':>13}{'loss (sum)':>12}")
    for kind, impl, t, tps, mean, total in rows:
        tot = f"{total:12.2f}" if total is not None else f"{'-':>12}"
        print(f"{kind:<5}{impl:<17}{t:9.2f}{tps:11.1f}{mean:13.5f}{tot}")
    print("(SFT loss mean = nats/token over all trained positions; KTO loss = mean over examples for both)")
    for kind in ("SFT", "KTO"):
        pair = [r for r in rows if r[0] == kind]
        if len(pair) == 2:
            print(f"{kind} speed ratio livelora / TRL: {pair[0][3] / pair[1][3]:.2f}x")


if __name__ == "__main__":
    main()
