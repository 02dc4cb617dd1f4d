"""Transformers engine: adapter versions are copied into reusable LoRA slots (gateway/engines/lora_slots.py).

A hot-swap must not pay peft's ``add_adapter`` (about 0.2 s) on every version, so a version's
weights are copied into a free slot of the same shape. What must hold:

* a version loaded into a reused slot serves exactly its own weights (checked against a plain
  peft model built from the same directory), never a trace of the slot's previous occupant;
* slots are bounded: many load/unload cycles reuse them instead of growing the model;
* ``load_and_check`` hashes the very bytes it loads and returns canary logprobs of the new version;
* weights that do not fit (a tensor of the wrong shape) are refused, nothing stays loaded, and the
  slot still serves the next good version correctly;
* an adapter of another shape (other rank) gets its own slot and serves side by side.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil

import pytest
import torch
from harness.seeds import TARGETS, peft_versions
from safetensors.torch import load_file, save_file

from livelora.clients.errors import BadRequestError
from livelora.gateway.engines.transformers.calls import on_worker

LP_TOL = 1e-4  # nats, fp32


#: the harness ``engine`` (transformers)
ENGINE_OPTIONS = {"max_batch_size": 4}


@pytest.fixture(scope="module")
def versions(base_ref, tmp_path_factory):
    """Three rank-8 versions and one rank-4 version, all with random non-zero A and B."""
    root = tmp_path_factory.mktemp("slots")
    return (
        peft_versions(base_ref, root, (1, 2, 3), rank=8, b_scale=0.03, a_scale=0.05),
        peft_versions(base_ref, root, (4,), rank=4, b_scale=0.03, a_scale=0.05)[0],
    )


@pytest.fixture(scope="module")
def tokens(engine):
    return engine.tokenizer.encode(
        "The lighthouse keeper counted the ships: one, two, three.", add_special_tokens=False
    )


def _peft_reference(base_ref, path, tokens):
    """Logprobs of ``tokens[1:]`` under a plain peft model loaded from ``path`` (shape ``(T-1,)``)."""
    from peft import PeftModel

    from livelora.core.base_models import load_model

    with torch.no_grad():
        ref = PeftModel.from_pretrained(load_model(base_ref), str(path)).eval()
        lp = torch.log_softmax(ref(input_ids=torch.tensor([tokens])).logits[0, :-1], -1)
    return lp.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).tolist()


def _score(loop, engine, tokens, name):
    return [t.logprob for t in loop.run_until_complete(engine.score(tokens, adapter=name))[1:]]


async def _generate(engine, prompt, params, adapter):
    """One generation: ``(token ids, their logprobs)``."""
    out, lps = [], []
    async for chunk in engine.generate(prompt, params, adapter=adapter):
        out += chunk.token_ids
        lps += [t.logprob for t in chunk.logprobs or []]
    return out, lps


def _slots(loop, engine):
    """(version → slot name, free slot names) once the worker's queued commands (spare slots) have run."""
    worker = engine._worker
    loop.run_until_complete(on_worker(worker, lambda: None))
    loop.run_until_complete(on_worker(worker, lambda: None))
    slots = worker.backend.slots
    return {v: s.name for v, s in slots.versions.items()}, [s.name for s in slots.free_slots]


def test_reused_slots_serve_exactly_the_new_weights_and_stay_bounded(engine, loop, versions, tokens, base_ref):
    (v1, v2, v3), _ = versions
    refs = {p: _peft_reference(base_ref, p, tokens) for p in (v1, v2, v3)}
    assert max(abs(a - b) for a, b in zip(refs[v1], refs[v2])) > 1e-2  # versions are distinguishable

    seen_slots = set()
    cycle = [v1, v2, v3, v1, v2, v3, v1, v2]
    previous = None
    for i, path in enumerate(cycle, start=1):
        name = f"cyc@{i}"
        loop.run_until_complete(engine.load_adapter(name, str(path)))
        assert _score(loop, engine, tokens, name) == pytest.approx(refs[path], abs=LP_TOL), name
        if previous is not None:  # the old version still serves its own weights until it is unloaded
            assert _score(loop, engine, tokens, previous[0]) == pytest.approx(refs[previous[1]], abs=LP_TOL)
            loop.run_until_complete(engine.unload_adapter(previous[0]))
        previous = (name, path)
        mapping, free = _slots(loop, engine)
        seen_slots.update(mapping.values())
        seen_slots.update(free)
        assert list(mapping) == [name] and len(free) <= 2
    assert len(seen_slots) <= 3, f"slots were not reused: {sorted(seen_slots)}"
    loop.run_until_complete(engine.unload_adapter(previous[0]))
    mapping, free = _slots(loop, engine)
    assert mapping == {} and free == [] and engine._worker.backend.slots.peft is None  # plain model again


