"""Run lm-evaluation-harness on the tiny tasks of ``tests/lm_eval_tasks`` and print what each item got.

Run as ``python tests/lm_eval_run.py`` (lm-eval is in the dev extra) with the working directory
``tests/lm_eval_tasks`` and ``{run name: {"model": "local-completions" | "local-chat-completions" | "hf",
"model_args": str, "tasks": [...], "chat": bool}}`` (JSON) on stdin: the runs share one process and the runs of one
model one model object (lm-eval's imports and model loads take longer than these runs). Prints each run's seconds
(wall, this process's CPU) on stderr and one JSON object ``{run name: {task: [[response, ...] per doc]}}`` (a
loglikelihood response is ``[logprob, is_greedy]``, a generation its text). Nothing here imports livelora: lm-eval
is used as a user runs it. :mod:`tests.test_lm_eval_parity` asserts on the output.
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict, lm, tasks) -> dict:
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=spec["tasks"],
        task_manager=tasks,
        log_samples=True,
        apply_chat_template=spec.get("chat", False),
    )
    out = {}
    for task, samples in results["samples"].items():
        samples = sorted(samples, key=lambda s: s["doc_id"])
        out[task] = [[r[0] if isinstance(r, list) else r for r in s["resps"]] for s in samples]
    return out


def main() -> dict:
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=".")
    models, out = {}, {}
    for name, spec in json.load(sys.stdin).items():
        t0, c0 = time.monotonic(), time.process_time()
        key = (spec["model"], spec["model_args"])  # one model object for its chat and plain runs
        if key not in models:
            models[key] = get_model(key[0]).create_from_arg_string(key[1], {"batch_size": 1, "device": "cpu"})
        out[name] = run(spec, models[key], tasks)
        took = f"{time.monotonic() - t0:.1f} s, cpu {time.process_time() - c0:.1f} s"
        print(f"[lm_eval_run] {name}: {took}", file=sys.stderr)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
