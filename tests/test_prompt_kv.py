"""Prompt keys/values reused (trainer/prompt_kv.py): KTO's mismatched pairs continue from the matched pairs'
prompts, the gate's probes from their shared prefix; the values equal a full recompute of every sequence, one at a
time, on the real SmolLM2 with a trained adapter."""

from __future__ import annotations

import contextlib

import pytest
import torch

import livelora.trainer.logprobs as logprobs_mod
import livelora.trainer.loss_pass as loss_pass_mod
from livelora.clients.types import AdamParams, Datum, LoraConfig, ModelInput, TensorData
from livelora.trainer.logprobs import datum_inputs
from livelora.trainer.losses import kl_pair_order
from livelora.trainer.model import TrainingModel


def kto_datum(prompt: list[int], completion: list[int], label: float) -> Datum:
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_list(tokens[1:], "int64"),
            "weights": TensorData.from_list(weights, "float32"),
            "label": TensorData.from_list([label], "float32"),
        },
    )


@pytest.fixture(scope="module")
def trained(base_ref, tokenizer):
    """A rank-4 adapter after two SFT steps (lora_B ≠ 0, so policy ≠ reference), and a KTO batch whose prompts
    and completions have different lengths (padding inside both the prompt keys/values and the continuations)."""
    m = TrainingModel(base_ref, LoraConfig(rank=4, seed=7))

    def enc(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]

    rows = [
        ("Question: what is two plus two? Answer:", " four", 1.0),
        ("Q: capital of France?", " Berlin, I think, or maybe Rome.", 0.0),
        ("Question: what colour is the sky on a clear summer day? Answer:", " blue", 1.0),
        ("Say hi.", " Hello there! How are you today?", 0.0),
    ]
    data = [kto_datum(enc(p), enc(c), lab) for p, c, lab in rows]
    # trained on the mismatched pairs themselves, so that their KL estimate z0 is clearly above 0
    perm = kl_pair_order([tuple(enc(p)) for p, _c, _lab in rows])
    sft = [kto_datum(enc(rows[i][0]), enc(rows[j][1]), 1.0) for i, j in enumerate(perm)]
    sft = [
        Datum(model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")})
        for d in sft
    ]
    for _ in range(2):
        m.forward_backward(sft, "cross_entropy")
        m.optim_step(AdamParams(learning_rate=1e-2))
    return m, data


def full_logratio(m: TrainingModel, prompt: list[int], completion: list[int]) -> float:
    """Σ over the completion of (policy − reference) logprob, one unpadded sequence through the peft model."""
    seq = prompt + completion
    ids = torch.tensor([seq[:-1]])
    tgt = torch.tensor(seq[1:])
    out = []
    with torch.no_grad():
        for ctx in (contextlib.nullcontext(), m.peft_model.disable_adapter()):
            with ctx:
                logp = torch.log_softmax(m.peft_model(input_ids=ids).logits[0].float(), -1)
            out.append(logp.gather(-1, tgt[:, None])[:, 0][len(prompt) - 1 :].sum())
    return float(out[0] - out[1])


def test_shared_prompt_kl_logratios_equal_a_full_recompute_of_each_pair(trained):
    m, data = trained
    prompts = [
        d.model_input.to_ints()[: int(torch.nonzero(d.loss_fn_inputs["weights"].to_torch())[0]) + 1] for d in data
    ]
    completions = [d.loss_fn_inputs["target_tokens"].to_torch()[len(p) - 1 :].tolist() for d, p in zip(data, prompts)]
    perm = kl_pair_order([tuple(p) for p in prompts])
    expected = [full_logratio(m, prompts[i], completions[j]) for i, j in enumerate(perm)]
    assert max(abs(e) for e in expected) > 0.05  # the adapter really differs from the reference

    inputs = [datum_inputs(d) for d in data]
    share = [len(p) - 1 for p in prompts]
    tokens = [d.model_input.to_ints() for d in data]
    targets = [x["target_tokens"] for x in inputs]
    _, policy_kv = m.logprobs(tokens, targets, share_prefix=share)
    _, ref_kv = m.logprobs(tokens, targets, adapter=False, share_prefix=share)
    assert [k.shape[-2] for k, _v in policy_kv.layers] == [max(share)] * len(policy_kv.layers)
    shared = m.logprobs.kl_logratios(data, inputs, (policy_kv, ref_kv))
    recomputed = m.logprobs.kl_logratios(data, inputs)
    assert shared.tolist() == pytest.approx(expected, abs=2e-4)
    assert recomputed.tolist() == pytest.approx(expected, abs=2e-4)


def test_kto_step_with_shared_prompts_equals_the_recomputed_step(trained, monkeypatch):
    m, data = trained
    cfg = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    results = []
    for limit in (loss_pass_mod.PROMPT_KV_MAX_BYTES, 0):  # 0: no keys/values may be kept, every pair is recomputed
        monkeypatch.setattr(loss_pass_mod, "PROMPT_KV_MAX_BYTES", limit)
        monkeypatch.setattr(logprobs_mod, "PROMPT_KV_MAX_BYTES", limit)
        out = m.forward_backward(data, "kto", cfg)
        grads = {k: p.grad.clone() for k, p in m.lora_params.items()}
        m.zero_grad()
        results.append((out.metrics, grads))
    (shared, g_shared), (full, g_full) = results
    assert shared["kto/z0:mean"] > 0
    for key in ("loss:sum", "kto/z0:mean", "kto/rewards_desirable:mean", "kto/rewards_undesirable:mean"):
        assert shared[key] == pytest.approx(full[key], abs=1e-5), key
    for k in g_full:
        assert torch.allclose(g_shared[k], g_full[k], atol=1e-6, rtol=1e-3), k


def test_gate_probes_from_their_shared_prefix_equal_one_full_pass_per_probe(trained, tokenizer):
    from livelora.trainer.gate_measure import ProbeSuite

    m, _data = trained
    suite = ProbeSuite(tokenizer)
    assert suite.shared >= 5 and all(s[: suite.shared] == suite.seqs[0][: suite.shared] for s in suite.seqs)
    for adapter in (True, False):
        right, logp_M_V = suite.probe_logprobs(m, adapter=adapter)
        rows = []
        with torch.no_grad():
            for seq, start in zip(suite.seqs, suite.reply_start):
                ctx = contextlib.nullcontext() if adapter else m.peft_model.disable_adapter()
                with ctx:
                    logits = m.peft_model(input_ids=torch.tensor([seq])).logits[0].float()
                rows.append(torch.log_softmax(logits[start - 1 :], -1))
        expected = torch.cat(rows)
        assert logp_M_V.shape == expected.shape
        assert float((logp_M_V - expected).abs().max()) < 5e-4
        firsts = [int(r[-1].argmax()) for r in rows]
        assert right == [p.right(tokenizer.decode([t])) for p, t in zip(suite.probes, firsts)]
        shared, suite.shared = suite.shared, 0  # no shared prefix: one padded pass over the whole probes
        right_plain, logp_plain = suite.probe_logprobs(m, adapter=adapter)
        suite.shared = shared
        assert right_plain == right and float((logp_plain - expected).abs().max()) < 5e-4


@pytest.mark.parametrize("loss_fn", ["kto", "cross_entropy"])
def test_loss_positions_only_gives_the_same_step_and_zeros_elsewhere(trained, loss_fn):
    m, data = trained
    if loss_fn == "cross_entropy":
        data = [
            Datum(
                model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")}
            )
            for d in data
        ]
    cfg = {"beta": 0.1} if loss_fn == "kto" else None
    results = []
    for only in (False, True):
        out = m.forward_backward(data, loss_fn, cfg, loss_positions_only=only)
        results.append((out, {k: p.grad.clone() for k, p in m.lora_params.items()}))
        m.zero_grad()
    (full, g_full), (only, g_only) = results
    assert only.metrics == pytest.approx(full.metrics, abs=1e-6)
    for k in g_full:
        assert torch.allclose(g_only[k], g_full[k], atol=1e-7, rtol=1e-5), k
    for d, a, b in zip(data, full.loss_fn_outputs, only.loss_fn_outputs):
        used = d.loss_fn_inputs["weights"].to_torch() != 0
        for key in a:
            x, y = a[key].to_torch(), b[key].to_torch()
            assert torch.equal(y[~used], torch.zeros_like(y[~used])) and bool((x[~used] != 0).all())
            assert torch.allclose(y[used], x[used], atol=1e-5), key


def test_a_batch_sharing_a_long_prefix_runs_it_once_with_the_same_values_and_gradients(trained, tokenizer, monkeypatch):
    """Every live-loop prompt starts with the chat template's system message: that prefix runs once (batch 1)
    and the rows continue from its keys/values, gradients included (they flow back through the shared
    prefix once instead of per row)."""
    from livelora.trainer.prompt_kv import common_prefix

    m, _data = trained
    ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("Hi!", "What is two plus two?", "Name a colour.")
    ]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ids]
    replies = [tokenizer(r)["input_ids"] for r in (" Hello.", " Four, of course.", " Blue")]
    data = [kto_datum(p, r, lab) for p, r, lab in zip(prompts, replies, (1.0, 0.0, 1.0))]
    tokens = [d.model_input.to_ints() for d in data]
    shared = common_prefix(tokens)
    assert shared >= 16 and common_prefix(tokens[:1]) == 0 and common_prefix([t[:10] for t in tokens]) == 0
    results = []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(logprobs_mod, "common_prefix", lambda inputs: 0)
        lps = m.logprobs(tokens, [d.loss_fn_inputs["target_tokens"].to_torch() for d in data], adapter=False)
        out = m.forward_backward(data, "kto", {"beta": 0.1})
        results.append((lps, out.metrics, {k: p.grad.clone() for k, p in m.lora_params.items()}))
        m.zero_grad()
    (lp_once, met_once, g_once), (lp_full, met_full, g_full) = results
    for a, b in zip(lp_once, lp_full):
        assert torch.allclose(a, b, atol=2e-4)
    assert met_once == pytest.approx(met_full, abs=1e-5)
    for k in g_full:
        assert torch.allclose(g_once[k], g_full[k], atol=1e-6, rtol=1e-3), k
