"""Contract tests of the inference engines (livelora.gateway.engines) on the real SmolLM2-135M-Instruct.

Every test runs for each engine kind in ``ENGINE_KINDS`` (transformers always;
other kinds join when they are importable). One engine per kind is started for
the module and driven from one event loop, because engines may bind to the loop.
Expected values come from the model itself: solo greedy runs, ``score`` and a
plain peft model, never hard-coded completions.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from harness.engines import chat, collect, engine_kinds_under_test, greedy, logprob_tolerance
from harness.seeds import peft_versions

from livelora.clients.errors import BadRequestError, ConflictError, ContextLengthExceededError, ModelNotFoundError
from livelora.gateway.engines import SamplingParams

#: the harness ``engine`` runs on each of them
TEST_ENGINE_KINDS = engine_kinds_under_test()
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def paris(engine, run):
    """Solo greedy answer to QUESTION: (prompt, tokens, text, chunks)."""
    prompt = chat(engine, QUESTION)
    return (prompt, *run(collect(engine, prompt, greedy(12))))


def test_greedy_answer_contains_paris_and_is_stable(engine, run, paris):
    prompt, tokens, text, chunks = paris
    assert "Paris" in text
    assert chunks[-1].finish_reason is not None and all(c.finish_reason is None for c in chunks[:-1])
    again, text2, _ = run(collect(engine, prompt, greedy(12)))
    assert again == tokens and text2 == text
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_eos_ends_with_stop_and_is_not_in_text(engine, run, paris):
    prompt, tokens, text, chunks = paris
    assert len(tokens) < 12, "SmolLM2 answers this question in fewer than 12 tokens, then <|im_end|>"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason is None
    assert 2 not in tokens and "<|im_end|>" not in text
    # ignore_eos: generation runs past <|im_end|> (id 2) up to max_tokens
    past, _, pchunks = run(collect(engine, prompt, greedy(len(tokens) + 3, ignore_eos=True)))
    assert past[: len(tokens)] == tokens and past[len(tokens)] == 2
    assert len(past) == len(tokens) + 3 and pchunks[-1].finish_reason == "length"


def test_max_tokens_gives_length_with_exact_count_and_concurrent_requests_stay_isolated(engine, run):
    prompt = chat(engine, "Write a long story about a dragon.")

    async def three():
        return await asyncio.gather(
            *[collect(engine, prompt, SamplingParams(max_tokens=n, seed=n, ignore_eos=True)) for n in (3, 7, 5)]
        )

    for (tokens, _text, chunks), n in zip(run(three()), (3, 7, 5)):
        assert len(tokens) == n and chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == n


def test_stop_strings_and_stop_token_ids(engine, run, paris):
    prompt, tokens, text, _ = paris
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    stops = ("Paris", "is Par", "France is")  # one token, across two tokens, across a token boundary
    stop_id = tokens[3]

    async def all_at_once():
        return await asyncio.gather(
            *[collect(engine, prompt, greedy(12, stop=(s, "zzqx"))) for s in stops],
            collect(engine, prompt, greedy(12, stop_token_ids=(stop_id,))),
        )

    *by_string, (got, text, chunks) = run(all_at_once())
    for stop, (got_tokens, got_text, s_chunks) in zip(stops, by_string):
        assert got_text == full[: full.index(stop)], stop
        assert s_chunks[-1].finish_reason == "stop" and s_chunks[-1].stop_reason == stop
        assert got_tokens == tokens[: len(got_tokens)]
    assert got == tokens[:3]
    assert text == engine.tokenizer.decode(tokens[:3], skip_special_tokens=True)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop_id


def test_batched_greedy_equals_solo_greedy_including_late_joiners(engine, run, paris):
    prompts = [paris[0], chat(engine, "Write a haiku about the sea."), chat(engine, "hi")]
    solo = [paris[1]] + [run(collect(engine, p, greedy(6)))[0] for p in prompts[1:]]

    async def staggered():
        gen = engine.generate(prompts[1], greedy(6))
        head = await gen.__anext__()  # the haiku is running; the other two join its batch
        rest = asyncio.gather(collect(engine, prompts[0], greedy(12)), collect(engine, prompts[2], greedy(6)))
        tail = [c async for c in gen]
        first, third = await rest
        return [first[0], [t for c in [head, *tail] for t in c.token_ids], third[0]]

    for tokens, expected in zip(run(staggered()), solo):
        assert tokens == expected


def test_same_seed_same_tokens_also_when_batched_and_seeds_differ(engine, run):
    prompt = chat(engine, "Tell me a random fact.")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _, _ = run(collect(engine, prompt, params))

    async def batched():
        return await asyncio.gather(
            collect(
                engine,
                chat(engine, "hello"),
                SamplingParams(max_tokens=10, temperature=0.8, seed=7, top_p=0.9, top_k=40),
            ),
            collect(engine, prompt, params),
            collect(engine, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True)),
        )

    _, together, other = run(batched())
    assert together[0] == alone
    assert other[0] != alone


def test_logprobs_match_score_and_top_logprobs_are_sorted(engine, run):
    prompt = chat(engine, "Name a color.")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=True, top_logprobs=5, ignore_eos=True)
    tokens, _, chunks = run(collect(engine, prompt, params))
    lps = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens
    scored = run(engine.score(prompt + tokens, top_logprobs=5))
    assert len(scored) == len(prompt) + len(tokens) and scored[0] is None
    for lp, ref in zip(lps, scored[len(prompt) :]):
        assert ref.token_id == lp.token_id
        assert lp.logprob == pytest.approx(ref.logprob, abs=logprob_tolerance(engine))
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
        assert lp.logprob <= values[0] + 1e-6
        if lp.token_id in dict(lp.top):
            assert dict(lp.top)[lp.token_id] == pytest.approx(lp.logprob, abs=1e-6)


def test_multibyte_text_never_streams_replacement_chars(engine, run):
    prompt = chat(engine, "Reply with three emoji: \U0001f600\U0001f389\U0001f680")

    async def both():  # 9 tokens end on a character boundary, 8 cut the last emoji (its bytes are dropped)
        return await asyncio.gather(collect(engine, prompt, greedy(9)), collect(engine, prompt, greedy(8)))

    for tokens, text, chunks in run(both()):
        decoded = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert any(ord(ch) > 0xFFFF for ch in text), "the model answers with emoji (4-byte characters)"
        assert all("\ufffd" not in c.text for c in chunks)
        assert text == decoded.rstrip("\ufffd")


def test_cancellation_frees_the_slot(engine, run):
    prompt = chat(engine, "Write a long story about a dragon.")
    params = SamplingParams(max_tokens=500, temperature=1.0, seed=1, ignore_eos=True)

    async def close_early():
        gen = engine.generate(prompt, params)
        got = [await gen.__anext__(), await gen.__anext__()]
        assert engine.num_unfinished_requests() == 1
        await gen.aclose()
        return got

    async def cancel_task():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompt, params):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def drained():
        deadline = time.monotonic() + 20
        while engine.num_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return engine.num_unfinished_requests()

    for scenario in (close_early, cancel_task):
        run(scenario())
        assert run(drained()) == 0, scenario.__name__


def test_bad_requests_raise_and_change_nothing(engine, run):
    prompt = chat(engine, "hi")
    limit = engine.max_model_len
    with pytest.raises(ContextLengthExceededError) as err:
        engine.generate([1] * (limit - 2), SamplingParams(max_tokens=5))
    assert str(limit) in str(err.value) and str(limit - 2) in str(err.value) and "5" in str(err.value)
    for bad in (
        SamplingParams(max_tokens=0),
        SamplingParams(top_logprobs=21, logprobs=True),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(stop=("",)),
    ):
        with pytest.raises(BadRequestError):
            engine.generate(prompt, bad)
    with pytest.raises(ModelNotFoundError):
        engine.generate(prompt, SamplingParams(), adapter="no-such-adapter")
    with pytest.raises(BadRequestError):
        run(engine.score([]))
    assert engine.num_unfinished_requests() == 0


@pytest.fixture(scope="module")
def lora_dir(base_ref, tmp_path_factory):
    """A real rank-4 LoRA on SmolLM2 with deterministic non-zero lora_B, saved in PEFT format."""
    return peft_versions(base_ref, tmp_path_factory.mktemp("lora"), (0,), rank=4, b_scale=0.02)[0]


def test_adapter_load_generate_score_unload(engine, run, paris, lora_dir, base_ref, tmp_path):
    from peft import PeftModel

    from livelora.core.base_models import load_model

    prompt, base_tokens = paris[0], paris[1]
    tokens = prompt + base_tokens
    run(engine.load_adapter("test@1", str(lora_dir)))
    assert engine.loaded_adapters() == ["test@1"]
    with pytest.raises(ConflictError):
        run(engine.load_adapter("test@1", str(lora_dir)))
    with pytest.raises(BadRequestError):
        run(engine.load_adapter("test@2", str(lora_dir.parent / "missing")))
    assert engine.loaded_adapters() == ["test@1"]

    with torch.no_grad():
        ref = PeftModel.from_pretrained(load_model(base_ref), str(lora_dir)).eval()
        ref_lp = torch.log_softmax(ref(input_ids=torch.tensor([tokens])).logits[0, :-1], -1)
    pick = torch.tensor(tokens[1:])[:, None]
    expected = ref_lp.gather(1, pick).squeeze(1)
    got = torch.tensor([x.logprob for x in run(engine.score(tokens, adapter="test@1"))[1:]])
    base = torch.tensor([x.logprob for x in run(engine.score(tokens))[1:]])
    tol = logprob_tolerance(engine)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=tol)
    assert (got - base).abs().max().item() > 3 * tol  # the adapter's effect stands out of the rounding

    async def mixed():  # base and adapter sequences in one batch
        return await asyncio.gather(
            collect(engine, prompt, greedy(12)), collect(engine, prompt, greedy(6, logprobs=True), adapter="test@1")
        )

    (mixed_base, _, _), (ad_tokens, _, ad_chunks) = run(mixed())
    assert mixed_base == base_tokens
    ad_lps = [lp.logprob for c in ad_chunks for lp in (c.logprobs or [])]
    ad_ref = [x.logprob for x in run(engine.score(prompt + ad_tokens, adapter="test@1"))[len(prompt) :]]
    assert ad_lps == pytest.approx(ad_ref[: len(ad_lps)], abs=tol)

    run(engine.unload_adapter("test@1"))
    assert engine.loaded_adapters() == []
    with pytest.raises(ModelNotFoundError):
        engine.generate(prompt, greedy(2), adapter="test@1")
    with pytest.raises(ModelNotFoundError):
        run(engine.unload_adapter("test@1"))
    assert run(collect(engine, prompt, greedy(12)))[0] == base_tokens


# ----- helpers of the transformers engine (no model needed) ---------------------------------------------------


def test_stop_matcher_holds_back_possible_prefixes_and_cuts_at_the_earliest_match():
    from livelora.gateway.engines.detokenize import StopStringMatcher

    m = StopStringMatcher(["o w", "xyz"])
    outs = [m.feed(d) for d in ("Hel", "lo", " wo", "rld")]
    assert outs[:3] == [("Hel", None), ("l", None), ("", "o w")]  # "o" held until " w" proves the match
    assert m.feed("more") == ("", "o w") and m.flush() == ""
    m = StopStringMatcher(["xyz"])
    assert m.feed("abx") == ("ab", None) and m.feed("y") == ("", None) and m.flush() == "xy"


def test_incremental_detokenizer_matches_full_decode_on_emoji_and_cjk(tokenizer):
    from livelora.gateway.engines.detokenize import IncrementalDetokenizer

    text = "Emoji \U0001f600\U0001f389 and 中文字符, café — done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
    assert sum(1 for d in deltas[:-1] if d == "") >= 2, "multi-byte characters span several tokens here"


def test_sampling_filters_follow_top_k_then_top_p():
    from livelora.gateway.engines.sampling import RowSampling, make_generator, sample_batch

    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log()[None, :].repeat(3, 1)
    rows = [
        RowSampling(1.0, 1.0, 2, make_generator(0)),  # top-k 2: tokens 1 and 3
        RowSampling(1.0, 0.5, 0, make_generator(1)),  # top-p 0.5: 0.4 (token 1) then 0.3 (token 3) reaches it
        RowSampling(0.0, 1.0, 0, None, top_logprobs=2),
    ]  # greedy
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        step = sample_batch(logits, rows)
        for i, t in enumerate(step.token_ids):
            seen[i].add(t)
    assert seen == [{1, 3}, {1, 3}, {1}]
    assert step.logprobs[2] == pytest.approx(float(torch.log(torch.tensor(0.4))), abs=1e-6)
    assert [t for t, _ in step.top[2]] == [1, 3] and step.top[0] == []
    # a seeded row draws the same tokens alone and next to greedy / top-p companions
    g1, g2 = make_generator(42), make_generator(42)
    draws1 = [sample_batch(logits[:1], [RowSampling(1.0, 1.0, 0, g1)]).token_ids[0] for _ in range(20)]
    draws2 = [
        sample_batch(
            logits,
            [RowSampling(0.0, 1.0, 0, None), RowSampling(1.0, 1.0, 0, g2), RowSampling(0.7, 0.9, 0, make_generator(3))],
        ).token_ids[1]
        for _ in range(20)
    ]
    assert draws1 == draws2 and len(set(draws1)) > 1
