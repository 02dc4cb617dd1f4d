"""Run lm-evaluation-harness on the tiny tasks of ``tests/lm_eval_tasks`` and print what each item got.

Run as ``<lm-eval venv>/bin/python tests/lm_eval_run.py`` (``.ci/setup-lm-eval``) with the working directory
``tests/lm_eval_tasks`` and ``{run name: {"model": "local-completions" | "local-chat-completions" | "hf",
"model_args": str, "tasks": [...], "chat": bool}}`` (JSON) on stdin: the runs share one process (lm-eval's imports
take longer than these runs). Prints one JSON object ``{run name: {task: [[response, ...] per doc]}}`` (a
loglikelihood response is ``[logprob, is_greedy]``, a generation its text). Nothing here imports livelora: lm-eval
is used as a user runs it. :mod:`tests.test_lm_eval_parity` asserts on the output.
"""

from __future__ import annotations

import json
import sys


def run(spec: dict, tasks) -> dict:
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=spec["model"],
        model_args=spec["model_args"],
        tasks=spec["tasks"],
        task_manager=tasks,
        batch_size=1,
        log_samples=True,
        apply_chat_template=spec.get("chat", False),
        device="cpu",
    )
    out = {}
    for task, samples in results["samples"].items():
        samples = sorted(samples, key=lambda s: s["doc_id"])
        out[task] = [[r[0] if isinstance(r, list) else r for r in s["resps"]] for s in samples]
    return out


def main() -> dict:
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=".")
    return {name: run(spec, tasks) for name, spec in json.load(sys.stdin).items()}


if __name__ == "__main__":
    print(json.dumps(main()))
