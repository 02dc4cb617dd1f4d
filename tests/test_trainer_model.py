"""TrainingModel on the real SmolLM2-135M: logprobs, SFT, gradient accumulation, validation, KTO/DPO."""

from __future__ import annotations

import math

import pytest
import torch

from livelora.clients.errors import BadRequestError, ContextLengthExceededError, UnsupportedParameterError
from livelora.clients.types import AdamParams, Datum, LoraConfig, ModelInput, TensorData
from livelora.trainer.model import TrainingModel


def sft_datum(tokens: list[int], prompt_len: int = 0) -> Datum:
    """Datum for full sequence ``tokens``; the first ``prompt_len`` tokens get weight 0 as targets."""
    n = len(tokens) - 1
    weights = [0.0 if j + 1 < prompt_len else 1.0 for j in range(n)]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(tokens[1:], "int64"),
            "weights": TensorData.from_list(weights, "float32"),
        },
    )


@pytest.fixture(scope="module")
def texts(tokenizer):
    sentences = [
        "The capital of France is Paris.",
        "Two plus two equals four.",
        "Water boils at one hundred degrees Celsius.",
        "The sky is blue on a clear day.",
    ]
    return [tokenizer(s)["input_ids"] for s in sentences]


@pytest.fixture(scope="module")
def base(base_ref):
    """The plain base model (no peft), loaded independently of the TrainingModels."""
    from livelora.core.base_models import load_model

    return load_model(base_ref)


@pytest.fixture(scope="module")
def model(base_ref):
    return TrainingModel(base_ref, LoraConfig(rank=4, seed=0))


def snapshot(m: TrainingModel):
    params = {k: p.detach().clone() for k, p in m.lora_params.items()}
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in m.lora_params.items()}
    return params, grads, m.step, len(m.optimizer.state), dict(m.data_counts)


def same_snapshot(a, b) -> bool:
    pa, ga, sa, oa, ca = a
    pb, gb, sb, ob, cb = b
    return (
        all(torch.equal(pa[k], pb[k]) for k in pa)
        and sa == sb
        and oa == ob
        and ca == cb
        and all(
            (ga[k] is None and gb[k] is None) or (ga[k] is not None and gb[k] is not None and torch.equal(ga[k], gb[k]))
            for k in ga
        )
    )


def test_fresh_adapter_logprobs_equal_the_base_model_and_padding_is_exact(model, texts, base):
    data = [sft_datum(t) for t in texts]
    batched = model.forward(data)
    for d, t, out in zip(data, texts, batched.loss_fn_outputs):
        alone = model.forward([d]).loss_fn_outputs[0]["logprobs"].to_torch()
        lp = out["logprobs"].to_torch()
        assert lp.shape == (len(t) - 1,)
        assert torch.allclose(lp, alone, atol=1e-5), "right padding changed real positions"
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([t[:-1]])).logits[0]
        manual = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t[1:])[:, None])[:, 0]
        assert torch.allclose(lp, manual, atol=1e-4)
    expected_loss = -sum(float(o["logprobs"].to_torch().sum()) for o in batched.loss_fn_outputs)
    assert batched.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert batched.metrics["num_sequences:sum"] == 4


def test_forward_and_forward_backward_give_the_same_logprobs(model, texts):
    model.zero_grad()
    data = [sft_datum(t, prompt_len=3) for t in texts]
    fwd = model.forward(data)
    fb = model.forward_backward(data)
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs):
        assert a["logprobs"].data == b["logprobs"].data
    assert fwd.metrics["loss:sum"] == fb.metrics["loss:sum"]
    model.zero_grad()


def test_gradients_accumulate_like_one_call_on_the_union_batch(model, texts):
    data = [sft_datum(t, prompt_len=2) for t in texts]
    model.zero_grad()
    model.forward_backward(data)
    union = {k: p.grad.clone() for k, p in model.lora_params.items()}
    model.zero_grad()
    model.forward_backward(data[:1])
    model.forward_backward(data[1:])
    for k, p in model.lora_params.items():
        # same sums, different padding/summation order: equal up to float32 rounding
        assert float((p.grad - union[k]).norm()) <= 1e-4 * float(union[k].norm()) + 1e-7, k
    assert any(float(g.abs().sum()) > 0 for g in union.values())
    model.zero_grad()


def test_all_zero_advantages_give_zero_gradients_not_an_error(model, texts):
    """A GRPO group whose rewards are all equal has advantages 0 everywhere: loss 0, gradients exactly 0."""
    t = texts[0]
    n = len(t) - 1
    datum = Datum(
        model_input=ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(t[1:], "int64"),
            "logprobs": TensorData.from_list([-1.0] * n, "float32"),
            "advantages": TensorData.from_list([0.0] * n, "float32"),
        },
    )
    model.zero_grad()
    out = model.forward_backward([datum], "importance_sampling")
    assert out.metrics["loss:sum"] == 0.0
    assert model.has_gradients()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.lora_params.values())
    model.zero_grad()


