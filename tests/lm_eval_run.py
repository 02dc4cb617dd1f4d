"""Run lm-evaluation-harness on the tiny tasks of ``tests/lm_eval_tasks`` and print what each item got.

Run as ``<lm-eval venv>/bin/python tests/lm_eval_run.py`` (``.ci/setup-lm-eval``) with the working directory
``tests/lm_eval_tasks`` and ``{"model": "local-completions" | "local-chat-completions" | "hf", "model_args": str,
"tasks": [...], "chat": bool}`` (JSON) on stdin; prints one JSON object ``{task: [[response, ...] per doc]}``
(a loglikelihood response is ``[logprob, is_greedy]``, a generation its text). Nothing here imports livelora:
lm-eval is used as a user runs it. :mod:`tests.test_lm_eval_parity` asserts on the output.
"""

from __future__ import annotations

import json
import sys


def main() -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    spec = json.load(sys.stdin)
    results = lm_eval.simple_evaluate(
        model=spec["model"],
        model_args=spec["model_args"],
        tasks=spec["tasks"],
        task_manager=TaskManager(include_path="."),
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


if __name__ == "__main__":
    print(json.dumps(main()))
