"""lm-evaluation-harness through the gateway gives the numbers of the same weights in-process (issue 29).

``lm_eval`` runs the tiny tasks shipped in ``tests/lm_eval_tasks`` (a multiple-choice task, loglikelihood
requests, two of whose items end where the model ends its turn; a generation task) with ``local-completions``
and ``local-chat-completions`` against a live gateway and with ``hf`` on the converted weights in its own process;
every item's loglikelihood agrees to 1e-4 and every generation is equal. lm-eval runs in its own virtual
environment (``.ci/setup-lm-eval``, not yet called by ``.ci/run``; ``LIVELORA_LMEVAL_PYTHON`` names another);
without it the test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness.server import MODEL

HERE = Path(__file__).parent
ROOT = HERE.parent
TASKS = HERE / "lm_eval_tasks"
pytestmark = pytest.mark.slow


def lm_eval_python() -> Path | None:
    env = os.environ.get("LIVELORA_LMEVAL_PYTHON")
    if env:
        return Path(env)
    venv = ROOT / ".venv-lmeval"
    return venv / "bin" / "python" if (venv / "READY").exists() else None


def run_lm_eval(runs: dict[str, dict]) -> dict:
    """``{run name: {task: responses per doc}}`` of ``runs`` (:mod:`lm_eval_run`), in one lm-eval process."""
    python = lm_eval_python()
    if python is None:
        pytest.skip("no lm-eval venv: run .ci/setup-lm-eval")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "PYTHON"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OPENAI_API_KEY="unused")
    proc = subprocess.run(
        [str(python), str(HERE / "lm_eval_run.py")],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=TASKS,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(live_server, base_ref) -> dict:
    """lm-eval's ``hf`` model on the converted weights (float32, as the gateway serves them) and its OpenAI-API
    models on the live gateway, on the same tasks."""
    hf = f"pretrained={base_ref.path},dtype=float32"
    served = f"model={MODEL},num_concurrent=1,max_retries=1"
    completions = f"{served},base_url={live_server.url('/v1/completions')},tokenizer_backend=huggingface,"
    completions += f"tokenizer={base_ref.path}"
    both = ["livelora_tiny_mc", "livelora_tiny_gen"]
    return run_lm_eval(
        {
            "hf": {"model": "hf", "model_args": hf, "tasks": both},
            "hf_chat": {"model": "hf", "model_args": hf, "tasks": ["livelora_tiny_gen"], "chat": True},
            "completions": {"model": "local-completions", "model_args": completions, "tasks": both},
            "chat": {
                "model": "local-chat-completions",
                "model_args": f"{served},base_url={live_server.url('/v1/chat/completions')}",
                "tasks": ["livelora_tiny_gen"],
                "chat": True,
            },
        }
    )


def test_local_completions_loglikelihoods_and_generations_equal_hf(runs):
    got, want = runs["completions"]["livelora_tiny_mc"], runs["hf"]["livelora_tiny_mc"]
    assert len(got) == len(want) == 8
    for doc, (g, w) in enumerate(zip(got, want)):
        assert [ll for ll, _ in g] == pytest.approx([ll for ll, _ in w], abs=1e-4), doc
        assert [bool(x) for _, x in g] == [bool(x) for _, x in w], doc
    assert runs["completions"]["livelora_tiny_gen"] == runs["hf"]["livelora_tiny_gen"]
    assert all(reply[0].strip() for reply in runs["hf"]["livelora_tiny_gen"])


def test_local_chat_completions_generations_equal_hf(runs):
    assert runs["chat"]["livelora_tiny_gen"] == runs["hf_chat"]["livelora_tiny_gen"]
    assert all(reply[0].strip() for reply in runs["hf_chat"]["livelora_tiny_gen"])