def test_load_and_check_hashes_the_loaded_bytes_and_scores_the_canary(engine, loop, versions, tokens, base_ref):
    (v1, _, _), _ = versions
    check = loop.run_until_complete(engine.load_and_check("chk@1", str(v1), tokens))
    try:
        digest = hashlib.sha256((v1 / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert check.sha256 == digest
        assert check.canary[0] is None
        assert [t.logprob for t in check.canary[1:]] == pytest.approx(_peft_reference(base_ref, v1, tokens), abs=LP_TOL)
    finally:
        loop.run_until_complete(engine.unload_adapter("chk@1"))


def test_misfit_weights_are_refused_and_the_slot_serves_the_next_version(
    engine, loop, versions, tokens, base_ref, tmp_path
):
    (v1, v2, _), rank4 = versions
    loop.run_until_complete(engine.load_adapter("fit@1", str(v1)))
    _slots(loop, engine)  # let queued worker commands run
    bad = tmp_path / "bad"
    shutil.copytree(v2, bad)
    weights = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in weights if "lora_A" in k)
    weights[key] = weights[key][:1].contiguous()  # rank 1 where the config says 8: broadcastable, so dangerous
    save_file(weights, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadRequestError, match="shape"):
        loop.run_until_complete(engine.load_adapter("fit@2", str(bad)))
    assert engine.loaded_adapters() == ["fit@1"]

    loop.run_until_complete(engine.load_adapter("fit@3", str(v2)))  # takes the slot the misfit scribbled on
    assert _score(loop, engine, tokens, "fit@3") == pytest.approx(_peft_reference(base_ref, v2, tokens), abs=LP_TOL)
    assert _score(loop, engine, tokens, "fit@1") == pytest.approx(_peft_reference(base_ref, v1, tokens), abs=LP_TOL)

    # another rank: its own slot, served side by side with the rank-8 versions
    loop.run_until_complete(engine.load_adapter("r4@1", str(rank4)))
    mapping, _ = _slots(loop, engine)
    assert len({mapping["r4@1"], mapping["fit@1"], mapping["fit@3"]}) == 3
    assert _score(loop, engine, tokens, "r4@1") == pytest.approx(_peft_reference(base_ref, rank4, tokens), abs=LP_TOL)
    for name in ("fit@1", "fit@3", "r4@1"):
        loop.run_until_complete(engine.unload_adapter(name))
    assert engine.loaded_adapters() == []


@pytest.mark.parametrize("count", [2, 3])
def test_a_batch_mixing_versions_and_the_base_model_serves_each_row_its_own_weights(
    engine, loop, versions, tokens, count
):
    """Rows on two versions (the rank-stacked pass, MixedRows) or three (from GATHER_FROM on: the gathered
    product, GatheredRows; two shapes would fall back to peft) plus a base row decode together; each row's
    logprobs equal its version scored alone."""
    from livelora.gateway.engines import SamplingParams
    from livelora.gateway.engines.lora_pool import GATHER_FROM

    names = [f"mix@{k}" for k in range(1, count + 1)]
    for name, path in zip(names, versions[0]):
        loop.run_until_complete(engine.load_adapter(name, str(path)))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)
    prompt = tokens[:10]

    async def together():
        return await asyncio.gather(*(_generate(engine, prompt, params, a) for a in names + [None]))

    steps_before = engine.decode_steps
    results = loop.run_until_complete(together())
    assert engine.decode_steps - steps_before <= 8  # the rows really decoded in one batch
    slots = engine._worker.backend.slots
    slot_names = tuple(slots.versions[n].name for n in names)
    if count < GATHER_FROM:
        assert any(set(key) == set(slot_names) and stacks for key, stacks in slots.stacks.items()), (
            "the stacked mixed-version pass (MixedRows) did not run"
        )
    else:
        assert set(slot_names) <= set(slots.pool.rows) and slots.pool.layers, "the gathered product did not run"
    for adapter, (out, lps) in zip(names + [None], results):
        alone = loop.run_until_complete(engine.score(prompt + out, adapter=adapter))[len(prompt) :]
        assert lps == pytest.approx([t.logprob for t in alone], abs=LP_TOL), adapter
    assert (
        len({tuple(o) for o, _ in results}) > 1 or max(abs(a - b) for a, b in zip(results[0][1], results[-1][1])) > 1e-2
    )  # rows really differ
    for name in names:
        loop.run_until_complete(engine.unload_adapter(name))


