"""Recipes against a live server (real SmolLM2, real Redis): exact resume after a kill, MLflow contents, and every
recipe unchanged on the official tinker SDK."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from livelora.clients.recipes import chat_sft, distill, dpo, gsm8k_rl, kto_ratings
from livelora.clients.recipes.checkpoints import last_checkpoint, read_jsonl_lenient
from livelora.clients.recipes.datums import batch_indices, split, supervised_datum
from livelora.clients.recipes.metrics import read_metrics
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey", "gold"]


def write_chat(path: Path) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Name a thing that is {c}."},
                {"role": "assistant", "content": f"A {c} balloon is {c}."},
            ]
        }
        for c in COLOURS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_config(data: Path, log_dir: Path, url: str, **kw) -> chat_sft.Config:
    return chat_sft.Config(
        **{
            "log_dir": log_dir,
            "base_url": url,
            "data": str(data),
            "eval_size": 4,
            "batch_size": 2,
            "steps": 4,
            "save_every": 2,
            "learning_rate": 2e-3,
            "lora_rank": 4,
            **kw,
        }
    )


def test_recipe_killed_and_restarted_continues_at_its_checkpoint_with_the_same_optimizer_state(
    sessions_server, tmp_path
):
    url = sessions_server.base_url
    data = write_chat(tmp_path / "chat.jsonl")
    # A: the uninterrupted run (in-process), logging to MLflow when it is installed
    summary_a = chat_sft.run(sft_config(data, tmp_path / "a", url))
    metrics_a = read_metrics(tmp_path / "a")
    assert summary_a.after["eval/nll"] < summary_a.before["eval/nll"]

    # B: the same recipe as a real `livelora recipe chat-sft` process, SIGKILLed once its step-2 checkpoint is logged
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "livelora.cli.main",
        "recipe",
        "chat-sft",
        "--base-url",
        url,
        "--data",
        str(data),
        "--log-dir",
        str(tmp_path / "b"),
        "--eval-size",
        "4",
        "--batch-size",
        "2",
        "--steps",
        "8",
        "--save-every",
        "2",
        "--learning-rate",
        "2e-3",
        "--lora-rank",
        "4",
        "--no-mlflow",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (ck := last_checkpoint(tmp_path / "b")) and ck["step"] >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, out
    assert last_checkpoint(tmp_path / "b")["step"] == 2, out
    # its output is a pipe, not a terminal: one progress line per step instead of a bar
    assert "chat-sft: starting, 8 steps" in out and "chat-sft: step 1/8 " in out and "train/loss=" in out, out

    # restart (steps may change on resume: 4, like A): it continues at step 3
    done = []
    summary_b = chat_sft.run(
        sft_config(data, tmp_path / "b", url, mlflow=False), on_step=lambda step, m: done.append(step)
    )
    assert done == [3, 4]
    assert [c["step"] for c in read_jsonl_lenient(tmp_path / "b" / "checkpoints.jsonl")] == [2, 4]
    metrics_b = read_metrics(tmp_path / "b")
    # step 3 reads the restored weights; step 4's loss and the final held-out NLL depend on the Adam moments too
    for step in (3, 4):
        assert metrics_b[step]["train/loss"] == pytest.approx(metrics_a[step]["train/loss"], rel=1e-5)
    assert summary_b.after["eval/nll"] == pytest.approx(summary_a.after["eval/nll"], rel=1e-5)
    assert summary_b.before == summary_a.before  # the 'before' figure comes from the first session's log

    # control: the same step-3 update from the step-2 checkpoint with a *fresh* optimizer gives another step-4 loss,
    # so the comparison above would have caught a resume that lost the Adam state
    sdk = Sdk.load("livelora", url)
    service = sdk.service()
    ckpt = next(c for c in read_jsonl_lenient(tmp_path / "b" / "checkpoints.jsonl") if c["step"] == 2)
    train, _ = split([json.loads(line)["messages"] for line in data.read_text().splitlines()], 4, 0)
    tc_warm = service.create_training_client_from_state_with_optimizer(ckpt["state_path"])
    tc_cold = service.create_training_client_from_state(ckpt["state_path"])
    renderer = ChatRenderer(tc_warm.get_tokenizer())

    def batch(step):
        enc = [renderer.supervised(train[i]) for i in batch_indices(len(train), 2, step, 0)]
        return [supervised_datum(sdk, t, w) for t, w in enc], sum(sum(w[1:]) for _, w in enc)

    losses = {}
    for name, tc in (("warm", tc_warm), ("cold", tc_cold)):
        tc.forward_backward(batch(2)[0], "cross_entropy")
        tc.optim_step(sdk.adam(2e-3)).result()
        data4, n4 = batch(3)
        losses[name] = tc.forward(data4, "cross_entropy").result().metrics["loss:sum"] / n4
    service.close()
    assert losses["warm"] == pytest.approx(metrics_a[4]["train/loss"], rel=1e-5)
    assert abs(losses["cold"] - metrics_a[4]["train/loss"]) > 1e-3 * abs(metrics_a[4]["train/loss"]), losses

    import mlflow  # a dev extra (tests/test_dev_extras.py): the uninterrupted run's MLflow store has every step

    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "a" / "mlruns").as_uri())
    run_id = (tmp_path / "a" / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert [m.value for m in history] == pytest.approx([metrics_a[s]["train/loss"] for s in (1, 2, 3, 4)])
    assert [m.step for m in client.get_metric_history(run_id, "eval/nll")] == [0, 4]
    run = client.get_run(run_id)
    assert run.data.params["learning_rate"] == "0.002" and run.info.status == "FINISHED"


# ---------------------------------------------------------------------------------------------- the tinker SDK
def _tiny_data(tmp: Path) -> dict[str, Path]:
    gsm = tmp / "gsm8k"
    gsm.mkdir()
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(2, 3), (4, 1), (5, 5), (1, 6), (3, 3), (7, 2)]
    ]
    (gsm / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (gsm / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    ratings = tmp / "ratings.jsonl"
    ratings.write_text(
        "".join(
            json.dumps({"prompt": f"Say something {c}.", "completion": reply, "label": good}) + "\n"
            for c in COLOURS[:4]
            for reply, good in ((f"{c.title()}!", True), (f"I will not talk about {c}.", False))
        )
    )
    pairs = tmp / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"Name something {c}.", "chosen": f"A {c} hat.", "rejected": "No."}) + "\n"
            for c in COLOURS[:5]
        )
    )
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Describe the colour {c}."}) + "\n" for c in COLOURS[:5]))
    return {
        "chat": write_chat(tmp / "chat.jsonl"),
        "gsm8k": gsm,
        "ratings": ratings,
        "pairs": pairs,
        "prompts": prompts,
    }


@pytest.mark.parametrize("recipe", ["chat-sft", "gsm8k-rl", "kto-ratings", "dpo", "distill"])
def test_every_recipe_runs_unchanged_on_the_official_tinker_sdk(sessions_server, tmp_path, recipe):
    tinker = pytest.importorskip("tinker", reason="the official tinker SDK is not installed (tinker==0.24.1)")
    d = _tiny_data(tmp_path)
    common = {"log_dir": tmp_path / "run", "steps": 1, "lora_rank": 4, "mlflow": False}
    module, cfg = {
        "chat-sft": (chat_sft, dict(data=str(d["chat"]), eval_size=2, batch_size=2)),
        "gsm8k-rl": (
            gsm8k_rl,
            dict(
                data=str(d["gsm8k"]), problems_per_step=2, group_size=2, max_tokens=8, eval_size=2, learning_rate=1e-3
            ),
        ),
        "kto-ratings": (kto_ratings, dict(data=str(d["ratings"]), batch_size=4, eval_fraction=0.25)),
        "dpo": (dpo, dict(data=str(d["pairs"]), batch_size=2, eval_fraction=0.4)),
        "distill": (
            distill,
            dict(
                data=str(d["prompts"]), dataset="prompts", prompts_per_step=2, group_size=1, max_tokens=8, eval_size=2
            ),
        ),
    }[recipe]
    sdk = Sdk.load("tinker", sessions_server.base_url)
    services, factory = [], sdk.service_factory
    sdk.service_factory = lambda: services.append(factory()) or services[-1]
    summary = module.run(module.Config(**common, **cfg), sdk=sdk)

    assert isinstance(services[0], tinker.ServiceClient)
    assert summary.steps == 1 and summary.before.keys() == summary.after.keys() and summary.after
    assert all(isinstance(v, float) for v in summary.after.values())
    metrics = read_metrics(tmp_path / "run")
    assert metrics[1]["time/elapsed_s"] > 0 and any(k.startswith("train/") for k in metrics[1])
    ckpt = last_checkpoint(tmp_path / "run")
    assert ckpt["step"] == 1 and ckpt["state_path"].startswith("tinker://")
    if recipe == "dpo":
        assert summary.before["eval/loss"] == pytest.approx(0.693147, abs=1e-4)  # policy = reference at step 0
    if recipe == "kto-ratings":
        assert summary.before["eval/margin"] == pytest.approx(0.0, abs=1e-4)
