"""``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and ``min_p`` honoured at any value in range
(issue 29), with vLLM's formulas (:class:`livelora.gateway.engines.sampling.Penalties`), on the real SmolLM2:

* the penalised logits of a known context equal the formulas computed by hand, and transformers'
  ``RepetitionPenaltyLogitsProcessor`` on the whole vocabulary;
* greedy replies through a live gateway equal ``model.generate(repetition_penalty=...)`` and a greedy loop that
  applies OpenAI's frequency / presence penalty by hand;
* every token drawn with ``min_p`` has at least ``min_p`` × the top token's probability; ``top_k`` still works;
* a value out of range is a 400 naming the field.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from harness.server import MODEL

from livelora.gateway.engines.sampling import Penalties, RowSampling, make_generator, sample_batch

PROMPT = "Repeat after me: red, green, blue, red, green, blue, red, green,"
N = 10


@pytest.fixture(scope="module")
def model(base_ref):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_ref.path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=False)


def next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def complete(server, prompt_ids: list[int], **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": N, "temperature": 0, "logprobs": 1, **kw}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=300)


def reply(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"]


def test_penalised_logits_of_a_known_context_equal_the_formulas(model, prompt_ids):
    from transformers import RepetitionPenaltyLogitsProcessor

    raw = next_logits(model, prompt_ids)
    out = [int(raw.argmax()), int(raw.argsort()[-2])]  # an output so far: the top token twice, the second once
    counts = {out[0]: 2, out[1]: 1}
    rep = raw.clone()
    Penalties(1.3, prompt=tuple(prompt_ids), counts=dict(counts)).apply(rep)
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt_ids + [out[0], out[0], out[1]]]), raw[None].clone())
    assert torch.allclose(rep, hf[0], atol=0, rtol=0)
    got = raw.clone()
    Penalties(1.3, 0.5, 0.25, tuple(prompt_ids), dict(counts)).apply(got)
    for t in {*prompt_ids, *counts}:
        lr = raw[t].item()
        lr = lr / 1.3 if lr > 0 else lr * 1.3  # CTRL's repetition penalty on every token seen
        c = counts.get(t, 0)
        assert got[t].item() == pytest.approx(lr - c * 0.25 - (c > 0) * 0.5, abs=1e-5), t
    untouched = torch.ones_like(raw, dtype=torch.bool)
    untouched[list({*prompt_ids, *counts})] = False
    assert torch.equal(got[untouched], raw[untouched])


def test_min_p_keeps_only_tokens_near_the_top_one(model, prompt_ids):
    raw = next_logits(model, prompt_ids[:-3])
    probs = torch.softmax(raw, -1)
    allowed = set(torch.nonzero(probs >= 0.02 * probs.max()).flatten().tolist())
    assert 2 < len(allowed) < 200
    drawn = set()
    for seed in range(100):
        row = RowSampling(1.0, 1.0, 0, make_generator(seed), min_p=0.02)
        drawn.add(sample_batch(raw[None], [row]).token_ids[0])
    assert drawn <= allowed and len(drawn) > 2


def test_greedy_with_repetition_penalty_equals_transformers_generate(live_server, model, tokenizer, prompt_ids):
    with torch.no_grad():
        want = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=N, do_sample=False, repetition_penalty=1.5, top_p=None
        )[0, len(prompt_ids) :].tolist()
    plain = reply(complete(live_server, prompt_ids))
    got = reply(complete(live_server, prompt_ids, repetition_penalty=1.5))
    assert got == tokenizer.decode(want, skip_special_tokens=True) and got != plain


def test_greedy_with_frequency_and_presence_penalty_equals_a_loop_by_hand(live_server, model, tokenizer, prompt_ids):
    ids, counts = list(prompt_ids), {}
    for _ in range(N):  # OpenAI's definition: logit - count * frequency_penalty - (count > 0) * presence_penalty
        logits = next_logits(model, ids)
        for t, c in counts.items():
            logits[t] -= c * 0.8 + 0.6
        t = int(logits.argmax())
        if t == tokenizer.eos_token_id:
            break
        counts[t] = counts.get(t, 0) + 1
        ids.append(t)
    plain = reply(complete(live_server, prompt_ids))
    got = reply(complete(live_server, prompt_ids, frequency_penalty=0.8, presence_penalty=0.6))
    assert got == tokenizer.decode(ids[len(prompt_ids) :]) and got != plain


def test_sampled_tokens_respect_min_p_and_top_k_still_works(live_server, prompt_ids):
    greedy = reply(complete(live_server, prompt_ids))
    for seed in (1, 2):
        r = complete(live_server, prompt_ids, temperature=1.0, top_p=1.0, min_p=0.3, seed=seed, max_tokens=16)
        lp = r.json()["choices"][0]["logprobs"]
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):  # raw logprobs, temperature 1
            assert chosen >= math.log(0.3) + max(top.values()) - 1e-4
    for extra in ({"min_p": 1.0}, {"top_k": 1}):  # only the most likely token survives: greedy
        r = complete(live_server, prompt_ids, temperature=1.0, top_p=1.0, seed=5, **extra)
        assert r.json()["choices"][0]["text"] == greedy, extra


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0), ("min_p", 1.5)],
)
def test_a_value_out_of_range_is_400_naming_the_field(live_server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    r = httpx.post(live_server.url(path), json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
