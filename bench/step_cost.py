"""What one live-loop update costs the trainer: a KTO step on rated chat replies and the evaluation gate, per pass.

Builds ``--ratings`` KTO datums the way the live loop does and times, on ``--threads`` torch threads, the KTO
``forward_backward`` split into its passes (reference, policy, KL pairs, backward), ``optim_step`` and the gate's
measurement; the median of ``--repeats`` runs is printed. ``--compare`` also runs the code path without prompt
key/value sharing, alternating in the same process. Figures only. Method: ``docs/internals/bench.md``.

    python bench/step_cost.py --threads 1,2 --compare
    python bench/step_cost.py --history-turns 4 --compare      # multi-turn prompts (about 250 tokens)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_loop import PROMPTS

REPLY = (
    "Sure! Here is a short answer with a little more detail than strictly needed, because a typical reply "
    "from a small chat model runs for a few sentences and then adds a friendly closing remark at the end, "
    "like this one, which keeps going until the token budget is used up completely."
)


def build_datums(tokenizer, n: int, completion_tokens: int, history_turns: int):
    from livelora.clients.types.tinker import TensorData
    from livelora.trainer.event_datums import completion_datum

    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)[:completion_tokens]
    data = []
    for i in range(n):
        messages = []
        for t in range(history_turns):
            messages += [
                {"role": "user", "content": PROMPTS[(i + t + 1) % len(PROMPTS)]},
                {"role": "assistant", "content": REPLY},
            ]
        messages.append({"role": "user", "content": PROMPTS[i % len(PROMPTS)]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        data.append(completion_datum(prompt, reply_ids, {"label": TensorData.from_list([float(i % 2)], "float32")}))
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    ap.add_argument("--ratings", type=int, default=8)
    ap.add_argument("--completion-tokens", type=int, default=48)
    ap.add_argument("--history-turns", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare", action="store_true", help="also time the step with every KL pair recomputed")
    args = ap.parse_args()

    import livelora.trainer.logprobs as logprobs_mod
    import livelora.trainer.model as model_mod
    from livelora.clients.types.tinker import AdamParams
    from livelora.core.base_models import load_tokenizer, resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL, CommonSettings
    from livelora.trainer.gate_measure import ProbeSuite
    from livelora.trainer.settings import TrainingSection

    ref = resolve_base_model(DEFAULT_MODEL, CommonSettings().home)
    tokenizer = load_tokenizer(ref)
    model = model_mod.TrainingModel(ref, TrainingSection().lora)
    data = build_datums(tokenizer, args.ratings, args.completion_tokens, args.history_turns)
    prompt_lens = [int(torch.nonzero(d.loss_fn_inputs["weights"].to_torch())[0]) + 1 for d in data]
    suite = ProbeSuite(tokenizer)
    shared_probe_prefix = suite.shared
    cfg = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {len(data)} ratings, "
        f"{sum(d.model_input.length for d in data)} tokens (prompts {min(prompt_lens)}-{max(prompt_lens)}, "
        f"replies {args.completion_tokens}); LoRA rank {model.lora.rank}",
        flush=True,
    )

    passes: list[float] = []
    plain = logprobs_mod.LogprobPass.__call__

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return plain(self, *a, **k)
        finally:
            passes.append(time.perf_counter() - t)

    logprobs_mod.LogprobPass.__call__ = timed
    share_limit, common_prefix = model_mod.PROMPT_KV_MAX_BYTES, logprobs_mod.common_prefix
    variants = [("shared prompts", share_limit)] + ([("recomputed", 0)] if args.compare else [])
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
        for rep in range(args.repeats + 1):
            for name, limit in variants:
                model_mod.PROMPT_KV_MAX_BYTES = logprobs_mod.PROMPT_KV_MAX_BYTES = limit
                logprobs_mod.common_prefix = common_prefix if limit else (lambda inputs: 0)
                suite.shared = shared_probe_prefix if limit else 0
                passes.clear()
                t0 = time.perf_counter()
                model.forward_backward(data, "kto", cfg, loss_positions_only=bool(limit))
                t1 = time.perf_counter()
                model.optim_step(AdamParams(learning_rate=1e-6))
                t2 = time.perf_counter()
                step_passes = list(passes)
                t3 = time.perf_counter()
                suite.probe_logprobs(model)
                t4 = time.perf_counter()
                suite.generate(model)
                t5 = time.perf_counter()
                if rep == 0:
                    continue  # warm-up
                # pass order: reference, policy (grad), KL policy, KL reference (shared); reference, KL policy,
                # KL reference, policy (recomputed)
                ref, pol, klp, klr = step_passes if limit else [step_passes[i] for i in (0, 3, 1, 2)]
                rows[name].append(
                    {
                        "step": t1 - t0,
                        "reference": ref,
                        "policy": pol,
                        "kl": klp + klr,
                        "backward": (t1 - t0) - sum(step_passes),
                        "optim": t2 - t1,
                        "probes": t4 - t3,
                        "generate": t5 - t4,
                    }
                )
        model_mod.PROMPT_KV_MAX_BYTES = logprobs_mod.PROMPT_KV_MAX_BYTES = share_limit
        logprobs_mod.common_prefix = common_prefix
        for name, runs in rows.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            gate = med["probes"] + med["generate"]
            print(
                f"threads {threads}, {name}: KTO step {med['step']:.2f} s (reference {med['reference']:.2f}, "
                f"policy {med['policy']:.2f}, KL pairs {med['kl']:.2f}, backward {med['backward']:.2f}), "
                f"optim {med['optim']:.2f} s; gate {gate:.2f} s (probes {med['probes']:.2f}, generate "
                f"{med['generate']:.2f}); step + gate {med['step'] + med['optim'] + gate:.2f} s "
                f"(median of {len(runs)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
