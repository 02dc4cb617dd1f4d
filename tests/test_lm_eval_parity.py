"""lm-evaluation-harness through the gateway gives the numbers of the same weights in-process (issue 29).

``lm_eval`` runs the tiny tasks shipped in ``tests/lm_eval_tasks`` (a multiple-choice task, loglikelihood
requests, two of whose items end where the model ends its turn; a generation task) with ``local-completions``
and ``local-chat-completions`` against a live gateway and with ``hf`` on the converted weights in its own process;
every item's loglikelihood agrees to 1e-4 and every generation is equal. lm-eval runs in its own virtual
environment (``.ci/setup-lm-eval``; ``LIVELORA_LMEVAL_PYTHON`` names another); without it the test is skipped.
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
    path = Path(env) if env else ROOT / ".venv-lmeval" / "bin" / "python"
    return path if path.exists() else None


def run_lm_eval(model: str, model_args: str, tasks: list[str], chat: bool = False) -> dict:
    python = lm_eval_python()
    if python is None:
        pytest.skip("no lm-eval venv: run .ci/setup-lm-eval")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "PYTHON"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OPENAI_API_KEY="unused")
    spec = {"model": model, "model_args": model_args, "tasks": tasks, "chat": chat}
    proc = subprocess.run(
        [str(python), str(HERE / "lm_eval_run.py")],
        input=json.dumps(spec),
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
def in_process(base_ref) -> dict:
    """lm-eval's ``hf`` model on the converted weights (float32, as the gateway serves them)."""
    args = f"pretrained={base_ref.path},dtype=float32"
    out = run_lm_eval("hf", args, ["livelora_tiny_mc", "livelora_tiny_gen"])
    out["chat"] = run_lm_eval("hf", args, ["livelora_tiny_gen"], chat=True)["livelora_tiny_gen"]
    return out


def test_local_completions_loglikelihoods_and_generations_equal_hf(live_server, base_ref, in_process):
    args = (
        f"model={MODEL},base_url={live_server.url('/v1/completions')},tokenizer_backend=huggingface,"
        f"tokenizer={base_ref.path},num_concurrent=1,max_retries=1"
    )
    served = run_lm_eval("local-completions", args, ["livelora_tiny_mc", "livelora_tiny_gen"])
    got, want = served["livelora_tiny_mc"], in_process["livelora_tiny_mc"]
    assert len(got) == len(want) == 8
    for doc, (g, w) in enumerate(zip(got, want)):
        assert [ll for ll, _ in g] == pytest.approx([ll for ll, _ in w], abs=1e-4), doc
        assert [bool(x) for _, x in g] == [bool(x) for _, x in w], doc
    assert served["livelora_tiny_gen"] == in_process["livelora_tiny_gen"]
    assert all(reply[0].strip() for reply in served["livelora_tiny_gen"])


def test_local_chat_completions_generations_equal_hf(live_server, in_process):
    args = f"model={MODEL},base_url={live_server.url('/v1/chat/completions')},num_concurrent=1,max_retries=1"
    served = run_lm_eval("local-chat-completions", args, ["livelora_tiny_gen"], chat=True)
    assert served["livelora_tiny_gen"] == in_process["chat"]
    assert all(reply[0].strip() for reply in served["livelora_tiny_gen"])