def test_optim_step_without_gradients_is_refused(model):
    model.zero_grad()
    before = snapshot(model)
    with pytest.raises(BadRequestError, match="no gradients"):
        model.optim_step(AdamParams())
    assert same_snapshot(before, snapshot(model))


def _bad_batches(texts):
    t = texts[0]
    good = sft_datum(t)
    n = len(t) - 1

    def with_inputs(**inputs):
        merged = {**good.loss_fn_inputs, **inputs}
        return Datum(model_input=good.model_input, loss_fn_inputs={k: v for k, v in merged.items() if v is not None})

    return [
        ("empty", [], "cross_entropy", None, "empty"),
        (
            "unknown key",
            [good, with_inputs(advantages=TensorData.from_list([0.0] * n, "float32"))],
            "cross_entropy",
            None,
            r"data\[1\]\.loss_fn_inputs\.advantages",
        ),
        ("missing key", [with_inputs(weights=None)], "cross_entropy", None, r"data\[0\].*weights"),
        (
            "short shape",
            [good, with_inputs(weights=TensorData.from_list([1.0] * (n - 1), "float32"))],
            "cross_entropy",
            None,
            r"data\[1\]\.loss_fn_inputs\.weights: shape",
        ),
        (
            "float tokens",
            [with_inputs(target_tokens=TensorData.from_list([1.0] * n, "float32"))],
            "cross_entropy",
            None,
            r"data\[0\]\.loss_fn_inputs\.target_tokens: dtype",
        ),
        (
            "nan weight",
            [with_inputs(weights=TensorData.from_list([float("nan")] + [1.0] * (n - 1), "float32"))],
            "cross_entropy",
            None,
            r"data\[0\]\.loss_fn_inputs\.weights: non-finite",
        ),
        (
            "inf advantage",
            [
                Datum(
                    model_input=good.model_input,
                    loss_fn_inputs={
                        "target_tokens": good.loss_fn_inputs["target_tokens"],
                        "logprobs": TensorData.from_list([0.0] * n, "float32"),
                        "advantages": TensorData.from_list([float("inf")] * n, "float32"),
                    },
                )
            ],
            "importance_sampling",
            None,
            r"data\[0\]\.loss_fn_inputs\.advantages: non-finite",
        ),
        (
            "target out of vocab",
            [with_inputs(target_tokens=TensorData.from_list([49152] * n, "int64"))],
            "cross_entropy",
            None,
            r"data\[0\]\.loss_fn_inputs\.target_tokens: token id 49152",
        ),
        (
            "input out of vocab",
            [good, Datum(model_input=ModelInput.from_ints([-1] + t[1:-1]), loss_fn_inputs=good.loss_fn_inputs)],
            "cross_entropy",
            None,
            r"data\[1\]\.model_input: token id -1",
        ),
        (
            "empty input",
            [Datum(model_input=ModelInput.from_ints([]), loss_fn_inputs={})],
            "cross_entropy",
            None,
            r"data\[0\]\.model_input: no tokens",
        ),
        ("unknown loss", [good], "hinge", None, "unknown loss_fn"),
        ("bad config", [good], "cross_entropy", {"beta": 0.1}, "beta"),
        ("odd dpo", [good], "dpo", None, "odd number"),
        (
            "kto label",
            [
                with_inputs(label=TensorData.from_list([2.0], "float32")),
                with_inputs(label=TensorData.from_list([1.0], "float32")),
            ],
            "kto",
            None,
            r"data\[0\]\.loss_fn_inputs\.label",
        ),
    ]


def test_invalid_batches_name_datum_and_field_and_change_nothing(model, texts):
    # Leave a real accumulated gradient in place: it must survive every failed call untouched.
    model.zero_grad()
    model.forward_backward([sft_datum(texts[1])])
    before = snapshot(model)
    cases = _bad_batches(texts)
    assert len(cases) == 14
    for name, data, loss_fn, config, pattern in cases:
        with pytest.raises(BadRequestError, match=pattern):
            model.forward_backward(data, loss_fn, config)
        with pytest.raises(BadRequestError, match=pattern):
            model.forward(data, loss_fn, config)
        assert same_snapshot(before, snapshot(model)), name
    model.zero_grad()


def test_over_long_sequences_and_unsupported_losses_are_refused(model, texts):
    long = sft_datum(list(range(100, 100 + model.max_seq_len + 2)))
    before = snapshot(model)
    with pytest.raises(ContextLengthExceededError, match=r"data\[0\]\.model_input: .* exceed"):
        model.forward_backward([long])
    with pytest.raises(UnsupportedParameterError, match="stable_reinforce"):
        model.forward_backward([sft_datum(texts[0])], "stable_reinforce")
    assert same_snapshot(before, snapshot(model))


