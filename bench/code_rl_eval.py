"""code-rl's held-out evaluation of one saved state (or of the base model), with its own token budget.

A code-rl run evaluates with its training ``--max-tokens`` (64 in docs/code-rl.md's run), which cuts most
HumanEval solutions short; this evaluates the run's final state, or the base model (a fresh LoRA), on the same
held-out splits with a larger budget, against a running server::

    python bench/code_rl_eval.py --base-url http://127.0.0.1:8731 --humaneval ../shared/data/humaneval \\
        --state "$(tail -1 runs/code/checkpoints.jsonl | jq -r .state_path)" --max-tokens 256 --humaneval-size 20

Prints one JSON line: the evaluation's metrics (``eval/*`` as the recipe names them), the settings and the wall
seconds.
"""

from __future__ import annotations

import argparse
import json
import time

from livelora.clients.recipes.code_rl import Config, Episodes, Grader, task_splits
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="a running livelora server")
    p.add_argument("--state", help="a training state path (tinker://...); default: the base model")
    p.add_argument("--humaneval", help="HumanEval folder or .jsonl")
    p.add_argument("--humaneval-size", type=int, default=20, help="held-out HumanEval tasks (with --humaneval)")
    p.add_argument("--easy-size", type=int, default=40, help="held-out easy tasks (0: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per turn")
    p.add_argument("--samples", type=int, default=0, help="episodes per task at --temperature (0: greedy only)")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled episodes (greedy: 1e-4)")
    a = p.parse_args()
    cfg = Config(
        log_dir="unused",
        humaneval=a.humaneval,
        humaneval_eval_size=a.humaneval_size if a.humaneval else 0,
        eval_size=a.easy_size,
        max_tokens=a.max_tokens,
        eval_samples=a.samples,
        temperature=a.temperature,
        tool_call="always",
    )
    _, easy_held, he_held = task_splits(cfg)
    sdk = Sdk.load("livelora", a.base_url)
    service = sdk.service()
    tc = (
        service.create_training_client_from_state(a.state)
        if a.state
        else service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.lora_rank)
    )
    t0 = time.monotonic()
    ep = Episodes(cfg, sdk, ChatRenderer(sdk.tokenizer(tc)), Grader(None, cfg.test_timeout_s))
    metrics = ep.evaluate(tc.save_weights_and_get_sampling_client(), easy_held, he_held)
    print(
        json.dumps(
            {
                "state": a.state or "base",
                "max_tokens": a.max_tokens,
                "easy_tasks": len(easy_held),
                "humaneval_tasks": len(he_held),
                "samples": a.samples,
                "temperature": a.temperature,
                **metrics,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
