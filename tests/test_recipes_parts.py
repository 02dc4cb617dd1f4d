"""Recipe building blocks against hand-made examples and losses.md's hand-computed values (no server)."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from livelora.clients.recipes.advantages import group_advantages, reverse_kl_advantages
from livelora.clients.recipes.checkpoints import (
    CHECKPOINTS,
    ConfigMismatchError,
    last_checkpoint,
    record_checkpoint,
    save_config,
)
from livelora.clients.recipes.datasets import Rated, load_preferences, load_ratings, pairs_from_ratings
from livelora.clients.recipes.datums import (
    SequenceTooLongError,
    batch_indices,
    check_length,
    rl_datum,
    split,
    supervised_datum,
)
from livelora.clients.recipes.evaluation import extract_answer, math_reward
from livelora.clients.recipes.preference import (
    balanced_weights,
    dpo_loss_fn,
    kl_partner,
    kto_loss_fn,
    kto_reference_point,
)
from livelora.clients.recipes.renderers import ChatRenderer, TemplateError
from livelora.clients.recipes.sdk import Sdk


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


def trained_text(renderer, tokens, weights):
    return renderer.tokenizer.decode([t for t, w in zip(tokens, weights) if w])


# ---------------------------------------------------------------------------------------------- renderer / masks
def test_renderer_trains_only_the_assistant_reply_and_its_end_of_turn(renderer):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is 4."}]
    tokens, weights = renderer.supervised(msgs)
    full = renderer.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert renderer.tokenizer.decode(tokens) == full
    assert trained_text(renderer, tokens, weights) == "The answer is 4.<|im_end|>"
    # the trained span is one contiguous run ending on <|im_end|> (id 2); the trailing newline is not trained
    first, last = weights.index(1.0), len(weights) - 1 - weights[::-1].index(1.0)
    assert all(weights[first : last + 1]) and tokens[last] == 2 and weights[-1] == 0.0
    assert tokens[:first] == renderer.prompt_tokens(msgs[:1])  # everything before is exactly the prompt


def test_renderer_masks_every_assistant_turn_or_only_the_last(renderer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    tokens, weights = renderer.supervised(msgs)
    assert trained_text(renderer, tokens, weights) == "Hello!<|im_end|>Goodbye.<|im_end|>"
    tokens, weights = renderer.supervised(msgs, "last_assistant")
    assert trained_text(renderer, tokens, weights) == "Goodbye.<|im_end|>"
    assert "Be brief." in renderer.tokenizer.decode(tokens)


def test_renderer_system_prompt_and_prompt_tokens(tokenizer):
    r = ChatRenderer(tokenizer, system_prompt="Answer in French.")
    text = tokenizer.decode(r.prompt_tokens([{"role": "user", "content": "Hi"}]))
    assert (
        text == "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.completion_tokens("Salut") == tokenizer.encode("Salut") + [2]
    assert r.stop_token_ids == [2]


def test_renderer_refuses_templates_it_cannot_mask_and_bad_messages(tokenizer, renderer):
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = (
        "{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(TemplateError, match="prefix-stable"):
        ChatRenderer(odd).supervised([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(TemplateError, match="assistant"):
        renderer.supervised([{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError, match=r"messages\[0\]"):
        renderer.supervised([{"role": "robot", "content": "a"}])


# ---------------------------------------------------------------------------------------------- datums
@pytest.mark.parametrize("sdk_name", ["livelora", "tinker"])
def test_datums_are_shifted_with_zero_prompt_inputs(sdk_name):
    if sdk_name == "tinker":
        pytest.importorskip("tinker")
    sdk = Sdk.load(sdk_name, "http://127.0.0.1:1")
    d = supervised_datum(sdk, [1, 2, 3, 4], [0, 0, 1, 1])
    assert d.model_input.to_ints() == [1, 2, 3]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    d = rl_datum(sdk, [10, 11, 12], [20, 21], [-0.5, -0.25], 2.0)
    assert d.model_input.to_ints() == [10, 11, 12, 20]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 20, 21]
    assert d.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert d.loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, 2.0, 2.0]
    d = rl_datum(sdk, [10], [20, 21], [-0.5, -0.25], [0.5, -1.0])
    assert d.loss_fn_inputs["advantages"].tolist() == [0.5, -1.0]
    with pytest.raises(ValueError):
        rl_datum(sdk, [10], [20, 21], [-0.5], 1.0)


def test_length_limit_error_skip_truncate():
    with pytest.raises(SequenceTooLongError, match="conversation 7: 5 tokens > max_length 4"):
        check_length([1] * 5, 4, "error", "conversation 7")
    assert check_length([1] * 5, 4, "skip", "x") is False
    assert check_length([1] * 5, 4, "truncate", "x") is True
    assert check_length([1] * 4, 4, "error", "x") is True


def test_batches_are_seeded_epochs_and_depend_only_on_the_step():
    steps = [batch_indices(5, 2, s, seed=3) for s in range(5)]
    flat = [i for b in steps for i in b]
    assert sorted(flat[:5]) == [0, 1, 2, 3, 4] and sorted(flat[5:10]) == [0, 1, 2, 3, 4]  # two full epochs
    assert flat[:5] != flat[5:10]  # each epoch reshuffled
    assert batch_indices(5, 2, 3, seed=3) == steps[3]  # a resumed run sees the same batch
    assert batch_indices(5, 2, 0, seed=4) != steps[0] or batch_indices(5, 2, 1, seed=4) != steps[1]
    train, held = split(list(range(10)), 3, seed=0)
    assert len(held) == 3 and sorted(train + held) == list(range(10))
    assert split(list(range(10)), 0.2, seed=0)[1] == split(list(range(10)), 2, seed=0)[1]


# ---------------------------------------------------------------------------------------------- advantages
@pytest.mark.parametrize(
    "rewards,estimator,expected",
    [
        ([1, 0, 0, 1], "mean", [0.5, -0.5, -0.5, 0.5]),
        ([1, 0, 0, 1], "mean_std", [0.865875, -0.865875, -0.865875, 0.865875]),
        ([1, 0, 0, 1], "loo", [0.666667, -0.666667, -0.666667, 0.666667]),
        ([1, -0.1, 0.9, 0], "mean", [0.55, -0.55, 0.45, -0.45]),
        ([1, -0.1, 0.9, 0], "mean_std", [0.947737, -0.947737, 0.775421, -0.775421]),
        ([1, -0.1, 0.9, 0], "loo", [0.733333, -0.733333, 0.6, -0.6]),
        ([0, 0, 0, 1], "mean_std", [-0.4999, -0.4999, -0.4999, 1.4997]),
        ([1, 1, 1, 1], "mean_std", [0.0, 0.0, 0.0, 0.0]),
        ([0.35] * 8, "mean_std", [0.0] * 8),
        ([1.0], "loo", [0.0]),
    ],
)
def test_group_advantages_match_hand_computed_values(rewards, estimator, expected):
    assert group_advantages(rewards, estimator) == pytest.approx(expected, abs=1e-4)


def test_advantage_errors_and_reverse_kl():
    with pytest.raises(ValueError, match="estimator"):
        group_advantages([1, 0], "median")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1, float("nan")])
    # losses.md §3.6: q = [-0.5, -1.0, -0.2], teacher = [-0.7, -0.9, -0.6] -> A = [-0.2, 0.1, -0.4]
    assert reverse_kl_advantages([-0.5, -1.0, -0.2], [-0.7, -0.9, -0.6]) == pytest.approx([-0.2, 0.1, -0.4])
    assert reverse_kl_advantages([-0.5], [-0.7], coef=0.5) == pytest.approx([-0.1])


# ---------------------------------------------------------------------------------------------- grading
def test_math_answers_and_rewards():
    assert extract_answer("First 3 + 4 = 7. The answer is 1,234.") == ("1234", True)
    assert extract_answer("so 5 + 3 = 8") == ("8", False)
    assert extract_answer("#### 18.00") == ("18", True)
    assert extract_answer("no digits") == (None, False)
    assert math_reward("The answer is 18.", "18", stopped=True) == (1.0, True, True)
    assert math_reward("The answer is 18.", "18", stopped=False)[0] == pytest.approx(0.9)
    assert math_reward("It is 18", "18", stopped=True)[0] == pytest.approx(0.9)
    assert math_reward("The answer is 17.", "18", stopped=True)[0] == 0.0
    assert math_reward("hmm", "18", stopped=False)[0] == pytest.approx(-0.1)
    assert math_reward("The answer is -3.", "-3", stopped=True)[1]


# ---------------------------------------------------------------------------------------------- preference losses
def _leaves(*rows):
    return [torch.tensor(r, dtype=torch.float64, requires_grad=True) for r in rows]


def test_dpo_custom_loss_matches_losses_md_vector():
    # losses.md §3.3: masked sums chosen [-2.2, -2.0], rejected [-3.5, -3.7]; ref chosen [-2.8, -2.0],
    # ref rejected [-3.1, -3.5]; h = [1.0, 0.2]; loss 0.663797. Prompt length 1: every logprob is completion.
    lp = _leaves([-0.5, -1.0, -0.7], [-1.5, -2.0], [-1.2, -0.8], [-0.9, -1.1, -1.3, -0.4])
    loss, metrics = dpo_loss_fn([1, 1, 1, 1], [-2.8, -2.0], [-3.1, -3.5], beta=0.1)(None, lp)
    assert float(loss.detach()) == pytest.approx(0.663797, abs=1e-6)
    assert metrics["dpo/margin"] == pytest.approx(0.6) and metrics["dpo/accuracy"] == 1.0
    loss.backward()
    assert lp[0].grad.tolist() == pytest.approx([-0.0237510] * 3, abs=1e-7)
    assert lp[1].grad.tolist() == pytest.approx([0.0237510] * 2, abs=1e-7)
    assert lp[2].grad.tolist() == pytest.approx([-0.0247500] * 2, abs=1e-7)
    # prompt positions get no gradient
    lp = _leaves([-9.0, -0.5, -1.0, -0.7], [-9.0, -1.5, -2.0])
    loss, _ = dpo_loss_fn([2, 2], [-2.8], [-3.1], beta=0.1)(None, lp)
    loss.backward()
    assert lp[0].grad[0] == 0 and lp[1].grad[0] == 0


@pytest.mark.parametrize("beta,lam_u,expected", [(0.1, 1.0, 0.479398), (0.1, 1.33, 0.558497), (0.5, 1.0, 0.399584)])
def test_kto_custom_loss_matches_losses_md_vector(beta, lam_u, expected):
    # losses.md §3.2: policy sequences [-3.5, -1.2, -4.0, -6.0], ref [-5.0, -1.5, -3.5, -5.0], labels D D U U,
    # KL-pair ratios [0.4, 0.1, -0.5, 0.3] -> z0 = 0.075
    z0 = kto_reference_point([-7.0, -4.0, -6.5, -5.0], [-7.4, -4.1, -6.0, -5.3])
    assert z0 == pytest.approx(0.075)
    lp = _leaves([-1, -2, -0.5], [-0.2, -0.4, -0.6], [-3, -1], [-2, -2, -2])
    loss, metrics = kto_loss_fn([1] * 4, [-5.0, -1.5, -3.5, -5.0], [True, True, False, False], z0, beta, 1.0, lam_u)(
        None, lp
    )
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    assert metrics["kto/z0"] == pytest.approx(0.075)
    if beta == 0.1 and lam_u == 1.0:
        loss.backward()
        assert float(lp[0].grad[0]) == pytest.approx(-0.00621838, abs=1e-8)
        assert float(lp[2].grad[0]) == pytest.approx(0.00624484, abs=1e-8)


def test_kto_reference_point_is_clamped_and_pairs_never_match_their_own_prompt():
    assert kto_reference_point([-7, -4, -6.5, -5], [-6, -3.5, -6, -5]) == 0.0  # raw mean -0.5
    assert kto_reference_point([], []) == 0.0
    for prompts in (["a", "a", "b", "b", "c"], ["a", "b"], ["x", "y", "y", "y", "z", "x"]):
        partner = kl_partner(prompts)
        assert all(prompts[j] != prompts[i] for i, j in enumerate(partner))
    assert kl_partner(["a", "a"]) == [-1, -1]
    assert balanced_weights(6, 2) == (8 / 12, 2.0) and balanced_weights(0, 3) == (1.0, 1.0)


# ---------------------------------------------------------------------------------------------- data sources
def test_ratings_from_the_dataset_of_record(tmp_path, renderer):
    def rating(i, key, rating, finish="stop"):
        return {
            "stream_id": f"1-{i}",
            "received": 1.0,
            "event": {
                "type": "rating",
                "id": f"fb-{i}",
                "endpoint": "m",
                "created": 1,
                "completion_id": f"c{i}",
                "prompt_token_ids": [1, 2, 3],
                "completion_token_ids": [40 + i],
                "finish_reason": finish,
                "rating": rating,
                "rating_key": key,
            },
        }

    rows = [
        rating(0, "k1", True),
        rating(1, "k2", False, "length"),
        rating(2, "k1", False),
        {"stream_id": "1-9", "received": 1.0, "event": {"type": "demonstration", "id": "d"}},
        {"stream_id": "1-8", "received": 1.0, "invalid": "bad", "fields": {}},
    ]
    (tmp_path / "2026-01-01.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    (tmp_path / "trained.jsonl").write_text('{"ids": []}\n')
    rated = load_ratings(tmp_path, renderer)
    assert sorted(rated, key=lambda x: x.completion) == [
        Rated((1, 2, 3), (41,), False),  # cut by max_tokens: no end-of-turn token added
        Rated((1, 2, 3), (42, 2), False),
    ]  # the re-rate of k1 replaced the thumbs-up; stop -> + <|im_end|>
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": "Hi", "completion": "Hello", "label": True}) + "\n")
    (x,) = load_ratings(trl, renderer)
    assert x.desirable and x.completion == tuple(renderer.completion_tokens("Hello"))
    assert x.prompt == tuple(renderer.prompt_tokens([{"role": "user", "content": "Hi"}]))


def test_preferences_token_and_text_forms_and_pairs_from_ratings(tmp_path, renderer):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt_token_ids": [1], "chosen_token_ids": [2], "rejected_token_ids": [3]})
        + "\n"
        + json.dumps(
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "chosen": "Hello!",
                "rejected": [{"role": "assistant", "content": "Go away."}],
            }
        )
        + "\n"
    )
    a, b = load_preferences(f, renderer)
    assert (a.prompt, a.chosen, a.rejected) == ((1,), (2,), (3,))
    assert b.rejected == tuple(renderer.completion_tokens("Go away."))
    rated = [Rated((1,), (5,), True), Rated((1,), (6,), False), Rated((1,), (7,), False), Rated((2,), (8,), False)]
    pairs = pairs_from_ratings(rated)
    assert sorted((p.chosen, p.rejected) for p in pairs) == [((5,), (6,)), ((5,), (7,))]


# ---------------------------------------------------------------------------------------------- run directory
def test_checkpoint_log_survives_a_torn_line_and_configs_must_match(tmp_path):
    record_checkpoint(tmp_path, 2, "step-000002", "tinker://m/weights/step-000002")
    record_checkpoint(tmp_path, 4, "step-000004", "tinker://m/weights/step-000004")
    with open(tmp_path / CHECKPOINTS, "a") as f:
        f.write('{"step": 6, "name": "step-0000')  # killed mid-write
    assert last_checkpoint(tmp_path)["state_path"] == "tinker://m/weights/step-000004"
    assert last_checkpoint(tmp_path / "fresh") is None
    failed = tmp_path / "failed"  # a run that failed before its first checkpoint holds nothing to resume
    failed.mkdir()
    save_config(failed, {"data": "/nonexistent", "steps": 10}, frozenset({"steps"}))
    save_config(failed, {"data": "openai/gsm8k", "steps": 10}, frozenset({"steps"}))
    assert json.loads((failed / "config.json").read_text())["data"] == "openai/gsm8k"
    save_config(tmp_path, {"lr": 1e-4, "steps": 10}, frozenset({"steps"}))
    save_config(tmp_path, {"lr": 1e-4, "steps": 20}, frozenset({"steps"}))  # steps may grow on resume
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 20
    with pytest.raises(ConfigMismatchError, match=r"lr: 0\.0001 -> 0\.001"):
        save_config(tmp_path, {"lr": 1e-3, "steps": 20}, frozenset({"steps"}))


def test_metrics_go_to_jsonl_and_to_an_mlflow_file_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from livelora.clients.recipes.metrics import MetricsLogger, read_metrics

    log = MetricsLogger(tmp_path, "unit", {"learning_rate": 1e-4, "nested": {"a": 1}}, use_mlflow=True)
    log.log(0, {"eval/nll": 1.5})
    log.log(1, {"train/loss": 1.2, "train/tokens": 100})
    log.log(1, {"train/loss": 1.1})  # a redone step: the later record wins
    log.close()
    assert read_metrics(tmp_path) == {0: {"eval/nll": 1.5}, 1: {"train/loss": 1.1, "train/tokens": 100}}
    again = MetricsLogger(tmp_path, "unit", {}, use_mlflow=True)  # a resumed run logs to the same MLflow run
    again.log(2, {"train/loss": 0.9})
    again.close()
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(log.run_id)
    assert again.run_id == log.run_id and run.data.params["learning_rate"] == "0.0001"
    assert run.data.params["nested.a"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(log.run_id, "train/loss")] == [
        (1, 1.2),
        (1, 1.1),
        (2, 0.9),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(log.run_id, "eval/nll")] == [(0, 1.5)]


def test_a_hub_dataset_that_cannot_be_reached_is_a_clear_error(monkeypatch):
    pytest.importorskip("datasets", reason="`datasets` is not a dev extra (pip install datasets)")
    from livelora.clients.recipes.datasets import DataError, load_chat

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="not a local path and could not be loaded"):
        load_chat("HuggingFaceH4/ultrachat_200k", "train_sft")


def test_chat_data_from_a_messages_file_or_a_clear_error_without_datasets(tmp_path, monkeypatch):
    from livelora.clients.recipes.datasets import DataError, load_chat

    f = tmp_path / "tulu.jsonl"  # the Tulu 3 SFT mixture / UltraChat row shape
    f.write_text(
        json.dumps(
            {
                "id": "x",
                "source": "s",
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            }
        )
        + "\n"
        + json.dumps({"prompt": "p", "messages": []})
        + "\n"
    )
    with pytest.raises(DataError, match="row 2 has no 'messages'"):
        load_chat(str(f))
    f.write_text(f.read_text().splitlines()[0] + "\n")
    assert load_chat(str(f)) == [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # an environment without `datasets`: said so
    with pytest.raises(DataError, match="the `datasets` package is not installed"):
        load_chat("HuggingFaceH4/ultrachat_200k", "train_sft")
    monkeypatch.delitem(sys.modules, "datasets")
    from livelora.clients.recipes.datasets import gsm8k

    for missing in (str(tmp_path / "nonexistent"), "./gsm8k"):  # a local path, not a hub name: said so
        with pytest.raises(DataError, match="no such file or folder"):
            gsm8k(missing, "train")
    with pytest.raises(DataError, match="no such file or folder"):
        load_chat(str(tmp_path / "chats.jsonl"))


def test_recipe_cli_lists_the_recipes_and_validates_flags(tmp_path):
    from typer.testing import CliRunner

    from livelora.cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["recipe", "--help"])
    assert out.exit_code == 0
    for name in ("chat-sft", "gsm8k-rl", "kto-ratings", "dpo", "distill", "code-rl"):
        assert name in out.output
    help_text = runner.invoke(app, ["recipe", "gsm8k-rl", "--help"]).output
    assert "--max-staleness" in help_text and "--learning-rate" in help_text
    bad = runner.invoke(
        app, ["recipe", "gsm8k-rl", "--steps", "0", "--loss", "reinforce", "--log-dir", str(tmp_path / "r")]
    )
    assert bad.exit_code == 2
    assert "--steps" in bad.output and "--loss" in bad.output  # every error at once, before any request
    assert not (tmp_path / "r").exists()
    # no server at the URL: the error says what a recipe needs
    down = runner.invoke(app, ["recipe", "dpo", "--smoke", "--base-url", "http://127.0.0.1:9", "--no-mlflow"])
    down_text = " ".join(down.output.split())
    assert down.exit_code == 1 and "cannot reach http://127.0.0.1:9" in down_text
    assert "start `livelora serve`, or pass --base-url" in down_text
    # a flag the chosen task would leave unused is refused, not ignored (--task arithmetic generates its problems)
    unused = runner.invoke(
        app,
        [
            "recipe",
            "gsm8k-rl",
            "--task",
            "arithmetic",
            "--data",
            "../shared/data/gsm8k",
            "--log-dir",
            str(tmp_path / "r"),
        ],
    )
    assert unused.exit_code == 2 and "error: data='../shared/data/gsm8k' is not used by task 'arithmetic'" in " ".join(
        unused.output.split()
    )
    assert not (tmp_path / "r").exists()
    from livelora.clients.recipes import gsm8k_rl

    assert gsm8k_rl.Config(log_dir=tmp_path / "c").data == "openai/gsm8k"
    assert gsm8k_rl.Config(log_dir=tmp_path / "c", task="arithmetic").data is None


def test_update_shift_weighs_each_tokens_logprob_change_by_its_advantage():
    from types import SimpleNamespace as NS

    from livelora.clients.recipes.loop import update_shift

    class TD(list):  # a TensorData's tolist()
        def tolist(self):
            return list(self)

    data = [
        NS(loss_fn_inputs={"advantages": TD([0.0, 1.0, 1.0])}),
        NS(loss_fn_inputs={"advantages": TD([0.0, -0.5, -0.5])}),
    ]
    before = [[-1.0, -1.5, -2.5], [-1.0, -2.0, -4.0]]
    after = [[-9.0, -1.0, -2.0], [-9.0, -3.0, -5.0]]  # position 0 carries no advantage: its change does not count
    calls = []

    class Client:
        def forward(self, part, loss):
            calls.append((len(part), loss))
            return NS(result=lambda: NS(loss_fn_outputs=[{"logprobs": TD(lp)} for lp in after[: len(part)]]))

    out = update_shift(Client(), data, "importance_sampling", before)
    assert calls == [(2, "importance_sampling")]
    assert out["train/update_gain"] == pytest.approx((0.5 + 0.5 + 0.5 + 0.5) / 3)  # Σ A·Δ / Σ|A|
    assert out["train/update_dlogprob_pos"] == pytest.approx(0.5)
    assert out["train/update_dlogprob_neg"] == pytest.approx(-1.0)
    assert update_shift(Client(), data[:1], "ppo", [[0.0, 0.0, 0.0]]).keys() == {
        "train/update_gain",
        "train/update_dlogprob_pos",
    }
