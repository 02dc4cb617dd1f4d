"""lm-evaluation-harness through the gateway gives the numbers of the same weights in-process (issue 29).

``lm_eval`` (the dev extra's lm-eval) runs the tiny tasks shipped in ``tests/lm_eval_tasks`` (a multiple-choice
task, loglikelihood requests, two of whose items end where the model ends its turn; a generation task) with
``local-completions`` and ``local-chat-completions`` against a live gateway, and with ``hf`` on the converted
weights in its own process; every item's loglikelihood agrees to 1e-4 and every generation is equal. The same for
a stored LoRA version served by the gateway (``parity@1``) against ``hf`` with ``peft`` on its directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.bus import new_prefix
from harness.seeds import saved_versions
from harness.server import MODEL

from livelora.adapters.store import AdapterStore

HERE = Path(__file__).parent
TASKS = HERE / "lm_eval_tasks"
BOTH = ["livelora_tiny_mc", "livelora_tiny_gen"]
LORA = "parity"
pytestmark = pytest.mark.slow

#: the harness ``server``: a gateway of the module's own, its store holding ``parity@1``
SERVER_SETTINGS = {"max_batch_size": 4, "max_waiting": 8, "redis_prefix": new_prefix("lmeval")}


def seed_home(home, base_ref) -> None:
    """``parity@1``: rank 2 on the attention projections, lora_B drawn with σ 0.04 (its loglikelihoods differ from
    the base model's by more than the tolerance, its greedy replies stay sentences)."""
    saved_versions(base_ref, home, LORA, seed=3, n=1, scale=0.04)


def run_lm_eval(runs: dict[str, dict], cache: Path) -> dict:
    """``{run name: {task: responses per doc}}`` of ``runs`` (:mod:`lm_eval_run`), in one lm-eval process."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[dev]')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(cache),
        OPENAI_API_KEY="unused",
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "lm_eval_run.py")],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=TASKS,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(*(line for line in proc.stderr.splitlines() if line.startswith("[lm_eval_run]")), sep="\n")  # pytest -s
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(server, home, base_ref, tmp_path_factory) -> dict:
    """lm-eval's ``hf`` model on the converted weights (float32, as the gateway serves them), alone and with
    ``peft=`` the version's directory, and its OpenAI-API models on the gateway, on the same tasks."""
    hf = f"pretrained={base_ref.path},dtype=float32"
    peft = f"{hf},peft={AdapterStore(home).version_dir(LORA, 1)}"
    specs = {
        "hf": {"model": "hf", "model_args": hf, "tasks": BOTH},
        "hf_chat": {"model": "hf", "model_args": hf, "tasks": ["livelora_tiny_gen"], "chat": True},
        "peft": {"model": "hf", "model_args": peft, "tasks": BOTH},
        "peft_chat": {"model": "hf", "model_args": peft, "tasks": ["livelora_tiny_gen"], "chat": True},
    }
    for prefix, model in (("", MODEL), ("lora_", f"{LORA}@1")):
        served = f"model={model},num_concurrent=1,max_retries=1"
        completions = f"{served},base_url={server.url('/v1/completions')},tokenizer_backend=huggingface,"
        specs[f"{prefix}completions"] = {
            "model": "local-completions",
            "model_args": f"{completions}tokenizer={base_ref.path}",
            "tasks": BOTH,
        }
        specs[f"{prefix}chat"] = {
            "model": "local-chat-completions",
            "model_args": f"{served},base_url={server.url('/v1/chat/completions')}",
            "tasks": ["livelora_tiny_gen"],
            "chat": True,
        }
    return run_lm_eval(specs, tmp_path_factory.mktemp("datasets-cache"))


def assert_loglikelihoods_equal(got: list, want: list) -> None:
    """Per doc: the choices' ``[loglikelihood, is_greedy]`` responses agree (1e-4, exactly)."""
    assert len(got) == len(want) == 6
    for doc, (g, w) in enumerate(zip(got, want)):
        assert [ll for ll, _ in g] == pytest.approx([ll for ll, _ in w], abs=1e-4), doc
        assert [bool(x) for _, x in g] == [bool(x) for _, x in w], doc


def assert_generations_equal(got: list, want: list) -> None:
    assert got == want
    assert len(want) == 5 and sum(bool(reply[0].strip()) for reply in want) >= 3  # sentences, not all empty


@pytest.mark.parametrize(("served", "in_process"), [("", "hf"), ("lora_", "peft")], ids=["base", "lora"])
def test_local_completions_loglikelihoods_and_generations_equal_in_process(runs, served, in_process):
    got, want = runs[f"{served}completions"], runs[in_process]
    assert_loglikelihoods_equal(got["livelora_tiny_mc"], want["livelora_tiny_mc"])
    assert_generations_equal(got["livelora_tiny_gen"], want["livelora_tiny_gen"])


@pytest.mark.parametrize(("served", "in_process"), [("", "hf"), ("lora_", "peft")], ids=["base", "lora"])
def test_local_chat_completions_generations_equal_in_process(runs, served, in_process):
    got, want = runs[f"{served}chat"], runs[f"{in_process}_chat"]
    assert_generations_equal(got["livelora_tiny_gen"], want["livelora_tiny_gen"])


def test_the_lora_version_changes_the_loglikelihoods(runs):
    base = [ll for doc in runs["hf"]["livelora_tiny_mc"] for ll, _ in doc]
    lora = [ll for doc in runs["peft"]["livelora_tiny_mc"] for ll, _ in doc]
    assert max(abs(a - b) for a, b in zip(base, lora)) > 1e-2
