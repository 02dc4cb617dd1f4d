"""Hot and cold adapter versions (gateway/engines/residency.py) on the transformers and llama_cpp engines: with
more versions loaded than ``max_loaded_versions``, every version is still served, each request's reply equals its
version's reply served alone (and its logprobs the engine's ``score`` under that version), idle versions are made
cold and loaded back on demand, from the engine's own copy (the store's directory may be gone), never more resident
than the bound while requests wait, and a cold version unloads, scores and reloads like a resident one.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from harness.engines import chat, collect, greedy, logprob_tolerance
from harness.seeds import peft_versions

from livelora.clients.errors import BadRequestError, ModelNotFoundError
from livelora.gateway.engines import create_engine

TEST_ENGINE_KINDS = ["transformers", "llama_cpp"]
BOUND = 3
ENGINE_OPTIONS = {"max_loaded_versions": BOUND, "max_batch_size": 4}
VERSIONS = 6


@pytest.fixture(scope="module")
def versions(base_ref, tmp_path_factory):
    """Six real rank-8 LoRA versions on SmolLM2 (attention + MLP), different non-zero lora_B."""
    seeds = range(1, VERSIONS + 1)
    return peft_versions(base_ref, tmp_path_factory.mktemp("many"), seeds, rank=8, b_scale=0.03, name="v{seed}")


def _lps(chunks):
    return [lp.logprob for c in chunks for lp in (c.logprobs or [])]


def test_more_versions_than_the_bound_are_each_served_as_alone_and_made_cold_and_loaded_back(
    engine, run, versions, tmp_path
):
    residency = engine._worker.residency
    prompt = chat(engine, "Describe the sea in two sentences.")
    names = [f"pop@{k}" for k in range(VERSIONS)]
    copies = []
    for name, path in zip(names, versions):  # the live loop's way: load_and_check with a canary
        copies.append(shutil.copytree(path, tmp_path / name))
        run(engine.load_and_check(name, str(copies[-1]), prompt))
    assert sorted(engine.loaded_adapters()) == names
    assert len(residency.resident) == BOUND and residency.cold == set(names[:-BOUND])
    assert residency.evictions == VERSIONS - BOUND

    for path in copies:  # served from the engine's own copies from now on
        shutil.rmtree(path)
    alone = {name: run(collect(engine, prompt, greedy(10, logprobs=True), adapter=name)) for name in names}
    assert len({tuple(tokens) for tokens, _, _ in alone.values()}) > 1  # the versions answer differently
    assert residency.loads >= VERSIONS - BOUND

    loads, evictions = residency.loads, residency.evictions
    order = names + names[::-1]  # two rows per version, more versions than the bound in one queue

    async def together():
        return await asyncio.gather(*[collect(engine, prompt, greedy(10, logprobs=True), adapter=n) for n in order])

    tol = logprob_tolerance(engine)
    for name, (tokens, _, chunks) in zip(order, run(together())):
        assert tokens == alone[name][0], name
        scored = [x.logprob for x in run(engine.score(prompt + tokens, adapter=name))[len(prompt) :]]
        assert _lps(chunks) == pytest.approx(scored[: len(tokens)], abs=tol)
    assert residency.loads > loads and residency.evictions > evictions
    assert len(residency.resident) <= BOUND + 1  # a score may load one beyond the bound until the next load


def test_a_cold_version_scores_unloads_and_its_name_loads_again(engine, run, versions, tmp_path):
    residency = engine._worker.residency
    prompt = chat(engine, "Name a fruit.")
    for name in [n for n in engine.loaded_adapters()]:
        run(engine.unload_adapter(name))
    assert not residency.resident and not residency.cold
    for k, path in enumerate(versions[: BOUND + 1]):
        run(engine.load_adapter(f"cold@{k}", str(path)))
    cold = next(iter(residency.cold))
    scored = run(engine.score(prompt, adapter=cold))
    assert cold in residency.resident
    run(engine.unload_adapter(next(iter(residency.cold))))
    run(engine.unload_adapter(cold))
    with pytest.raises(ModelNotFoundError):
        engine.generate(prompt, greedy(2), adapter=cold)
    run(engine.load_adapter(cold, str(versions[int(cold[-1])])))
    assert [x.logprob for x in run(engine.score(prompt, adapter=cold))[1:]] == pytest.approx(
        [x.logprob for x in scored[1:]], abs=logprob_tolerance(engine)
    )


def test_the_bound_must_be_positive():
    with pytest.raises(BadRequestError, match="max_loaded_versions"):
        create_engine("transformers", device="cpu", max_loaded_versions=0)
