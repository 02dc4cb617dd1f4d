"""``livelora recipe NAME --smoke`` against a live server (real SmolLM2, real Redis): each recipe's preset runs its
2 steps to the summary in a fresh run directory; the step lines and the summary read one clock; each run learns
something it can show (the held-out metric moves the right way, or the RL update made its better-rewarded tokens
likelier); a step of ``gsm8k-rl`` that trained on no datum says so and why. The preset's wall time is a figure
printed here, not asserted (measured in docs/recipes.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from _doc_blocks import REPO, blocks

from livelora.clients.recipes.cli import step_text
from livelora.clients.recipes.metrics import read_metrics


def smoke(recipe: str, url: str, *flags: str) -> tuple[str, float]:
    """``livelora recipe RECIPE --smoke FLAGS --base-url URL`` as a process; returns its output and wall seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "200"}
    flags = flags if "--smoke" in flags else ("--smoke", *flags)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "livelora.cli.main", "recipe", recipe, *flags, "--base-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out, time.monotonic() - started


RECIPES = ["chat-sft", "gsm8k-rl", "kto-ratings", "dpo", "distill", "code-rl"]
#: recipe -> the held-out metric its smoke run moves and the way it must go (+1 up, -1 down)
EVAL_MOVES = {"chat-sft": ("eval/nll", -1), "kto-ratings": ("eval/margin", 1), "dpo": ("eval/margin", 1)}


def doc_lines() -> list[str]:
    """The commands of docs/recipes.md's smoke block, as a user types them."""
    (block,) = [b for b in blocks(REPO / "docs" / "recipes.md") if b.mark.startswith("run: tests/test_recipe_smoke.py")]
    return block.code.splitlines()


def test_the_docs_list_a_smoke_run_of_every_recipe():
    assert sorted(doc_lines()) == sorted(f"livelora recipe {r} --smoke" for r in RECIPES)


def test_every_smoke_preset_shows_a_held_out_metric_move_or_checks_its_updates():
    from livelora.clients.recipes.smoke import PRESETS

    checked = {r for r in RECIPES if PRESETS[r].get("check_update")}
    assert checked == set(RECIPES) - set(EVAL_MOVES) == {"gsm8k-rl", "distill", "code-rl"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_has_a_smoke_preset_whose_lines_and_summary_share_one_clock(sessions_server, recipe, capsys):
    (line,) = [x for x in doc_lines() if x.split()[2] == recipe]
    out, wall = smoke(recipe, sessions_server.base_url, *line.split()[3:])
    with capsys.disabled():
        print(f"\n{recipe} --smoke: {wall:.0f} s wall")
    assert f"{recipe}: starting, 2 steps" in out
    steps = [float(s) for s in re.findall(rf"{recipe}: step \d/2 (\d+)s", out)]
    assert len(steps) == 2 and steps[0] <= steps[1], out
    flat = " ".join(out.split())  # the summary's title wraps with the table's width
    title = re.search(rf"{recipe}: 2 steps, (\d+) s wall \(set-up, steps, evaluations\), (\S+)", flat)
    assert title, out
    summary_s, log_dir = float(title.group(1)), title.group(2)
    assert steps[1] <= summary_s + 1  # the last step line comes before the final evaluation, on the same clock
    assert "livelora-" in log_dir and "-smoke-" in log_dir  # a fresh directory: never a real run's
    config = json.loads(open(os.path.join(log_dir, "config.json")).read())
    assert config["steps"] == 2 and config["mlflow"] is False
    logged = read_metrics(log_dir)
    assert sorted(k for k in logged if k) == [1, 2]
    assert f"{steps[1]:.0f}" == f"{logged[2]['time/elapsed_s']:.0f}"  # the step line prints the run's elapsed_s
    if recipe in EVAL_MOVES:  # before (step 0) and after (step 2), as the summary table prints them
        key, sign = EVAL_MOVES[recipe]
        assert sign * (logged[2][key] - logged[0][key]) > 0, (key, logged[0][key], logged[2][key])
    else:  # at least one real update, and each one made the better-than-average tokens likelier
        updated = [s for s in (1, 2) if logged[s].get("train/datums", 1) > 0]
        assert updated, logged
        assert all(logged[s]["train/update_gain"] > 0 for s in updated), logged
        assert f"{recipe}: step {updated[0]}/2" in out and "train/update_gain=" in out
    if recipe == "code-rl":  # the short preset still runs check_solution turns in the sandbox and updates the LoRA
        assert max(logged[s]["train/tool_call_rate"] for s in (1, 2)) > 0, logged
        assert min(logged[s]["time/sandbox_s"] for s in (1, 2)) > 0, logged
        assert sum(logged[s]["train/datums"] for s in (1, 2)) > 0 and "train/loss" in logged[1] | logged[2], logged


def test_a_flag_given_with_smoke_wins_and_a_step_without_datums_says_why(sessions_server, tmp_path):
    # near-greedy rollouts: both samples of a problem are the same reply, so every group has equal rewards
    flags = ("--steps", "1", "--temperature", "0.0001", "--log-dir", str(tmp_path / "run"))
    out, _ = smoke("gsm8k-rl", sessions_server.base_url, *flags)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["steps"], config["temperature"], config["problems_per_step"]) == (1, 0.0001, 2)
    logged = read_metrics(tmp_path / "run")[1]
    assert (logged["train/datums"], logged["train/groups"], logged["train/groups_equal"]) == (0, 2, 2)
    line = next(line for line in out.splitlines() if line.startswith("gsm8k-rl: step 1/1"))
    assert line.endswith("(no update: all 2 groups had equal rewards)") and "train/loss" not in line, line
    assert "train/datums=0" in line
    assert "no update" not in step_text({"train/loss": 0.5, "train/datums": 4, "train/groups": 2})