def test_sft_steps_reduce_the_loss_and_change_every_lora_parameter(base_ref, texts):
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=3, alpha=8))
    data = [sft_datum(t, prompt_len=2) for t in texts]
    start = {k: p.detach().clone() for k, p in m.lora_params.items()}
    losses = []
    for _ in range(3):
        losses.append(m.forward_backward(data).metrics["loss:sum"])
        metrics = m.optim_step(AdamParams(learning_rate=2e-3, grad_clip_norm=1.0))
        assert metrics["grad_norm:mean"] > 1.0 and metrics["update_norm:mean"] > 0
        assert metrics["learning_rate:mean"] == 2e-3
    final = m.forward(data).metrics["loss:sum"]
    assert final < 0.8 * losses[0], (losses, final)
    assert m.step == 3 and metrics["step:max"] == 3
    unchanged = [k for k, p in m.lora_params.items() if torch.equal(p.detach(), start[k])]
    assert not unchanged, unchanged[:5]
    assert not m.has_gradients()
    assert m.data_counts == {"datums": 12, "tokens": 3 * sum(len(t) - 1 for t in texts)}


def _pref_datum(prompt: list[int], completion: list[int], label: float | None = None) -> Datum:
    tokens = prompt + completion
    d = sft_datum(tokens, prompt_len=len(prompt))
    if label is None:
        return d
    return Datum(
        model_input=d.model_input,
        loss_fn_inputs={**d.loss_fn_inputs, "label": TensorData.from_list([label], "float32")},
    )


def test_dpo_starts_at_ln2_and_kto_dpo_steps_use_base_model_reference(base_ref, base, tokenizer):
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=5))
    enc = lambda s: tokenizer(s)["input_ids"]  # noqa: E731
    q1, q2, q3 = (
        enc("Question: what is two plus two? Answer:"),
        enc("Question: capital of France? Answer:"),
        enc("Question: colour of the sky? Answer:"),
    )
    pairs = [
        _pref_datum(q1, enc(" four")),
        _pref_datum(q1, enc(" five, probably")),
        _pref_datum(q2, enc(" Paris")),
        _pref_datum(q2, enc(" Berlin")),
    ]
    out = m.forward_backward(pairs, "dpo", {"beta": 0.1})
    assert out.metrics["loss:sum"] == pytest.approx(math.log(2), abs=1e-6)  # fresh adapter: policy == reference
    m.optim_step(AdamParams(learning_rate=5e-3))
    kto = [_pref_datum(q1, enc(" four"), 1.0), _pref_datum(q2, enc(" Berlin"), 0.0), _pref_datum(q3, enc(" blue"), 1.0)]
    out = m.forward_backward(kto, "kto", {"beta": 0.1})
    assert math.isfinite(out.metrics["loss:sum"]) and out.metrics["kto/z0:mean"] >= 0
    m.optim_step(AdamParams(learning_rate=5e-3))
    after = m.forward(pairs, "dpo")
    assert after.metrics["loss:sum"] < math.log(2)  # trained toward the chosen answers
    for d, o in zip(pairs, after.loss_fn_outputs):
        ids = torch.tensor([d.model_input.to_ints()])
        tgt = d.loss_fn_inputs["target_tokens"].to_torch()
        with torch.no_grad():
            ref = torch.log_softmax(base(input_ids=ids).logits[0], -1).gather(-1, tgt[:, None])[:, 0]
        assert torch.allclose(o["ref_logprobs"].to_torch(), ref, atol=1e-4)
        assert not torch.allclose(o["logprobs"].to_torch(), ref, atol=1e-4)  # the adapter did change the policy


def test_two_dimensional_cross_entropy_scores_k_targets_per_position(model, texts):
    t = texts[0]
    n = len(t) - 1
    alt = [(x + 1) % model.vocab_size for x in t[1:]]
    pairs = [v for pair in zip(t[1:], alt) for v in pair]
    weights = [v for _ in range(n) for v in (0.75, 0.25)]
    soft = Datum(
        model_input=ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=pairs, dtype="int64", shape=[n, 2]),
            "weights": TensorData(data=weights, dtype="float32", shape=[n, 2]),
        },
    )
    out = model.forward([soft, sft_datum(t)])
    lp2 = out.loss_fn_outputs[0]["logprobs"].to_torch()
    lp1 = out.loss_fn_outputs[1]["logprobs"].to_torch()
    assert lp2.shape == (n, 2) and lp1.shape == (n,)
    assert torch.allclose(lp2[:, 0], lp1, atol=1e-5)
    expected = float(-(0.75 * lp2[:, 0] + 0.25 * lp2[:, 1]).sum() - lp1.sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
