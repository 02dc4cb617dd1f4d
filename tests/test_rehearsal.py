"""Rehearsal and the KL toward the base model (trainer/rehearsal.py): the pool, the cached base replies, the
gradients a step gains, the KL's value."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from livelora.clients.types import LoraConfig, TensorData
from livelora.clients.types.signals import ChatMessage
from livelora.core.base_models import base_identity, load_model
from livelora.trainer.capability import CATEGORIES
from livelora.trainer.event_datums import EventDatums, completion_datum
from livelora.trainer.model import TrainingModel
from livelora.trainer.rehearsal import (
    POOLS,
    Rehearsal,
    kl_base_new,
    load_prompts,
    shipped_file,
    shipped_key,
    trained_kl_gradients,
)
from livelora.trainer.settings import TrainingSection

ROOT = Path(__file__).resolve().parent.parent


def fold(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_pool_is_large_varied_and_disjoint_from_every_evaluation_and_example(pool):
    path = POOLS[pool]
    prompts = load_prompts(path)
    kinds = {json.loads(line)["kind"] for line in path.read_text().splitlines() if line.strip()}
    assert len(prompts) >= 64 and len(set(map(fold, prompts))) == len(prompts)
    # the capability pool: the check's four kinds, interleaved so that every 4-prompt step mixes them
    assert kinds == set(CATEGORIES) if pool == "capability" else len(kinds) >= 6
    if pool == "capability":
        first = [json.loads(line)["kind"] for line in path.read_text().splitlines()[:20]]
        assert set(first) == set(CATEGORIES)
    held = [json.loads(line)["prompt"] for f in sorted((ROOT / "trainer/rails").glob("*.jsonl")) if f != path
            for line in f.read_text().splitlines() if line.strip()]  # fmt: skip
    assert len(held) >= 24  # the probes, the free-form capability sets, the other pool
    spec = importlib.util.spec_from_file_location("live_loop", ROOT / "bench/live_loop.py")
    live_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(live_loop)
    held += live_loop.PROMPTS
    spec = importlib.util.spec_from_file_location("tastes", ROOT / "bench/tastes.py")
    tastes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tastes)
    held += [*tastes.EVERYDAY[0], *tastes.EVERYDAY[1]] + [p for p, _ in tastes.FACTS[0] + tastes.FACTS[1]]
    assert not {fold(p) for p in prompts} & {fold(p) for p in held}
    pages = " ".join(fold(p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    assert [p for p in prompts if fold(p) in pages] == []


def test_kl_matches_a_hand_computation_and_is_zero_for_equal_rows():
    base = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    new = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    # row 1: 0.5·ln(0.5/0.25) + 0.5·ln(0.5/0.75) = 0.5·ln(4/3); row 2: 0
    assert float(kl_base_new(base, new)) == pytest.approx(0.5 * 0.5 * math.log(4 / 3), rel=1e-6)
    assert float(kl_base_new(base, base)) == 0.0
    assert float(kl_base_new(new, base)) != pytest.approx(float(kl_base_new(base, new)))  # not symmetric


def test_settings_refuse_a_kl_without_prompts_and_map_lora_targets():
    with pytest.raises(ValidationError, match="kl_coef > 0 needs rehearsal_per_step"):
        TrainingSection(kl_coef=0.1)
    assert TrainingSection(kl_coef=0.1, rehearsal_per_step=2).kl_coef == 0.1
    attn = TrainingSection(lora_targets="attn").lora
    assert (attn.train_attn, attn.train_mlp, attn.train_unembed) == (True, False, False)
    mlp = TrainingSection(lora_targets="mlp").lora
    assert (mlp.train_attn, mlp.train_mlp) == (False, True)


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_the_built_in_models_base_replies_ship_so_a_fresh_stores_first_step_does_not_generate_them(
    base_ref, tokenizer, tmp_path, pool
):
    config = TrainingSection(rehearsal_pool=pool)  # otherwise the defaults: the shipped file's key is theirs
    rehearsal = Rehearsal(base_ref, tmp_path, EventDatums(base_ref, config), config, base_identity(base_ref))
    doc = json.loads(shipped_file(POOLS[pool]).read_text())
    prompts = load_prompts(POOLS[pool])
    assert doc["key"] == shipped_key(prompts, base_identity(base_ref), config.rehearsal_max_tokens), (
        "the pool, the built-in weights or rehearsal_max_tokens changed: run bench/make_rehearsal_base.py"
    )
    replies = rehearsal.replies()
    assert rehearsal.source == "shipped" and len(replies) == len(prompts) and not rehearsal.cache_path().exists()
    first = replies[0]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": first.prompt}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    assert first.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert all(4 <= len(r.reply_ids) <= config.rehearsal_max_tokens for r in replies)
    assert all(tokenizer.decode(r.reply_ids, skip_special_tokens=True).strip() for r in replies)
    other = Rehearsal(base_ref, tmp_path, rehearsal.examples, config, "another-base")
    assert other.shipped() is None  # another base model generates its own


@pytest.fixture(scope="module")
def config():
    return TrainingSection(rehearsal_per_step=3, rehearsal_max_tokens=8, kl_coef=0.5)


@pytest.fixture(scope="module")
def rehearsal(base_ref, tmp_path_factory, config):
    home, examples = tmp_path_factory.mktemp("home"), EventDatums(base_ref, config)
    return Rehearsal(base_ref, home, examples, config, "base-a", prompts=load_prompts()[:4])


def test_rehearsal_replies_are_the_base_models_greedy_replies_and_cached(base_ref, tokenizer, rehearsal, config):
    replies = rehearsal.replies()
    assert rehearsal.source == "generated" and len(replies) == 4
    base = load_model(base_ref)
    eos = tokenizer.eos_token_id
    for r in replies[:2]:  # each alone, no batch: what a user would get at temperature 0
        text = tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert r.prompt_ids == ids
        out = base.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=eos)
        want = out[0, len(ids) :].tolist()
        assert r.reply_ids == (want[: want.index(eos) + 1] if eos in want else want)
        assert len(tokenizer.decode(r.reply_ids, skip_special_tokens=True).split()) >= 1
    pool = rehearsal.prompts
    again = Rehearsal(base_ref, rehearsal.home, rehearsal.examples, config, "base-a", pool)
    assert again.replies() == replies and again.source == "cache" and rehearsal.cache_path().exists()
    other = Rehearsal(base_ref, rehearsal.home, rehearsal.examples, config, "base-b", pool)
    assert other.cache_path() != rehearsal.cache_path() and not other.cache_path().exists()
    nine = config.model_copy(update={"rehearsal_max_tokens": 9})
    assert Rehearsal(base_ref, rehearsal.home, rehearsal.examples, nine, "base-a", pool).cache_path() != (
        rehearsal.cache_path()
    )
    assert Rehearsal(base_ref, rehearsal.home, rehearsal.examples, config, "base-a", pool[:3]).cache_path() != (
        rehearsal.cache_path()
    )


def grads(model: TrainingModel) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.lora_params.values()])


def test_a_step_with_rehearsal_adds_its_gradients_and_the_kl_is_zero_at_a_zero_adapter(base_ref, tokenizer, rehearsal):
    model = TrainingModel(base_ref, LoraConfig(rank=4, seed=0, train_unembed=False))
    ex = rehearsal.examples
    batch = [
        completion_datum(*ex.chat_pair([ChatMessage(role="user", content=p)], r), {"label": _label(y)})
        for p, r, y in [("Say hi.", "Hi!", 1), ("Say bye.", "Goodbye, see you soon, take care.", 0)]
    ]
    cfg = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
    model.forward_backward(batch, "kto", cfg)
    alone = grads(model)
    model.zero_grad()
    rehearsal._next = 0
    metrics = rehearsal.add_gradients(model)  # lora_B = 0: the new model is the base, so the KL is 0
    assert metrics["rehearsal_kl:mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rehearsal_prompts:sum"] == 3 and metrics["rehearsal_tokens:sum"] > 3 * 8
    assert metrics["rehearsal_loss:mean"] > 0
    only = grads(model)
    model.forward_backward(batch, "kto", cfg)
    both = grads(model)
    assert not torch.allclose(both, alone) and only.abs().sum() > 0
    torch.testing.assert_close(both, alone + only, rtol=1e-4, atol=1e-7)  # gradients accumulate
    model.zero_grad()


def _label(y: int) -> TensorData:
    return TensorData.from_list([float(y)], "float32")


def test_the_kl_on_the_trained_replies_is_zero_at_a_zero_adapter_and_matches_each_reply_run_alone(base_ref, rehearsal):
    model = TrainingModel(base_ref, LoraConfig(rank=4, seed=0, train_unembed=False))
    ex = rehearsal.examples
    pairs = [("Say hi.", "Hi there!"), ("Name a colour.", "Blue, the colour of a clear sky at noon.")]
    batch = [completion_datum(*ex.chat_pair([ChatMessage(role="user", content=p)], r)) for p, r in pairs]
    zero = trained_kl_gradients(model, batch, 1.0)
    assert zero["trained_kl:mean"] == pytest.approx(0.0, abs=1e-6)
    g0 = grads(model).abs().max()  # zero where new = base, up to float rounding (compared below)
    want_tokens = sum(int(sum(d.loss_fn_inputs["weights"].tolist())) for d in batch)
    assert zero["trained_kl_tokens:sum"] == want_tokens
    model.zero_grad()
    with torch.no_grad():  # move the adapter off zero
        gen = torch.Generator().manual_seed(1)
        for name, p in model.lora_params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    causal_lm = model.peft_model.get_base_model()
    kls = []
    for d in batch:  # each reply alone, unpadded, the whole head: Σ_v p_base (log p_base − log p_new) per position
        ids = torch.tensor([d.model_input.to_ints()])
        sel = torch.tensor(d.loss_fn_inputs["weights"].tolist()) != 0
        with torch.no_grad():
            new = torch.log_softmax(causal_lm(input_ids=ids).logits[0, sel].float(), -1)
            with model.peft_model.disable_adapter():
                base = torch.log_softmax(causal_lm(input_ids=ids).logits[0, sel].float(), -1)
        kls += (base.exp() * (base - new)).sum(-1).tolist()
    one = trained_kl_gradients(model, batch, 1.0)
    assert one["trained_kl:mean"] > 1e-4
    assert one["trained_kl:mean"] == pytest.approx(sum(kls) / len(kls), rel=1e-3)  # the mean over every position
    g1 = grads(model)
    assert g0 < 1e-3 * g1.abs().max()
    model.zero_grad()
    trained_kl_gradients(model, batch, 2.0)
    torch.testing.assert_close(grads(model), 2 * g1, rtol=1e-4, atol=1e-8)  # coef scales the gradient
    model.zero_grad()


def test_the_trained_kl_is_off_by_default_and_its_coefficient_is_not_negative():
    assert TrainingSection().trained_kl_coef == 0.0
    assert TrainingSection(trained_kl_coef=0.3).trained_kl_coef == 0.3
    with pytest.raises(ValidationError):
        TrainingSection(trained_kl_coef=-1)
