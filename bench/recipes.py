"""The recipes, measured: each recipe's metric before and after, steps and wall time, against a running server.

Start a server, then run experiments by name (one after another; each writes its run directory under
``--out``, so running the same command again resumes or, when finished, just re-reports)::

    livelora serve --port 8791 &
    python bench/recipes.py --base-url http://127.0.0.1:8791 --gsm8k path/to/gsm8k \\
        --ratings $LIVELORA_HOME/data/signals sft arith gsm8k kto dpo distill

``--ratings`` is a live-loop dataset of record (``bench/live_loop.py --keep-store`` leaves one); DPO pairs are
built from it (a thumbs-down reply paired with a thumbs-up reply of the same prompt). Prints one line per
experiment with the 1-minute load average before and after (the cores may be shared: wall times are noisy)
and writes the figures as JSON (``--out``/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from livelora.clients.recipes import chat_sft, distill, dpo, gsm8k_rl, kto_ratings
from livelora.clients.recipes.datasets import load_ratings, pairs_from_ratings
from livelora.clients.recipes.renderers import ChatRenderer


def experiments(a: argparse.Namespace) -> dict:
    """name -> (module, config kwargs, headline metric)."""
    pairs = Path(a.out) / "pairs.jsonl"
    return {
        "sft": (chat_sft, dict(data=a.gsm8k, dataset="gsm8k", steps=40, eval_size=64), "eval/nll"),
        "sft-lr1e-3": (
            chat_sft,
            dict(data=a.gsm8k, dataset="gsm8k", steps=40, eval_size=64, learning_rate=1e-3),
            "eval/nll",
        ),
        "sft-lr5e-5": (
            chat_sft,
            dict(data=a.gsm8k, dataset="gsm8k", steps=40, eval_size=64, learning_rate=5e-5),
            "eval/nll",
        ),
        "arith": (
            gsm8k_rl,
            dict(task="arithmetic", steps=20, max_tokens=24, eval_size=100, learning_rate=a.rl_lr),
            "eval/accuracy",
        ),
        "arith-lr1e-4": (
            gsm8k_rl,
            dict(task="arithmetic", steps=20, max_tokens=24, eval_size=100, learning_rate=1e-4),
            "eval/accuracy",
        ),
        "gsm8k": (
            gsm8k_rl,
            dict(data=a.gsm8k, steps=8, problems_per_step=4, max_tokens=160, eval_size=50, learning_rate=a.rl_lr),
            "eval/accuracy",
        ),
        "kto": (kto_ratings, dict(data=a.ratings, steps=30), "eval/margin"),
        "kto-lr5e-4": (kto_ratings, dict(data=a.ratings, steps=30, learning_rate=5e-4), "eval/margin"),
        "dpo": (dpo, dict(data=str(pairs), steps=30), "eval/margin"),
        "dpo-lr5e-4": (dpo, dict(data=str(pairs), steps=30, learning_rate=5e-4), "eval/margin"),
        "distill": (distill, dict(data=a.gsm8k, steps=20), "eval/reverse_kl"),
    }


def write_pairs(a: argparse.Namespace) -> None:
    from livelora.clients.service_client import ServiceClient

    service = ServiceClient(a.base_url)
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(service._tokenizer_id()))
    pairs = pairs_from_ratings(load_ratings(a.ratings, renderer), seed=0)
    path = Path(a.out) / "pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt_token_ids": list(p.prompt),
                    "chosen_token_ids": list(p.chosen),
                    "rejected_token_ids": list(p.rejected),
                }
            )
            + "\n"
            for p in pairs
        )
    )
    print(f"{len(pairs)} preference pairs from {a.ratings} -> {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="experiments to run, in order")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--sdk", default="livelora", choices=["livelora", "tinker"])
    ap.add_argument("--gsm8k", default="openai/gsm8k", help="GSM8K folder or hub name")
    ap.add_argument("--ratings", default=None, help="live-loop ratings (LIVELORA_HOME/data/signals)")
    ap.add_argument("--rl-lr", type=float, default=5e-4, help="learning rate of the RL runs")
    ap.add_argument("--out", default="bench/out/recipes")
    a = ap.parse_args()
    table = experiments(a)
    if any(n.startswith("dpo") for n in a.names) and not (Path(a.out) / "pairs.jsonl").exists():
        write_pairs(a)
    results_path = Path(a.out) / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name in a.names:
        module, kwargs, headline = table[name]
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        cfg = module.Config(log_dir=Path(a.out) / name, base_url=a.base_url, sdk=a.sdk, **kwargs)
        summary = module.run(cfg)
        row = {
            "recipe": summary.recipe,
            "steps": summary.steps,
            "wall_s": round(summary.wall_s, 1),
            "this_session_s": round(time.monotonic() - t0, 1),
            "load_before": load0,
            "load_after": os.getloadavg()[0],
            "metric": headline,
            "before": summary.before.get(headline),
            "after": summary.after.get(headline),
            "all_before": summary.before,
            "all_after": summary.after,
            "config": cfg.model_dump(mode="json"),
        }
        results[name] = row
        results_path.write_text(json.dumps(results, indent=2, default=str))
        print(
            f"{name:12s} {headline:16s} {row['before']} -> {row['after']}  steps {row['steps']}  "
            f"wall {row['wall_s']} s  load {load0:.2f} -> {row['load_after']:.2f}  {summary.after}",
            flush=True,
        )


if __name__ == "__main__":
    main()
