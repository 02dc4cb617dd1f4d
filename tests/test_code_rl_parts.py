"""code-rl's parts without a server: the shipped tasks grade right in the sandbox, code extraction, the reward,
the tool turn's token layout and the datum's masks (the real SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from livelora.clients.recipes.code_rl import Config, Episodes, Grader, _datum, reward, task_splits
from livelora.clients.recipes.code_tasks import (
    TEMPLATES,
    easy_tasks,
    extract_code,
    grading_program,
    humaneval_tasks,
    public_check_program,
)
from livelora.clients.recipes.renderers import ChatRenderer
from livelora.clients.recipes.sdk import Sdk
from livelora.clients.sandbox import IsolationUnavailableError, Sandbox

# HumanEval's folder: LIVELORA_HUMANEVAL, else ``../shared/data/humaneval`` beside the repository
HUMANEVAL = Path(
    os.environ.get("LIVELORA_HUMANEVAL", Path(__file__).resolve().parents[2] / "shared" / "data" / "humaneval")
)


@pytest.fixture(scope="module")
def grader() -> Grader:
    try:
        Sandbox(require_isolation=True)
    except IsolationUnavailableError as exc:
        pytest.skip(f"no isolation here: {exc}")
    return Grader(None, 6.0)


def test_every_easy_template_reference_passes_its_tests_and_a_wrong_one_fails(grader):
    tasks = easy_tasks(0)
    assert len(tasks) == 160 and len({t.task_id for t in tasks}) == 160
    assert all(len(t.public_tests) == 2 and t.hidden_tests.count("assert") == 4 for t in tasks)
    by_fn = {t.entry_point: t for t in tasks}
    programs, expected = [], []
    for name, statement, ref, _ in TEMPLATES:
        k, c = 2, "a"
        fn = f"{name}_{k}" if "{k}" in statement else (f"{name}_{c}" if "{c}" in statement else f"{name}_v0")
        task = by_fn[fn]
        right = f"{fn} = {ref.format(k=k, c=c)}"
        programs += [
            grading_program(right, task.hidden_tests),
            grading_program(f"def {fn}(*a):\n    return None", task.hidden_tests),
        ]
        expected += [True, False]
    assert [grader.run(p)[0] for p in programs] == expected


def test_humaneval_canonical_solutions_pass_hidden_and_public_tests(grader):
    if not (HUMANEVAL / "HumanEval.jsonl").exists():
        pytest.skip(f"no HumanEval.jsonl in {HUMANEVAL} (set LIVELORA_HUMANEVAL to HumanEval's folder)")
    rows = [json.loads(x) for x in (HUMANEVAL / "HumanEval.jsonl").read_text().splitlines()[:4]]
    tasks = humaneval_tasks(HUMANEVAL)[:4]
    assert len(humaneval_tasks(HUMANEVAL)) == 164
    for row, task in zip(rows, tasks):
        solution = row["prompt"] + row["canonical_solution"]
        assert grader.run(grading_program(solution, task.hidden_tests))[0], task.task_id
        assert not grader.run(grading_program(row["prompt"] + "    pass\n", task.hidden_tests))[0], task.task_id
    ok, out, secs = grader.run(
        public_check_program(rows[0]["prompt"] + rows[0]["canonical_solution"], tasks[0].public_tests)
    )
    assert ok and out.count("PASS") == len(tasks[0].public_tests) == 2 and secs > 0
    _, out, _ = grader.run(
        public_check_program("def has_close_elements(a, b):\n    return True", tasks[0].public_tests)
    )
    assert out.splitlines()[0].startswith("FAIL") and out.splitlines()[1].startswith("PASS")


def test_code_extraction_and_reward():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nand\n```\nx = 2\n```") == "x = 2"
    assert extract_code("def f(): return 1") is None
    assert (reward(None, False, 0.1), reward("x", False, 0.1), reward("x", True, 0.1)) == (-0.1, 0.0, 1.0)


def test_the_tool_turn_continues_the_sampled_tokens_as_the_template_renders_it(tokenizer):
    renderer = ChatRenderer(tokenizer)
    ep = Episodes(Config(log_dir="unused"), None, renderer, None)
    msgs = ep.messages(easy_tasks(0)[0])
    reply = "```python\ndef add_2(x):\n    return x + 2\n```\ncheck_solution"
    tool = {"role": "user", "content": "check_solution result:\nPASS assert add_2(34) == 36"}
    sampled = renderer.completion_tokens(reply)  # the reply's tokens and the end-of-turn token, as a sampler stops
    cont = ep._continuation(msgs, reply, tool, stopped=True)
    full = renderer.prompt_tokens([*msgs, {"role": "assistant", "content": reply}, tool])
    assert renderer.prompt_tokens(msgs) + sampled + cont == full
    cut = ep._continuation(msgs, reply, tool, stopped=False)  # cut by max_tokens: the end-of-turn token is added
    assert cut == renderer.stop_token_ids + cont


def test_episode_datum_trains_only_sampled_tokens_with_the_sampler_logprobs():
    sdk = Sdk.load("livelora", "http://unused")
    e = {"tokens": [1, 2, 3, 4, 5, 6], "mask": [0, 0, 1, 0, 1, 1], "logprobs": [0, 0, -0.5, 0, -1.0, -2.0]}
    d = _datum(sdk, e, 0.75)
    assert d.model_input.to_ints() == [1, 2, 3, 4, 5]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6]
    assert d.loss_fn_inputs["advantages"].tolist() == [0.0, 0.75, 0.0, 0.75, 0.75]
    assert d.loss_fn_inputs["logprobs"].tolist() == [0.0, -0.5, 0.0, -1.0, -2.0]


class _ScriptedSampler:
    """Greedy requests get a right solution; sampled ones (n episodes) get right, wrong, no code, right, ..."""

    def __init__(self, renderer: ChatRenderer, fn: str):
        replies = [f"```python\ndef {fn}(x):\n    return x + 2\n```", f"```python\ndef {fn}(x):\n    return x\n```"]
        self.tokens = [renderer.completion_tokens(r) for r in [*replies, "I cannot."]]
        self.temperatures: list[float] = []

    def sample(self, prompt, n, params):
        self.temperatures.append(params.temperature)
        picks = [0] if params.temperature < 0.01 else [i % 3 for i in range(n)]
        seqs = [
            SimpleNamespace(tokens=self.tokens[p], logprobs=[-1.0] * len(self.tokens[p]), stop_reason="stop")
            for p in picks
        ]
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=seqs))


def test_sampled_evaluation_is_the_mean_pass_rate_of_n_episodes_per_task_at_the_rollout_temperature(grader, tokenizer):
    task = next(t for t in easy_tasks(0) if t.entry_point == "add_2")
    renderer = ChatRenderer(tokenizer)
    cfg = Config(log_dir="unused", tool_call="never", eval_samples=3, temperature=0.7)
    ep = Episodes(cfg, Sdk.load("livelora", "http://unused"), renderer, grader)
    sampler = _ScriptedSampler(renderer, "add_2")
    out = ep.evaluate(sampler, [task, task], [])
    assert out == {"eval/easy_pass": 1.0, "eval/easy_code_block": 1.0, "eval/easy_pass_sampled": pytest.approx(1 / 3)}
    assert sorted(set(sampler.temperatures)) == [1e-4, 0.7]
    greedy_only = Episodes(Config(log_dir="unused", tool_call="never"), ep.sdk, renderer, grader)
    assert set(greedy_only.pass_rate(sampler, [task], "easy")) == {"eval/easy_pass", "eval/easy_code_block"}


def test_the_held_out_splits_are_disjoint_from_training_and_eval_size_0_evaluates_no_easy_task():
    train, easy, humaneval = task_splits(Config(log_dir="unused", eval_size=5))
    assert (len(train), len(easy), humaneval) == (120, 5, [])
    assert not {t.entry_point for t in easy} & {t.entry_point for t in train}
    assert task_splits(Config(log_dir="unused", eval_size=0))[1] == []


def test_cli_flags_and_a_humaneval_evaluation_without_its_data_is_refused(tmp_path):
    from typer.testing import CliRunner

    from livelora.cli.main import app

    runner = CliRunner()
    help_text = " ".join(runner.invoke(app, ["recipe", "code-rl", "--help"]).output.split())
    for flag in ("--max-staleness", "--sandbox-url", "--tool-call", "--minibatches", "--humaneval"):
        assert flag in help_text
    args = ["recipe", "code-rl", "--humaneval-eval-size", "3", "--log-dir", str(tmp_path / "r")]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1 and "--humaneval is needed" in " ".join(refused.output.split())
    assert not (tmp_path / "r").exists()  # refused before any session or run directory
