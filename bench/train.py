"""Training-step throughput: livelora's TrainingModel vs TRL's SFTTrainer and KTOTrainer on one identical batch.

Batch: 8 sequences x 256 trained positions built from GSM8K (``$LIVELORA_GSM8K``, else
``shared/data/gsm8k/train.jsonl`` beside the repository), LoRA rank 16 on every linear layer of the decoder,
float32, no gradient checkpointing on either side, AdamW lr 1e-4. Prints time per step (forward + backward +
optimizer step, after a warm-up step), tokens/s and the first step's losses (which must agree) for SFT and KTO.
Figures only. The setup in detail: ``docs/internals/bench.md``.

With ``--nproc N`` the same livelora steps also run on a trainer group of N ranks (``torchrun`` on this machine,
gloo on CPU, nccl with one GPU per rank; ``docs/scaling-out.md``): tokens/s of the group against one process, the
seconds per step each rank spends in collectives, and the group's first loss against the one process's (exit
status 1 when they differ by more than 1e-5 of their size); then the SFT step again with rank 0 leading and the
other ranks mirroring its model, as in ``livelora trainer --nproc N`` (its collectives include the broadcasts).

Usage: ``python bench/train.py [--steps 1] [--batch 8] [--seq-len 256] [--rank 16] [--skip-trl] [--nproc N]
[--shard-base]`` (``--shard-base``: the group's base weights sharded with FSDP2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GSM8K = Path(os.environ.get("LIVELORA_GSM8K") or REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl")
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


def run_ours(ref, data, loss_fn: str, steps: int, rank: int, group=None, device: str = "cpu") -> tuple[float, ...]:
    """Seconds per step (mean over ``steps``), the first step's loss and (in a group) this rank's seconds per step
    in collectives."""
    from livelora.clients.types import AdamParams, LoraConfig
    from livelora.trainer.model import TrainingModel

    lora = LoraConfig(rank=rank, alpha=2.0 * rank, seed=0, train_unembed=False)
    model = TrainingModel(ref, lora, group=group, device=device)
    adam = AdamParams(learning_rate=1e-4, beta2=0.95)
    times, comm, first_loss = [], [], None
    for _ in range(steps):
        c0 = group.collective_s if group is not None else 0.0
        t0 = time.perf_counter()
        out = model.forward_backward(data, loss_fn, {"beta": 0.1} if loss_fn == "kto" else None)
        model.optim_step(adam)
        times.append(time.perf_counter() - t0)
        comm.append((group.collective_s if group is not None else 0.0) - c0)
        first_loss = out.metrics["loss:sum"] if first_loss is None else first_loss
    del model
    timed = times[1:] if len(times) > 1 else times  # the first step warms up allocators and thread pools
    comm = comm[1:] if len(comm) > 1 else comm
    return sum(timed) / len(timed), float(first_loss), sum(comm) / len(comm)


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
    parser.add_argument("--nproc", type=int, default=0, help="also run the livelora steps on a group of N ranks")
    parser.add_argument(
        "--shard-base", action="store_true", help="with --nproc: the group shards the base weights (FSDP2)"
    )
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)  # set for the group's ranks
    parser.add_argument("--expect", default="", help=argparse.SUPPRESS)  # the one process's first losses
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

    if args.as_rank:
        group_ranks(args, ref, sft_data, sft_tokens, kto_data, kto_tokens)
        return
    rows = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t, loss, _ = run_ours(ref, sft_data, "cross_entropy", args.steps, args.rank, device=dev)
    rows.append(("SFT", "livelora", t, sft_tokens / t, loss / sft_tokens, loss))
    if not args.skip_trl:
        t, loss = run_trl(ref, tokenizer, "sft", args.steps, args.rank, args.batch, seqs=seqs)
        rows.append(("SFT", "TRL SFTTrainer", t, sft_tokens / t, loss, loss * sft_tokens))
    t, loss, _ = run_ours(ref, kto_data, "kto", args.steps, args.rank, device=dev)
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
    if args.nproc >= 1:  # the same steps on a group: torchrun starts the ranks, rank 0 prints and compares
        sys.stdout.flush()
        expect = ",".join(f"{r[5] if r[0] == 'SFT' else r[4]!r}" for r in rows if r[1] == "livelora")
        argv, skip = [], False  # the script's arguments without --nproc (torchrun would take it for its own)
        for a in sys.argv[1:]:
            if not skip and not a.startswith("--nproc") and a != "--skip-trl":
                argv.append(a)
            skip = a == "--nproc"
        argv += ["--skip-trl", "--as-rank", f"--expect={expect}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        sys.exit(subprocess.run([*cmd, __file__, *argv]).returncode)


def group_ranks(args, ref, sft_data, sft_tokens: int, kto_data, kto_tokens: int) -> None:
    """One rank of ``--nproc``: the livelora SFT and KTO steps on the group; rank 0 prints the figures."""
    from livelora.trainer.distributed import TrainerGroup

    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the machine's cores shared between the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    group = TrainerGroup.join(device=device, timeout_s=600, current=True, shard_base=args.shard_base)
    rows = []
    for kind, data, loss_fn, tokens in (
        ("SFT", sft_data, "cross_entropy", sft_tokens),
        ("KTO", kto_data, "kto", kto_tokens),
    ):
        t, loss, comm = run_ours(ref, data, loss_fn, args.steps, args.rank, group=group, device=device)
        rows.append((kind, t, tokens / t, comm, loss))
    # the group process's path (livelora trainer --nproc N): rank 0 leads and broadcasts each call (with the
    # model's state the first time), the other ranks make it on their replica (trainer/group_mirror.py)
    from livelora.trainer.group_mirror import GroupLeader, follow
    from livelora.trainer.recovery import restore_model

    if group.leader:
        leader = GroupLeader(group, lambda: None, heartbeat_s=60)
        t, loss, comm = run_ours(ref, sft_data, "cross_entropy", args.steps, args.rank, group=group, device=device)
        leader.close()
        rows.append(("SFT, rank 0 leading", t, sft_tokens / t, comm, loss))
    else:
        follow(group, lambda state, spec: restore_model(state, ref, device=device, max_seq_len=spec["max_seq_len"]))
    if group.leader:
        print(f"\ngroup of {group.world_size} ({group.backend}, {torch.get_num_threads()} threads per rank)")
        print(f"{'step':<20}{'s/step':>9}{'tokens/s':>11}{'collectives s/step':>20}{'first loss (sum)':>18}")
        for kind, t, tps, comm, loss in rows:
            print(f"{kind:<20}{t:9.2f}{tps:11.1f}{comm:20.3f}{loss:18.5f}")
        if args.expect:  # the group's first losses against the one process's (exit status 1 when they differ)
            expect = args.expect.split(",")
            expect.append(expect[0])  # rank 0 leading: the same SFT step
            diffs = [abs(r[4] - float(e)) / max(1.0, abs(float(e))) for r, e in zip(rows, expect)]
            print(f"first loss vs one process: relative |Δ| {max(diffs):.2e} (tolerance 1e-5)")
            if max(diffs) > 1e-5:
                group.close()
                sys.exit(1)
    group.close()


if __name__ == "__main__":
    main()
