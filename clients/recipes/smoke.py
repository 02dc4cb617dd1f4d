"""``livelora recipe NAME --smoke``: a preset per recipe that runs the whole pipeline (session, sampling, a loss,
optimizer steps, evaluation before and after, checkpoint, summary) and shows that it learns, in about a minute
on an idle 2-core CPU.

Each preset is 2 optimizer steps on a few short examples: built-in sample data written into the run directory
(``smoke-data/``) for the recipes that read a file, generated arithmetic problems for ``gsm8k-rl``. A flag given
on the command line wins over the preset; without ``--log-dir`` a smoke run gets a fresh temporary directory, so
it never resumes (or overwrites) a real run. What each shows: chat-sft, kto-ratings and dpo move their held-out
metric (NLL down, margin up: learning rates high enough to move it in 2 steps); gsm8k-rl, distill and code-rl
re-score the tokens of each update (``check_update``: ``train/update_gain`` > 0 when the step made the
better-rewarded tokens likelier), with groups and a temperature that give rewards variance (gsm8k-rl: 4 samples
at 0.7 on single-digit sums, so a group is rarely all right or all wrong).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]

#: Shared by every preset: 2 steps, a small LoRA, no intermediate checkpoint, no MLflow.
COMMON: dict[str, Any] = {"steps": 2, "lora_rank": 4, "save_every": 0, "mlflow": False}

#: recipe -> the config values of its preset (``data`` is the name of a sample file, written by :func:`preset`).
PRESETS: dict[str, dict[str, Any]] = {
    "chat-sft": {"data": "chat.jsonl", "eval_size": 2, "batch_size": 2, "max_length": 64, "learning_rate": 2e-3},
    "gsm8k-rl": {
        "task": "arithmetic",
        "problems_per_step": 2,
        "group_size": 4,
        "temperature": 0.7,
        "eval_size": 4,
        "max_tokens": 24,
        "check_update": True,
    },
    "kto-ratings": {
        "data": "ratings.jsonl",
        "batch_size": 2,
        "eval_fraction": 0.25,
        "max_length": 64,
        "learning_rate": 1e-3,
    },
    "dpo": {"data": "pairs.jsonl", "batch_size": 2, "eval_fraction": 0.25, "max_length": 64, "learning_rate": 1e-3},
    "distill": {
        "data": "prompts.jsonl",
        "dataset": "prompts",
        "prompts_per_step": 2,
        "group_size": 1,
        "max_tokens": 8,
        "eval_size": 2,
        "check_update": True,
    },
    "code-rl": {
        "tasks_per_step": 2,
        "group_size": 2,
        "max_tokens": 32,
        "eval_size": 2,
        "tool_call": "always",
        "minibatches": 2,
        "max_staleness": 1,
        "check_update": True,
    },
}


def _samples() -> dict[str, list[dict[str, Any]]]:
    return {
        "chat.jsonl": [
            {
                "messages": [
                    {"role": "user", "content": f"Name a thing that is {c}."},
                    {"role": "assistant", "content": f"A {c} balloon."},
                ]
            }
            for c in COLOURS
        ],
        "ratings.jsonl": [
            {"prompt": f"Say something {c}.", "completion": reply, "label": good}
            for c in COLOURS[:4]
            for reply, good in ((f"{c.title()}!", True), (f"I will not talk about {c}.", False))
        ],
        "pairs.jsonl": [
            {"prompt": f"Name something {c}.", "chosen": f"A {c} hat.", "rejected": "No."} for c in COLOURS[:6]
        ],
        "prompts.jsonl": [{"prompt": f"Describe the colour {c}."} for c in COLOURS[:6]],
    }


def preset(recipe: str, log_dir: Path) -> dict[str, Any]:
    """The config values of ``recipe``'s preset; its sample file (if any) is written under ``log_dir/smoke-data``.

    Raises:
        KeyError: a recipe without a preset.
    """
    values = {**COMMON, **PRESETS[recipe]}
    if "data" in values:
        folder = Path(log_dir) / "smoke-data"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / values["data"]
        path.write_text("".join(json.dumps(row) + "\n" for row in _samples()[values["data"]]))
        values["data"] = str(path)
    return values