def test_a_version_every_row_uses_is_served_from_merged_weights_equal_to_its_own(
    engine, loop, versions, tokens, base_ref
):
    """After MERGE_AFTER_STEPS passes with every row on one version, the layers run on merged weights
    W + s·B A; the tokens' logprobs still equal a plain peft model's, and when the slot takes the next
    version the merged copy is dropped and rebuilt from the new weights (no stale update is served)."""
    from livelora.gateway.engines import SamplingParams
    from livelora.gateway.engines.lora_slots import MERGE_AFTER_STEPS

    (v1, v2, _), _ = versions
    slots = engine._worker.backend.slots
    params = SamplingParams(max_tokens=MERGE_AFTER_STEPS + 6, temperature=0.0, logprobs=True, ignore_eos=True)
    prompt = tokens[:8]

    for name, path in (("solo@1", v1), ("solo@2", v2)):
        loop.run_until_complete(engine.load_adapter(name, str(path)))
        slot = slots.versions[name]
        assert slots.merged is None or slots.merged.slot is not slot  # a fresh version starts stacked
        out, lps = loop.run_until_complete(_generate(engine, prompt, params, name))
        assert slots.merged is not None and slots.merged.slot is slot, "the merged pass did not run"
        assert len(slots.merged.weights) == 30 * len(TARGETS)  # every adapted layer of SmolLM2's 30 blocks
        reference = _peft_reference(base_ref, path, prompt + out)[len(prompt) - 1 :]
        assert lps == pytest.approx(reference, abs=LP_TOL), name
        loop.run_until_complete(engine.unload_adapter(name))
        assert slots.merged is None or slots.merged.slot is None  # the slot is free: its merge is stale


def test_a_version_that_cannot_be_merged_leaves_the_served_merge_intact(engine, loop, versions, tokens, base_ref):
    """A version with a layer MergedVersion cannot merge (here: one layer flagged ``fan_in_fan_out``) is served by
    the stacked pass, and trying to merge it writes nothing into the buffers of the version merged before."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    from livelora.gateway.engines import SamplingParams
    from livelora.gateway.engines.lora_slots import MERGE_AFTER_STEPS

    (v1, v2, _), _ = versions
    slots = engine._worker.backend.slots
    params = SamplingParams(max_tokens=MERGE_AFTER_STEPS + 4, temperature=0.0, logprobs=True, ignore_eos=True)
    prompt = tokens[:8]
    loop.run_until_complete(engine.load_adapter("keep@1", str(v1)))
    loop.run_until_complete(_generate(engine, prompt, params, "keep@1"))
    kept = slots.merged
    assert kept is not None and kept.slot is slots.versions["keep@1"]
    before = {k: w.clone() for k, w in kept.weights.items()}
    loop.run_until_complete(engine.load_adapter("flat@1", str(v2)))
    last = [m for m in slots.peft.modules() if isinstance(m, LoraLinear)][-1]  # merged last: the others first
    last.fan_in_fan_out = True
    try:
        out, lps = loop.run_until_complete(_generate(engine, prompt, params, "flat@1"))
    finally:
        last.fan_in_fan_out = False
    assert not slots.versions["flat@1"].mergeable and slots.merged is kept
    assert all(torch.equal(before[k], w) for k, w in kept.weights.items())  # not a value overwritten
    assert lps == pytest.approx(_peft_reference(base_ref, v2, prompt + out)[len(prompt) - 1 :], abs=LP_TOL)
    out, lps = loop.run_until_complete(_generate(engine, prompt, params, "keep@1"))  # served merged, still v1's
    assert lps == pytest.approx(_peft_reference(base_ref, v1, prompt + out)[len(prompt) - 1 :], abs=LP_TOL)
    for name in ("keep@1", "flat@1"):
        loop.run_until_complete(engine.unload_adapter(name))


def test_prefill_groups_bound_padding_and_put_short_prompts_first():
    from types import SimpleNamespace

    from livelora.gateway.engines.batching import PAD_ALLOWANCE, PAD_SLACK, prefill_groups

    seqs = [SimpleNamespace(prompt=[0] * n) for n in (30, 1, 31, 1, 120, 2, 29)]
    groups = prefill_groups(seqs)
    assert [[len(s.prompt) for s in g] for g in groups] == [[1, 1, 2], [29, 30, 31], [120]]
    for g in groups:
        lengths = [len(s.prompt) for s in g]
        assert max(lengths) * len(lengths) <= PAD_SLACK * sum(lengths) + PAD_ALLOWANCE
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in seqs)  # each exactly once
    assert prefill_groups([]) == []


def test_a_version_is_not_unloaded_under_a_sequence_taken_for_prefill(engine, loop, versions):
    """Between two prefill groups the worker runs commands; a sequence already taken from the queue but not
    yet prefilled still counts as a user of its version."""
    from types import SimpleNamespace

    from livelora.clients.errors import ConflictError

    (v1, _, _), _ = versions
    loop.run_until_complete(engine.load_adapter("held@1", str(v1)))
    worker = engine._worker
    pending = SimpleNamespace(adapter="held@1", cancelled=False, finished=False)

    def unload_while_admitting():
        worker.admitting = [pending]
        try:
            worker.unload_adapter("held@1")
        finally:
            worker.admitting = []

    with pytest.raises(ConflictError):
        loop.run_until_complete(on_worker(worker, unload_while_admitting))
    assert engine.loaded_adapters() == ["held@1"]
    loop.run_until_complete(engine.unload_adapter("held@1"))
